"""trainer.health: the collapse signs read from a step's metrics, and the trainer's response to them
(warn, stop, roll back to a checkpoint saved while healthy with a lower learning rate).

The signs are unit-tested on metric dicts; the responses run the trainer's real loop (`fit`) and
real checkpoints of a tiny linear model, with scripted step metrics in place of a rollout."""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl.checkpoint.store import complete_steps, load_checkpoint, save_checkpoint
from verl.config.load import load_config
from verl.config.schema import ConfigError, HealthConfig, TrainerConfig
from verl.trainer.health import NO_ACTION, HealthWatch, Unhealthy
from verl.trainer.ppo_trainer import PPOTrainer
from verl.utils.dataset import Example, PromptSampler
from verl.workers.update import build_lr_scheduler


def _watch(**keys) -> HealthWatch:
    return HealthWatch(HealthConfig(**keys))


def _steps(watch: HealthWatch, rows: list[dict]) -> list[list[str]]:
    return [watch.check(step, row) for step, row in enumerate(rows, start=1)]


# ---------------------------------------------------------------- the signs

def test_an_entropy_spike_over_the_recent_median_is_a_sign():
    signs = _steps(_watch(entropy_spike=3.0), [{"entropy": e} for e in (1.0, 1.2, 0.9, 2.9, 4.0)])
    assert signs[:4] == [[], [], [], []]    # 2.9 is below 3 × the median 1.0
    assert len(signs[4]) == 1 and "entropy 4 is above 3× its median" in signs[4][0]


def test_an_entropy_collapse_below_the_recent_median_is_a_sign():
    # as measured on a GPU at 100× the learning rate: 0.64 before the first update, 0.10 after it
    signs = _steps(_watch(entropy_spike=3.0), [{"entropy": e} for e in (0.64, 0.66, 0.6, 0.3, 0.1)])
    assert signs[:4] == [[], [], [], []]
    assert "entropy 0.1 is below 1/3 of its median 0.62" in signs[4][0]


def test_no_spike_is_judged_before_three_steps_of_history():
    assert _steps(_watch(entropy_spike=3.0), [{"entropy": e} for e in (0.1, 5.0, 9.0)]) == [[], [], []]


def test_validation_drop_from_the_best_is_a_sign_and_names_the_best_step():
    watch = _watch(val_drop=0.2)
    signs = _steps(watch, [{"val/reward/em": 0.5}, {}, {"val/reward/em": 0.7}, {"val/reward/em": 0.55},
                           {"val/reward/em": 0.45}])
    assert signs[:4] == [[], [], [], []]
    assert "validation EM 0.450 is more than 0.2 below its best 0.700 (step 3" in signs[4][0]
    assert watch.best_val_step == 3


def test_a_rise_of_trajectories_without_an_action_is_a_sign():
    signs = _steps(_watch(no_action_rise=0.5), [{NO_ACTION: s} for s in (0.9, 0.3, 0.2, 0.6, 0.8)])
    assert signs[:4] == [[], [], [], []]
    assert "80% of the trajectories took no action (agent/no_action), up from 20%" in signs[4][0]
    # one healthy step is baseline enough: the GPU run at 100× the learning rate went 1% → 100% in one step
    assert _steps(_watch(no_action_rise=0.5), [{NO_ACTION: 0.006}, {NO_ACTION: 1.0}])[1]


def test_kl_above_its_limit_and_non_finite_losses_are_signs():
    watch = _watch(max_kl=0.5)
    assert watch.check(1, {"kl_loss": 0.4}) == []
    assert "KL to the reference 0.7" in watch.check(2, {"kl_loss": 0.7})[0]
    assert watch.check(3, {"pg_loss": float("nan")}) == ["pg_loss=nan is not finite"]



