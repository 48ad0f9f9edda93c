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
    begun = PPOTrainer.with_reward_inputs(batch(), [Example([1], "nq", gold, 0, None, "<think>")], n=2)
    assert begun.info["response_text"] == ["<think>" + t for t in written]
    assert all(check_format(t).valid for t in begun.info["response_text"])
    plain = PPOTrainer.with_reward_inputs(batch(), [Example([1], "nq", gold, 0)], n=2)
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



# -- DAPO's dynamic sampling (algorithm.filter_groups): the loop, with generation replaced -------

def _filtering_trainer(tmp_path, rewards, prompts=12, metric="seq_reward", **keys):
    """A trainer whose rollout gives prompt i's two samples the texts rewards[i], scored as
    "score" or "score,em"; 4 prompts a step. Generation is replaced: the loop is under test."""
    from types import SimpleNamespace

    from verl.batch import pack_trajectories
    from verl.workers.rollout.agent_loop import TrajectoryStats
    trainer = _trainer(algorithm__filter_groups__enable=True, algorithm__filter_groups__metric=metric, **keys)
    trainer.out_dir = str(tmp_path)
    trainer.sampler = PromptSampler([Example([1, 2], "nq", "a", i) for i in range(prompts)], batch_size=4,
                                    shuffle=False, seed=0)
    trainer.gen_batches_seen = []

    def rollout(examples, n, greedy, logprobs=False, gen_batch=0):
        trainer.gen_batches_seen.append((gen_batch, [e.index for e in examples]))
        texts = [t for e in examples for t in rewards[e.index]]
        batch = pack_trajectories([e.prompt_ids for e in examples for _ in range(n)], [[5, 6, 7]] * len(texts),
                                  [[1, 1, 1]] * len(texts), [e.index for e in examples for _ in range(n)], 0)
        batch.info = {"response_text": texts, "stats": [TrajectoryStats("eos", 3, 3) for _ in texts]}
        return PPOTrainer.with_reward_inputs(batch, examples, n)

    def reward(source, text, gt):
        score, _, em = text.partition(",")
        return SimpleNamespace(score=float(score), em=float(em or score))

    trainer.rollout, trainer.reward_fn, trainer.reward_takes_extra_info = rollout, reward, False
    trainer.reward_kwargs = {}   # this reward declares no options
    return trainer


FLAT, VARIED = ["0", "0"], ["1", "0"]


