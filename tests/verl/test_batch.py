"""RolloutBatch helpers: the token-balanced order of a step's trajectories across workers."""
import random

import pytest
import torch

from verl.batch import balanced_order, pack_trajectories, token_budget_parts


def _parts(tokens, order, parts):
    size = len(tokens) // parts
    return [[tokens[i] for i in order[p * size:(p + 1) * size]] for p in range(parts)]


def test_a_long_group_is_spread_over_the_workers():
    # one prompt's samples are long, the other's short, and they sit together as the rollout returns them
    tokens = [900, 850, 870, 910, 60, 55, 70, 65]
    contiguous = _parts(tokens, list(range(8)), 2)
    assert max(map(sum, contiguous)) / (sum(tokens) / 2) > 1.8
    balanced = _parts(tokens, balanced_order(tokens, 2), 2)
    assert sorted(balanced[0] + balanced[1]) == sorted(tokens) and all(len(p) == 4 for p in balanced)
    assert max(map(sum, balanced)) / (sum(tokens) / 2) < 1.02


def test_the_order_is_a_permutation_with_equal_parts_on_multi_turn_lengths():
    rng = random.Random(0)
    tokens = [rng.choice([150, 400, 900, 1400]) + rng.randrange(50) for _ in range(160)]
    order = balanced_order(tokens, 4)
    assert sorted(order) == list(range(160))
    totals = [sum(p) for p in _parts(tokens, order, 4)]
    assert max(totals) / (sum(totals) / 4) < 1.01
    with pytest.raises(ValueError, match="equal parts"):
        balanced_order(tokens[:7], 4)


def test_select_carries_every_field_and_the_info_lists_along():
    batch = pack_trajectories([[1, 2], [3]], [[4], [5, 6, 7]], [[1], [1, 0, 1]], [0, 1], 0)
    batch.info = {"stats": ["a", "b"]}
    batch.rewards_B = torch.tensor([0.0, 1.0])
    swapped = batch.select(balanced_order(batch.attention_mask_BT.sum(1).tolist(), 1)[::-1])
    assert swapped.info["stats"] == ["b", "a"] and swapped.rewards_B.tolist() == [1.0, 0.0]
    assert swapped.group_ids_B.tolist() == [1, 0]


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_parts_hold_every_row_once_within_the_budget(seed):
    rng = random.Random(seed)
    tokens = [rng.randint(1, 900) for _ in range(rng.randint(1, 40))]
    budget = 1000
    parts = token_budget_parts(tokens, budget)
    assert sorted(i for p in parts for i in p) == list(range(len(tokens)))
    assert all(sum(tokens[i] for i in p) <= budget for p in parts)
    assert len(parts) <= max(1, 2 * -(-sum(tokens) // budget))   # never far from the least possible
    assert all(p == sorted(p) for p in parts) and [p[0] for p in parts] == sorted(p[0] for p in parts)
    # a count agreed with other ranks: exactly that many parts, nearly even
    exact = token_budget_parts(tokens, budget, parts=len(tokens))
    assert len(exact) == len(tokens)


def test_a_row_longer_than_the_budget_gets_a_part_of_its_own():
    assert token_budget_parts([50, 5, 5], 10) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="3 rows into 4"):
        token_budget_parts([1, 2, 3], 10, parts=4)