@pytest.mark.parametrize("metric", ["entropy", "kl/reward_kl", "val/reward/em", NO_ACTION])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_watched_metric_is_a_sign_and_never_enters_the_history(metric, value):
    """A nan compares false with every threshold: it passed unflagged and, for the entropy, became
    part of the median later steps were judged by."""
    watch = _watch(max_kl=0.5)
    healthy = {"entropy": 1.0, "kl/reward_kl": 0.1, "val/reward/em": 0.5, NO_ACTION: 0.1}
    assert _steps(watch, [healthy] * 3) == [[]] * 3
    assert watch.check(4, healthy | {metric: value}) == [f"{metric}={value} is not finite"]
    assert list(watch.entropy) == [1.0] * 3 and list(watch.no_action) == [0.1] * 3 and watch.best_val == 0.5
    unwatched = _watch(entropy_spike=None, val_drop=None, no_action_rise=None)   # a broken metric is a sign anyway
    assert unwatched.check(1, {metric: value}) == [f"{metric}={value} is not finite"] and not unwatched.entropy

def test_unset_keys_watch_nothing():
    watch = _watch(entropy_spike=None, val_drop=None, no_action_rise=None)
    rows = [{"entropy": 1.0, "val/reward/em": 0.9, NO_ACTION: 0.0}] * 3 + [{"entropy": 99.0, "val/reward/em": 0.0,
                                                                           NO_ACTION: 1.0}]
    assert _steps(watch, rows) == [[]] * 4


def test_the_rollback_target_is_the_newest_healthy_checkpoint_kept():
    watch = _watch()
    for step, healthy in ((2, True), (4, True), (6, False)):
        watch.saved(step, healthy)
    assert watch.rollback_target([4, 6], ["entropy …"]) == 4
    assert watch.rollback_target([6], ["entropy …"]) is None
    watch.best_val_step = 2   # a validation drop goes back to a checkpoint from before the best, if kept
    assert watch.rollback_target([2, 4, 6], ["validation EM 0.1 …"]) == 2
    assert watch.rollback_target([4, 6], ["validation EM 0.1 …"]) == 4
    watch.rolled_back(2)   # checkpoints saved after the target belong to the abandoned path
    assert watch.rollbacks == 1 and watch.rollback_target([2, 4, 6], ["entropy …"]) == 2


def test_the_watch_state_round_trips():
    watch = _watch()
    _steps(watch, [{"entropy": 1.0, "val/reward/em": 0.4}, {"entropy": 1.1}])
    watch.saved(2, True)
    watch.rollbacks = 1
    again = _watch()
    again.restore(watch.state())
    assert again.state() == watch.state()


# ---------------------------------------------------------------- keys

def _cfg(**health):
    return load_config({"data": {"train_files": "x"}, "actor_rollout_ref": {"model": {"path": "m"}},
                        "trainer": {"save_freq": 5, "health": health}})


def test_health_keys_are_checked_at_load():
    assert _cfg(action="rollback").trainer.health.action == "rollback"
    with pytest.raises(ConfigError, match="use warn, stop or rollback"):
        _cfg(action="retry")
    with pytest.raises(ConfigError, match="lr_factor=1.5 must lie in"):
        _cfg(lr_factor=1.5)
    with pytest.raises(ConfigError, match="set trainer.save_freq > 0"):
        load_config({"data": {"train_files": "x"}, "actor_rollout_ref": {"model": {"path": "m"}},
                     "trainer": {"health": {"action": "rollback"}}})