def test_flat_groups_are_dropped_and_more_prompts_drawn_until_a_full_batch_of_the_first_kept_groups(tmp_path):
    import json

    from verl.trainer.ppo_trainer import Timer
    rewards = {i: FLAT if i in (0, 2, 3) else VARIED for i in range(12)}
    trainer = _filtering_trainer(tmp_path, rewards)
    t = Timer()
    batch, metrics, generated = trainer.rollout_varied_groups(trainer.sampler.next_batch(), 2, t)
    assert [e for e, _ in trainer.gen_batches_seen] == [0, 1]            # each with seeds of its own
    assert len(batch) == 8 and len(set(batch.group_ids_B.tolist())) == 4   # data.train_batch_size groups
    # prompt 1 of the first batch, then 4, 5, 6 of the second (7 is left out: the batch is full)
    assert batch.rewards_B.tolist() == [1.0, 0.0] * 4
    assert [trainer.gen_batches_seen[g][1] for g in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert metrics["filter_groups/dropped_groups"] == 3 and metrics["filter_groups/gen_batches"] == 2
    assert metrics["reward/flat_groups"] == pytest.approx((3 / 4 + 0) / 2)   # over what was generated
    assert generated == 16 * 3                                           # both batches' tokens
    assert set(t.seconds) == {"rollout", "reward"}
    # the second draw is listed under the same step; the sampler has consumed both batches
    rows = [json.loads(line) for line in (tmp_path / "data_order.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "indices": [4, 5, 6, 7], "gen_batch": 2}]
    assert trainer.sampler.state() == {"epoch": 0, "position": 2}


def test_a_resumed_run_draws_after_the_last_batch_a_filtered_step_drew(tmp_path):
    import json

    from verl.trainer.ppo_trainer import Timer
    rewards = {i: FLAT if i < 4 else VARIED for i in range(12)}
    trainer = _filtering_trainer(tmp_path, rewards)
    trainer.rollout_varied_groups(trainer.draw_prompts(), 2, Timer())   # the step's first draw, as fit's
    saved = trainer.sampler.state()                                      # what save() stores
    resumed = PromptSampler(trainer.sampler.examples, batch_size=4, shuffle=False, seed=0)
    resumed.restore(saved)
    assert [e.index for e in resumed.next_batch()] == [8, 9, 10, 11]
    rows = (tmp_path / "data_order.jsonl").read_text().splitlines()
    assert [json.loads(r)["gen_batch"] for r in rows] == [1, 2]


def test_past_max_num_gen_batches_the_run_stops_naming_the_key(tmp_path):
    from verl.trainer.ppo_trainer import FilterGroupsExhausted, Timer
    rewards = {i: FLAT if i < 8 else VARIED for i in range(12)}
    trainer = _filtering_trainer(tmp_path, rewards, algorithm__filter_groups__max_num_gen_batches=2)
    with pytest.raises(FilterGroupsExhausted, match="algorithm.filter_groups.max_num_gen_batches=2"):
        trainer.rollout_varied_groups(trainer.sampler.next_batch(), 2, Timer())
    trainer = _filtering_trainer(tmp_path, rewards, algorithm__filter_groups__max_num_gen_batches=3)
    _, metrics, _ = trainer.rollout_varied_groups(trainer.sampler.next_batch(), 2, Timer())
    assert metrics["filter_groups/gen_batches"] == 3 and metrics["filter_groups/dropped_groups"] == 8


@pytest.mark.parametrize("metric, kept_first", [("acc", 4), ("score", 0)])
def test_the_filter_metric_picks_the_value_that_must_vary(tmp_path, metric, kept_first):
    """Prompt 0's samples differ in score (a format term) but not in exact match."""
    from verl.trainer.ppo_trainer import Timer
    rewards = {i: ["0.2,0", "0,0"] if i == 0 else VARIED for i in range(12)}
    trainer = _filtering_trainer(tmp_path, rewards, metric=metric)
    batch, metrics, _ = trainer.rollout_varied_groups(trainer.sampler.next_batch(), 2, Timer())
    assert trainer.gen_batches_seen[-1][1][0] == kept_first              # the first prompt of the last batch
    assert metrics["filter_groups/dropped_groups"] == (metric == "acc")


def test_a_prompt_drawn_twice_in_a_step_makes_two_groups(tmp_path):
    """Past an epoch's end the sampler gives the same prompts again: their groups stay apart."""
    from verl import core_algos
    from verl.trainer.ppo_trainer import Timer
    rewards = {0: VARIED, 1: FLAT, 2: FLAT, 3: FLAT}
    trainer = _filtering_trainer(tmp_path, rewards, prompts=4)
    batch, metrics, _ = trainer.rollout_varied_groups(trainer.sampler.next_batch(), 2, Timer())
    assert metrics["filter_groups/gen_batches"] == 4 and len(set(batch.group_ids_B.tolist())) == 4
    adv_BR = core_algos.grpo_advantages(batch.rewards_B, batch.group_ids_B, batch.loss_mask_BR)
    assert adv_BR[:, 0].tolist() == pytest.approx([0.7071, -0.7071] * 4, abs=1e-3)


def test_the_step_filters_groups_only_with_filter_groups_enabled(tmp_path):
    trainer = _filtering_trainer(tmp_path, {})

    def filtered(examples, n, t):
        raise _Stop

    trainer.rollout_varied_groups = filtered
    with pytest.raises(_Stop):
        trainer.train_step([])
    trainer.cfg.algorithm.filter_groups.enable = False
    trainer.rollout = lambda *a, **k: (_ for _ in ()).throw(_Stop())   # the plain rollout
    with pytest.raises(_Stop):
        trainer.train_step([])


def test_the_overlong_buffer_penalises_responses_near_the_limit_and_leaves_the_score_for_the_filter(tmp_path):
    from verl.batch import pack_trajectories
    from verl.workers.rollout.agent_loop import TrajectoryStats
    trainer = _trainer(data__max_response_length=100, reward__overlong_buffer__enable=True,
                       reward__overlong_buffer__len=20, reward__overlong_buffer__penalty_factor=1.0)
    trainer.reward_fn, trainer.reward_takes_extra_info = (lambda source, text, gt: 1.0), False
    trainer.reward_kwargs = {}   # this reward declares no options
    batch = pack_trajectories([[1]] * 3, [[5]] * 3, [[1]] * 3, [0, 0, 0], 0)
    batch.info = {"response_text": ["x"] * 3, "data_source": ["nq"] * 3, "ground_truth": ["a"] * 3,
                  "stats": [TrajectoryStats("eos", n, n) for n in (50, 90, 100)]}
    rewards_B, metrics = trainer.score(batch)
    assert rewards_B.tolist() == pytest.approx([1.0, 0.5, 0.0])
    assert batch.info["score"] == [1.0, 1.0, 1.0] and batch.info["reward"] == pytest.approx([1.0, 0.5, 0.0])
    assert metrics["reward/overlong_share"] == pytest.approx(2 / 3)
    assert metrics["reward/overlong_penalty"] == pytest.approx(-0.5)
    assert metrics["reward/mean"] == pytest.approx(0.5)
    off = _trainer(data__max_response_length=100)
    off.reward_fn, off.reward_takes_extra_info, off.reward_kwargs = trainer.reward_fn, False, {}
    assert off.score(batch)[0].tolist() == [1.0, 1.0, 1.0]


# -- trainer.rollout_ahead_steps: the rollouts asked for ahead, with a real rollout worker in this process --

class _InProcess:
    """A group of one worker in this process, called as Ray calls actors (LocalWorkerGroup's way)."""

    def __init__(self, worker):
        from verl.single_controller.ray_group import _LocalHandle
        self.workers = [_LocalHandle(worker)]

    def get(self, refs, what, step=None):
        return list(refs)


def test_running_two_steps_ahead_asks_for_the_next_two_rollouts_and_a_checkpoint_keeps_the_sampler_before_them(
        tmp_path, tiny_model_dir):
    import json

    from verl.workers.rollout_worker import RolloutWorker
    cfg = load_config({"data": {"train_files": "x", "train_batch_size": 2, "max_response_length": 4},
                       "reward": {"function": "search_r1.rewards:score_for"},
                       "actor_rollout_ref": {"model": {"path": tiny_model_dir}, "rollout": {"n_agent": 2, "name": "hf"},
                                             "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size": 2}},
                       "algorithm": {"adv_estimator": "grpo"},
                       "trainer": {"rollout_ahead_steps": 2, "device": "cpu"}})
    worker = RolloutWorker(0, cfg, "cpu")
    worker.setup()
    sampler = PromptSampler([Example([1, 2, 3 + i], "nq", "a", i) for i in range(12)], batch_size=2, shuffle=False,
                            seed=0)
    trainer = PPOTrainer(cfg, derive_sizes(cfg), None, None, sampler, None, None, 4, "cpu", rollout=_InProcess(worker))
    trainer.out_dir = str(tmp_path)
    first = trainer.next_examples()                      # nothing ahead yet: drawn now
    batch = trainer.rollout(first, 2, greedy=False, logprobs=True)
    assert len(batch) == 4 and batch.rollout_logprobs_BR is not None
    assert trainer.roll_ahead() == {"rollout/staleness": 0.0, "rollout/generate_s": trainer.ahead.generate_s}
    assert sorted(trainer.ahead.pending) == [2, 3]
    assert [e.index for e in trainer.ahead.pending[3].examples] == [4, 5]
    # a checkpoint of step 1 keeps the sampler as it was before the prompts of steps 2 and 3 were drawn
    assert trainer.ahead.sampler_state(trainer.sampler.state()) == {"epoch": 0, "position": 1}
    trainer.step = 1
    assert trainer.next_examples() is trainer.ahead.pending[2].examples   # the prompts drawn ahead
    trainer.rollout(trainer.next_examples(), 2, greedy=False, logprobs=True)
    trainer.roll_ahead()
    assert sorted(trainer.ahead.pending) == [3, 4]           # 4 is the run's last step: nothing past it
    trainer.step = 2
    trainer.rollout(trainer.next_examples(), 2, greedy=False, logprobs=True)
    trainer.roll_ahead()
    assert sorted(trainer.ahead.pending) == [4]
    rows = [json.loads(line) for line in (tmp_path / "data_order.jsonl").read_text().splitlines()]
    assert [(r["step"], r["indices"]) for r in rows] == [(1, [0, 1]), (2, [2, 3]), (3, [4, 5]), (4, [6, 7])]
