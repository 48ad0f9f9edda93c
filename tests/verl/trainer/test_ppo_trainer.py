"""PPOTrainer's choice of the separate old-log-prob pass (actor.old_log_probs)."""
import pytest

from verl.config.load import load_config
from verl.config.sizes import derive_sizes
from verl.trainer.ppo_trainer import PPOTrainer
from verl.utils.dataset import Example, PromptSampler


def _trainer(**keys) -> PPOTrainer:
    raw = {"data": {"train_files": "x", "train_batch_size": 4}, "reward": {"function": "search_r1.rewards:score_for"},
           "actor_rollout_ref": {"model": {"path": "m"}, "rollout": {"n_agent": 2},
                                 "actor": {"ppo_mini_batch_size": 8, "ppo_micro_batch_size": 4, "use_kl_loss": True}},
           "algorithm": {"adv_estimator": "grpo"}, "trainer": {"n_gpus_per_node": 2}}
    for dotted, value in keys.items():
        *path, last = dotted.split("__")
        node = raw
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    cfg = load_config(raw)
    sampler = PromptSampler([Example([1], "nq", "a", 0)], batch_size=1, shuffle=False, seed=0)
    return PPOTrainer(cfg, derive_sizes(cfg), None, None, sampler, None, None, 1, "cpu")


@pytest.mark.parametrize("keys, separate", [
    ({}, False),                                                               # one on-policy optimizer step
    ({"actor_rollout_ref__actor__ppo_mini_batch_size": 4}, False),             # two: the update computes
                                                                               # the second one's itself
    ({"actor_rollout_ref__actor__ppo_epochs": 2}, True),
    ({"actor_rollout_ref__actor__old_log_probs": "recompute"}, True),
    ({"algorithm__use_kl_in_reward": True}, True),                              # the reward's KL reads them
])
def test_the_separate_pass_runs_only_where_the_update_cannot_give_the_old_log_probs(keys, separate):
    assert _trainer(**keys).old_from_update is not separate


@pytest.mark.parametrize("balance", [True, False])
def test_the_step_is_reordered_for_even_work_across_workers(balance):
    from types import SimpleNamespace
    from verl.batch import pack_trajectories
    trainer = _trainer(trainer__balance_batch=balance)
    trainer.policy = SimpleNamespace(workers=[object(), object()])
    lengths = [40, 38, 41, 39, 3, 2, 4, 3]   # the first prompt's samples long, the second's short
    batch = pack_trajectories([[1]] * 8, [[7] * n for n in lengths], [[1] * n for n in lengths], [0] * 4 + [1] * 4, 0)
    batch.info = {"stats": list(range(8))}
    out, metrics = trainer.balance(batch)
    halves = [sum(lengths[i] + 1 for i in out.info["stats"][h * 4:(h + 1) * 4]) for h in (0, 1)]
    if balance:
        assert max(halves) / (sum(halves) / 2) < 1.05 and sorted(out.info["stats"]) == list(range(8))
    else:
        assert out.info["stats"] == list(range(8))
    assert metrics["balance/max_over_mean_tokens"] == pytest.approx(max(halves) / (sum(halves) / 2))


def test_a_response_begun_in_the_prompt_is_scored_whole():
    """Data with a response prefix ("<think>" in the prompt): the reward reads prefix + what the
    model wrote, so a response that closes the prefix's block is in the valid format."""
    import torch

    from search_r1.rewards import check_format
    from verl.batch import RolloutBatch
    written = [" It is in Peru. </think>\n<answer> Lima </answer>", " Peru. </think>\n<answer> Cusco </answer>"]

    def batch():
        return RolloutBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                            torch.ones(2, 1), torch.ones(2, 1), 2, torch.zeros(2, dtype=torch.long),
                            info={"response_text": list(written)})

    gold = {"target": ["Lima"]}
    begun = PPOTrainer.with_targets(batch(), [Example([1], "nq", gold, 0, None, "<think>")], n=2)
    assert begun.info["response_text"] == ["<think>" + t for t in written]
    assert all(check_format(t).valid for t in begun.info["response_text"])
    plain = PPOTrainer.with_targets(batch(), [Example([1], "nq", gold, 0)], n=2)
    assert plain.info["response_text"] == written and not check_format(written[0]).valid
    trainer = _trainer()
    scores = [trainer.reward_fn("nq", t, gold, format_score=0.2).score for t in begun.info["response_text"]]
    assert scores == [1.0, 0.2]   # right and valid; wrong but valid


def test_worker_metrics_are_averaged_but_peak_memory_is_the_fullest_workers():
    from verl.trainer.metrics import merge_worker_metrics
    merged = merge_worker_metrics([{"pg_loss": 1.0, "memory/update_peak_reserved_gib": 60.0},
                                    {"pg_loss": 3.0, "memory/update_peak_reserved_gib": 70.0}], prefix="x/")
    assert merged == {"x/pg_loss": 2.0, "x/memory/update_peak_reserved_gib": 70.0}


class _Stop(Exception):
    pass


@pytest.mark.parametrize("calculate", [False, True])
def test_a_training_rollout_asks_for_the_engines_log_probs_only_with_calculate_log_probs(calculate):
    """rollout.calculate_log_probs: the engine's log-probs come back with the batch, for the
    actor's truncated importance weights; without it the agent loop is not asked for them."""
    trainer = _trainer(actor_rollout_ref__rollout__calculate_log_probs=calculate)
    seen = {}

    def rollout(examples, n, greedy, logprobs=False):
        seen.update(greedy=greedy, logprobs=logprobs)
        raise _Stop  # the rest of the step needs workers

    trainer.rollout = rollout
    with pytest.raises(_Stop):
        trainer.train_step([])
    assert seen == {"greedy": False, "logprobs": calculate}