@pytest.mark.parametrize("key, value, meaning", [
    ("entropy_spike", 0.5, "> 1 (a multiple of the median entropy)"),
    ("entropy_spike", 1.0, "> 1"), ("entropy_spike", 0.0, "> 1"), ("entropy_spike", -1.0, "> 1"),
    ("max_kl", -1.0, "> 0 (the largest KL"), ("max_kl", 0.0, "> 0"),
    ("val_drop", -0.1, "in (0, 1) (a drop of validation EM"), ("val_drop", 1.0, "in (0, 1)"),
    ("no_action_rise", -0.1, "in (0, 1) (a rise of the share"), ("no_action_rise", 0.0, "in (0, 1)"),
    ("no_action_rise", 1.5, "in (0, 1)"),
    ("entropy_spike", float("nan"), "> 1"), ("max_kl", float("nan"), "> 0"), ("val_drop", float("nan"), "in (0, 1)"),
    ("no_action_rise", float("nan"), "in (0, 1)"), ("entropy_spike", float("inf"), "> 1"), ("max_kl", float("inf"), "> 0"),
])
def test_health_thresholds_that_would_fire_every_step_or_never_are_refused_at_load(key, value, meaning):
    """entropy_spike=0.5 or max_kl=-1 flagged every healthy step (max_kl=-1: three rollbacks, then a
    stop); nan compared false and so switched a check off unseen. null is the way to switch one off."""
    with pytest.raises(ConfigError) as e:
        _cfg(**{key: value})
    assert f"trainer.health.{key} must be {meaning}" in str(e.value)
    assert f"or null to switch the check off; got {value}" in str(e.value)


def test_meaningful_health_thresholds_and_null_load():
    health = _cfg(entropy_spike=1.5, max_kl=0.01, val_drop=0.05, no_action_rise=0.9).trainer.health
    assert (health.entropy_spike, health.max_kl, health.val_drop, health.no_action_rise) == (1.5, 0.01, 0.05, 0.9)
    health = _cfg(entropy_spike=None, max_kl=None, val_drop=None, no_action_rise=None).trainer.health
    assert health.entropy_spike is health.max_kl is health.val_drop is health.no_action_rise is None

# ---------------------------------------------------------------- the learning rate after a rollback

def test_set_lr_scale_scales_the_rate_at_every_point_of_the_schedule():
    from verl.workers.update import TrainedModel
    model = torch.nn.Linear(2, 2)
    trained = TrainedModel.__new__(TrainedModel)   # only the optimizer and its schedule are exercised
    trained.base_lr = 1e-3
    trained.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trained.scheduler = build_lr_scheduler(trained.optimizer, warmup_steps=4, total_steps=10, schedule="constant",
                                           min_lr_ratio=0.0)
    trained.optimizer.step()
    trained.scheduler.step()                        # inside the warm-up: a part of 1e-3
    before = trained.optimizer.param_groups[0]["lr"]
    trained.set_lr_scale(0.1)
    assert trained.optimizer.param_groups[0]["lr"] == pytest.approx(before * 0.1)
    for _ in range(5):                               # past the warm-up the rate stays scaled
        trained.scheduler.step()
    assert trained.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    trained.set_lr_scale(0.1)                        # the scale is absolute: setting it twice is once
    assert trained.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


# ---------------------------------------------------------------- the trainer's response

class _Policy:
    """One worker with WorkerGroup's calling convention, saving and loading a real checkpoint of a
    linear model; it records the learning-rate scales it is given."""

    def __init__(self):
        self.model = torch.nn.Linear(4, 2)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.scales, self.loaded = [], []
        remote = lambda fn: SimpleNamespace(remote=fn)  # noqa: E731
        self.workers = [SimpleNamespace(save=remote(self._save), load=remote(self._load),
                                        set_lr_scale=remote(self.scales.append))]

    def get(self, results, what: str, step: int | None = None):
        return list(results)

    def _save(self, root, step, trainer_state, keep_last):
        with torch.no_grad():
            self.model.weight.fill_(step)   # the weights say which step they are from
        save_checkpoint(root, step, {"actor": (self.model, self.optimizer, self.scheduler)}, trainer_state, keep_last)

    def _load(self, root, step):
        self.loaded.append(step)
        return load_checkpoint(root, step, {"actor": (self.model, self.optimizer, self.scheduler)})


class _Tracker:
    def __init__(self):
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def rewind(self, step):  # Tracker.rewind, on a resume
        self.logged = [(s, m) for s, m in self.logged if s <= step]

    def finish(self):
        pass


