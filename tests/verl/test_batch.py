"""RolloutBatch helpers: the token-balanced order of a step's trajectories across workers."""
import random

import pytest
import torch

from verl.batch import balanced_order, pack_trajectories


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