def _trainer(out_dir: Path, steps: list[dict], **health) -> PPOTrainer:
    cfg = TrainerConfig()
    cfg.reward.function = "rewards_for_tests:early_letter_reward"
    run = cfg.trainer
    run.default_local_dir, run.save_freq, run.test_freq, run.val_before_train = str(out_dir), 2, -1, False
    run.export_hf_on_save, run.keep_last_checkpoints = False, 3
    run.health = HealthConfig(**({"val_drop": None, "no_action_rise": None} | health))
    sampler = PromptSampler([Example([1, 2], "demo", "a", i) for i in range(8)], batch_size=2, shuffle=False, seed=0)
    trainer = PPOTrainer(cfg, None, _Policy(), None, sampler, None, _Tracker(), len(steps), "cpu")
    rows = iter(steps)
    trainer.train_step = lambda examples: {"reward/mean": 0.5, "pg_loss": 0.1, "grad_norm": 1.0} | next(rows)
    return trainer


CALM, SPIKE = {"entropy": 1.0}, {"entropy": 50.0}


def test_rollback_goes_to_the_last_healthy_checkpoint_with_a_lower_rate(tmp_path, caplog):
    trainer = _trainer(tmp_path, [CALM] * 4 + [SPIKE] + [CALM] * 3, action="rollback", lr_factor=0.1)
    with caplog.at_level(logging.WARNING, logger="verl.trainer.ppo_trainer"):
        trainer.fit()
    assert trainer.policy.loaded == [4] and trainer.policy.scales == [pytest.approx(0.1)]
    assert trainer.health.rollbacks == 1 and trainer.step == 8
    # step 5's state was discarded: not saved; the steps after it train on from step 4's weights
    assert complete_steps(tmp_path / "checkpoints") == [4, 6, 8]   # 3 kept, none of step 5
    steps = [step for step, _ in trainer.tracker.logged]
    assert steps == sorted(set(steps))   # each step logged once, in order
    logged = dict(trainer.tracker.logged)
    assert logged[5]["health/alarms"] == 1 and logged[5]["health/rollbacks"] == 1
    assert "Rolled back to the checkpoint of step 4" in caplog.text and "0.1× the configured" in caplog.text
    fresh = _Policy()   # a resumed run reads the rollback count and the learning-rate scale back
    state = load_checkpoint(tmp_path / "checkpoints", 8, {"actor": (fresh.model, fresh.optimizer, fresh.scheduler)})
    assert state["lr_scale"] == pytest.approx(0.1) and state["health"]["rollbacks"] == 1


def test_a_rollback_also_takes_non_finite_steps(tmp_path):
    trainer = _trainer(tmp_path, [CALM] * 2 + [{"pg_loss": float("nan")}] + [CALM] * 2, action="rollback")
    trainer.fit()
    assert trainer.policy.loaded == [2] and trainer.health.rollbacks == 1


def test_a_rollback_skips_a_checkpoint_that_fails_verification(tmp_path, caplog):
    trainer = _trainer(tmp_path, [CALM] * 5 + [SPIKE] + [CALM] * 2, action="rollback", lr_factor=0.1)
    trainer.cfg.trainer.save_freq = 1
    rows = iter([CALM] * 5 + [SPIKE] + [CALM] * 2)

    def step(examples):
        if trainer.step + 1 == 6:  # the newest healthy checkpoint lost its manifest (a partial copy)
            (tmp_path / "checkpoints" / "global_step_5" / "manifest.json").unlink()
        return {"reward/mean": 0.5, "pg_loss": 0.1, "grad_norm": 1.0} | next(rows)

    trainer.train_step = step
    with caplog.at_level(logging.WARNING, logger="verl.trainer"):
        trainer.fit()
    assert trainer.policy.loaded == [5, 4] and trainer.health.rollbacks == 1
    assert "global_step_5/manifest.json is missing" in caplog.text
    assert "Rolled back to the checkpoint of step 4" in caplog.text


def test_rollbacks_run_out(tmp_path):
    trainer = _trainer(tmp_path, [CALM] * 4 + [SPIKE] * 4, action="rollback", max_rollbacks=1)
    with pytest.raises(Unhealthy, match="rolled back 1 times already"):
        trainer.fit()


def test_stop_ends_the_run_at_the_sign_without_saving_it(tmp_path):
    trainer = _trainer(tmp_path, [CALM] * 4 + [SPIKE] + [CALM], action="stop")
    with pytest.raises(Unhealthy, match=r"step 5: entropy 50 is above 3× its median"):
        trainer.fit()
    assert complete_steps(tmp_path / "checkpoints") == [2, 4]
    assert trainer.tracker.logged[-1][0] == 5


def test_warn_trains_on_and_counts_the_sign(tmp_path, caplog):
    trainer = _trainer(tmp_path, [CALM] * 4 + [SPIKE] + [CALM], action="warn")
    with caplog.at_level(logging.WARNING, logger="verl.trainer.ppo_trainer"):
        trainer.fit()
    assert trainer.step == 6 and trainer.policy.loaded == []
    assert dict(trainer.tracker.logged)[5]["health/alarms"] == 1
    assert "step 5: entropy 50" in caplog.text


def test_rollback_saves_the_starting_state_so_the_first_steps_can_go_back(tmp_path):
    # at 100× the learning rate a GPU run collapsed at its second step, before any save
    trainer = _trainer(tmp_path, [{"pg_loss": float("nan")}, CALM, CALM], action="rollback")
    trainer.fit()
    assert trainer.policy.loaded == [0] and trainer.health.rollbacks == 1
    assert 0 in complete_steps(tmp_path / "checkpoints")


# ---------------------------------------------------------------- the metrics the signs read

def test_scoring_reports_flat_groups_and_trajectories_without_an_action():
    from verl.batch import pack_trajectories
    from verl.workers.rollout.agent_loop import TrajectoryStats
    cfg = TrainerConfig()
    cfg.reward.function = "search_r1.rewards:score_for"
    cfg.reward.reward_kwargs = {"search_cost": 0.1}   # reaches the reward function as a keyword argument
    sampler = PromptSampler([Example([1], "nq", "a", 0)], batch_size=1, shuffle=False, seed=0)
    trainer = PPOTrainer(cfg, None, None, None, sampler, None, _Tracker(), 1, "cpu")
    right = "<think>x</think><search>q</search><information>Paris</information><think>y</think><answer>Paris</answer>"
    texts = [right, "<answer>Lyon</answer>", "no tags at all", "no tags either"]
    batch = pack_trajectories([[1]] * 4, [[ord(c) for c in t] for t in texts], [[1] * len(t) for t in texts],
                              [0, 0, 1, 1], 0)
    batch.info = {"response_text": texts, "data_source": ["nq"] * 4,
                  "ground_truth": [{"target": ["Paris"]}] * 4,
                  "extra_info": [{"hops": 2}, {"hops": 2}, {"hops": 1}, None],
                  # the agent loop says which trajectories took no action (the second answered)
                  "stats": [TrajectoryStats("answer", 9, 9, tool_calls=1, metrics={"no_action": 0.0}),
                            TrajectoryStats("eos", 3, 3, metrics={"no_action": 0.0}),
                            TrajectoryStats("eos", 3, 3, metrics={"no_action": 1.0}),
                            TrajectoryStats("length", 3, 3, metrics={"no_action": 1.0})]}
    rewards, metrics = trainer.score(batch)
    assert rewards.tolist() == pytest.approx([0.9, 0.0, 0.0, 0.0])   # EM 1 less one search at 0.1
    assert metrics["reward/flat_groups"] == 0.5          # group 1's rewards are all 0
    assert metrics[NO_ACTION] == 0.5                      # two neither searched nor answered
    # by hop count, over the rows that have one (the search reward's metrics, logged by name): the
    # two-hop pair searched once in two, got one right
    assert (metrics["em_by_hops/2"], metrics["searches_by_hops/2"]) == (0.5, 0.5)
    assert (metrics["em_by_hops/1"], metrics["searches_by_hops/1"]) == (0.0, 0.0)
    assert not any(k.endswith("/None") for k in metrics)
