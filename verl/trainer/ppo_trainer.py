"""The training loop, run by the Ray driver (single controller).

One step, as data: prompts → rollout on every worker (agent loop + colocated engine) → rewards
(the responses as the workers decoded them, reward function named in the config) → old/ref
log-probs, values → advantages (pure functions in core_algos) → critic and actor updates → new
weights pushed into the engines. Validation, metrics and checkpoints around it, and an optional
wall-clock limit (`trainer.time_limit_minutes`) that makes the step running when it is spent the
last one.
"""
from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from verl import core_algos
from verl.batch import RolloutBatch, balanced_order
from verl.config.schema import TrainerConfig
from verl.config.sizes import Sizes
from verl.trainer.health import HealthWatch, Unhealthy, non_finite_metrics
from verl.utils.dataset import Example, PromptSampler

log = logging.getLogger(__name__)

# bf16 dense tensor-core peaks (data sheets), for the MFU estimate.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def load_reward_fn(spec: str | None):
    """'module:function' → callable(data_source, response_text, ground_truth[, extra_info=row's extra_info]),
    returning a float or an object with .score (optional: .em, and .metrics, a dict of floats logged
    by name as means over the trajectories that report them)."""
    if not spec:
        raise ValueError("reward.function is not set: give it as 'module:function', e.g. "
                         "search_r1.rewards:score_for")
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def takes_extra_info(fn) -> bool:
    """Whether the reward function takes the row's `extra_info` (verl's keyword), by name."""
    return "extra_info" in inspect.signature(fn).parameters


class ToolFailures(RuntimeError):
    """Too many of a step's tool calls (searches) failed to train on the step."""


class Timer:
    def __init__(self):
        self.seconds = {}

    @contextmanager
    def __call__(self, name):
        t = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t


class PPOTrainer:
    def __init__(self, cfg: TrainerConfig, sizes: Sizes, policy, critic, sampler: PromptSampler,
                 val_examples: list[Example] | None, tracker, total_steps: int, device_name: str,
                 n_params: int | None = None):
        """`n_params`: the policy's parameter count, for the MFU estimate (None: no estimate)."""
        self.cfg, self.sizes, self.policy, self.critic = cfg, sizes, policy, critic
        self.sampler, self.val_examples = sampler, val_examples
        self.tracker, self.total_steps = tracker, total_steps
        self.reward_fn = load_reward_fn(cfg.reward.function)
        self.reward_kwargs = cfg.reward.kwargs()
        self.reward_takes_extra_info = takes_extra_info(self.reward_fn)
        self.estimator = core_algos.AdvEstimator(cfg.algorithm.adv_estimator)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (core_algos.AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon)
                        if kl.type == "adaptive" else core_algos.FixedKLController(kl.kl_coef))
        self.use_reference = cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in device_name), None)
        self.n_params = n_params
        self.out_dir = cfg.trainer.default_local_dir
        self.step = 0
        self.health = HealthWatch(cfg.trainer.health)
        actor = cfg.actor_rollout_ref.actor
        # One epoch: the update finds the log-probs before it on its own (Actor.update), at less cost
        # than the separate pass; only the KL in the reward needs them before the update.
        self.old_from_update = (sizes is not None and actor.old_log_probs == "auto" and actor.ppo_epochs == 1
                                and not cfg.algorithm.use_kl_in_reward)
        self.lr_scale = 1.0   # trainer.health.lr_factor per rollback

    # -- the step ------------------------------------------------------------------------------

    def train_step(self, examples: list[Example]) -> dict:
        t = Timer()
        n = self.cfg.actor_rollout_ref.rollout.n_agent
        # trainer.critic_warmup: the critic learns alone until then (self.step counts finished steps)
        actor_learns = self.step + 1 >= self.cfg.trainer.critic_warmup
        with t("rollout"):
            batch = self.rollout(examples, n, greedy=False,
                                 logprobs=self.cfg.actor_rollout_ref.rollout.calculate_log_probs)
        batch, balance = self.balance(batch)
        with t("reward"):
            batch.rewards_B, metrics = self.score(batch)
            metrics |= self.drop_failed_tool_calls(batch)
        if not self.old_from_update:
            with t("old_log_probs"):
                batch.old_logprobs_BR = batch.cat_responses(self.on_parts(
                    self.policy, batch, lambda w, part: w.compute_log_probs.remote(part), "old log-probs"))
        if self.use_reference:
            with t("ref_log_probs"):
                batch.ref_logprobs_BR = batch.cat_responses(self.on_parts(
                    self.policy, batch, lambda w, part: w.compute_ref_log_probs.remote(part), "reference log-probs"))
        if self.critic is not None:
            with t("values"):
                batch.values_BR = batch.cat_responses(
                    self.on_parts(self.critic, batch, lambda w, part: w.compute_values.remote(part), "values"))
        with t("advantages"):
            metrics |= self.compute_advantages(batch)
        if self.critic is not None:
            with t("update_critic"):
                metrics |= _merge_worker_metrics(
                    self.on_parts(self.critic, batch, lambda w, part: w.update_critic.remote(part), "critic update"),
                    prefix="critic/")
        if actor_learns:
            with t("update_actor"):
                metrics |= _merge_worker_metrics(
                    self.on_parts(self.policy, batch, lambda w, part: w.update_actor.remote(part), "actor update"))
        if actor_learns:
            with t("weight_sync"):
                self.policy.get([w.sync_weights.remote() for w in self.policy.workers], "weight sync", self.step)
        return (metrics | balance | self.throughput(batch, t.seconds)
                | {f"timing_s/{k}": v for k, v in t.seconds.items()})

    def balance(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict]:
        """The step's trajectories reordered so that each worker's part holds nearly the same number of
        tokens (trainer.balance_batch); `balance/max_over_mean_tokens` says how even the parts are."""
        world = len(self.policy.workers)
        if world == 1 or len(batch) % world:
            return batch, {}
        tokens = batch.attention_mask_BT.sum(1).tolist()
        if self.cfg.trainer.balance_batch:
            order = balanced_order(tokens, world)
            batch, tokens = batch.select(order), [tokens[i] for i in order]
        size = len(tokens) // world
        totals = [sum(tokens[p * size:(p + 1) * size]) for p in range(world)]
        return batch, {"balance/max_over_mean_tokens": max(totals) / (sum(totals) / world)}

    # -- phases --------------------------------------------------------------------------------

    def rollout_calls(self, examples: list[Example], n: int, greedy: bool, step: int, logprobs: bool) -> list:
        """(worker, arguments of its `generate`) for the rollout of `step` (1-based): the rows, n per
        example, in equal contiguous parts."""
        rows = [e for e in examples for _ in range(n)]
        world = len(self.policy.workers)
        per = -(-len(rows) // world)
        r = self.cfg.actor_rollout_ref.rollout
        temperature, top_p = (0.0, 1.0) if greedy else (r.temperature, r.top_p)
        # One seed per step and worker, from trainer.seed: a resumed step samples what it would have.
        # A rollback gives the steps after it fresh seeds.
        seed = (self.cfg.trainer.seed * 1_000_003 + step * 10_007 + self.health.rollbacks * 7_919) % 2**31
        return [(w, ([e.prompt_ids for e in rows[i * per:(i + 1) * per]], [e.index for e in rows[i * per:(i + 1) * per]],
                     temperature, top_p, self.cfg.data.max_response_length, (seed + 100_003 * i) % 2**31, logprobs))
                for i, w in enumerate(self.policy.workers) if rows[i * per:(i + 1) * per]]

    def rollout(self, examples: list[Example], n: int, greedy: bool, logprobs: bool = False) -> RolloutBatch:
        calls = self.rollout_calls(examples, n, greedy, self.step + 1, logprobs)
        parts = self.policy.get([w.generate.remote(*args) for w, args in calls], "rollout", self.step)
        return self.with_targets(RolloutBatch.concat(parts), examples, n)

    @staticmethod
    def with_targets(batch: RolloutBatch, examples: list[Example], n: int) -> RolloutBatch:
        batch.info["data_source"] = [e.data_source for e in examples for _ in range(n)]
        batch.info["ground_truth"] = [e.ground_truth for e in examples for _ in range(n)]
        batch.info["extra_info"] = [e.extra_info for e in examples for _ in range(n)]
        # a response begun in the prompt (data with a response prefix) is scored and logged whole
        prefixes = [e.response_prefix for e in examples for _ in range(n)]
        if any(prefixes):
            batch.info["response_text"] = [p + t for p, t in zip(prefixes, batch.info["response_text"])]
        return batch

    def score(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict]:
        rewards, em, by_source, own = [], [], defaultdict(list), defaultdict(list)
        extra = batch.info.get("extra_info") or [None] * len(batch)
        for text, source, gt, info in zip(batch.info["response_text"], batch.info["data_source"],
                                          batch.info["ground_truth"], extra):
            kwargs = self.reward_kwargs | ({"extra_info": info} if self.reward_takes_extra_info else {})
            result = self.reward_fn(source, text, gt, **kwargs)
            score = float(getattr(result, "score", result))
            rewards.append(score)
            em.append(float(getattr(result, "em", score)))
            by_source[source].append(em[-1])
            for name, value in (getattr(result, "metrics", None) or {}).items():  # the reward's own, by name
                own[name].append(float(value))
        stats = batch.info["stats"]  # TrajectoryStats, one per trajectory
        metrics = {"reward/mean": float(np.mean(rewards)), "reward/em": float(np.mean(em)),
                   "response/length": float(np.mean([s.response_tokens for s in stats])),
                   "response/model_tokens": float(np.mean([s.model_tokens for s in stats])),
                   # tool outputs (retrieved passages) in the response
                   "response/observation_tokens": float(np.mean([s.response_tokens - s.model_tokens for s in stats]))}
        for name in {name for s in stats for name in s.metrics}:  # the agent loop's own
            metrics[f"agent/{name}"] = float(np.mean([s.metrics[name] for s in stats if name in s.metrics]))
        for reason in {s.finish for s in stats}:
            metrics[f"agent/finish_{reason}"] = float(np.mean([s.finish == reason for s in stats]))
        # When trajectories ended (each on its worker's clock): the step waits for the last one, so
        # max − p90 is what the slowest tenth costs the rollout.
        if done := [s.done_s for s in stats if s.done_s is not None]:
            for name, q in (("p50", 50), ("p90", 90), ("max", 100)):
                metrics[f"rollout/done_s_{name}"] = float(np.percentile(done, q))
        # Groups whose rewards are all equal give GRPO no signal (their advantages are 0).
        groups = defaultdict(set)
        for gid, r in zip(batch.group_ids_B.tolist(), rewards):
            groups[gid].add(r)
        metrics["reward/flat_groups"] = float(np.mean([len(v) == 1 for v in groups.values()]))
        for source, values in by_source.items():
            metrics[f"reward/em/{source}"] = float(np.mean(values))
        # Means over the trajectories whose reward reported them (e.g. the search reward's by hop count).
        metrics |= {name: float(np.mean(values)) for name, values in own.items()}
        batch.info["reward"] = rewards
        return torch.tensor(rewards, dtype=torch.float32), metrics

    def drop_failed_tool_calls(self, batch: RolloutBatch) -> dict:
        """Trajectories whose tool call failed saw an error text instead of the tool's output: they
        are masked out of the loss (their rewards still count in their group's baseline). Past
        actor_rollout_ref.rollout.max_tool_failure_rate of the tool-calling trajectories, the run
        stops here, before any update or checkpoint of this step."""
        stats = batch.info["stats"]
        failed = [s.tool_failed for s in stats]
        asked = sum(1 for s in stats if s.tool_failed or s.tool_calls > 0)
        rate = sum(failed) / asked if asked else 0.0
        limit = self.cfg.actor_rollout_ref.rollout.max_tool_failure_rate
        if failed and rate > limit:
            raise ToolFailures(f"step {self.step + 1}: {sum(failed)} of {asked} tool-calling trajectories got an "
                               f"error instead of the tool's output ({rate:.0%} > actor_rollout_ref.rollout."
                               f"max_tool_failure_rate={limit:g}); see the workers' log for the errors. Nothing of "
                               "this step was trained or saved: fix the tool (e.g. its server) and rerun to resume.")
        rows = torch.tensor(failed, dtype=torch.bool)
        if rows.any():
            batch.loss_mask_BR[rows] = 0
            batch.response_mask_BR[rows] = 0
        return {"agent/tool_failures": float(sum(failed)), "agent/tool_failure_rate": rate}

    def compute_advantages(self, batch: RolloutBatch) -> dict:
        a = self.cfg.algorithm
        mask_BR = batch.loss_mask_BR if self.cfg.actor_rollout_ref.actor.state_masking else batch.response_mask_BR
        metrics = {}
        if self.estimator in (core_algos.AdvEstimator.GAE, core_algos.AdvEstimator.REINFORCE_PP):
            token_rewards_BR = core_algos.token_level_rewards(batch.rewards_B, mask_BR)
            if a.use_kl_in_reward:
                kl_BR = core_algos.kl_penalty(batch.old_logprobs_BR, batch.ref_logprobs_BR, a.kl_penalty)
                token_rewards_BR, mean_kl = core_algos.apply_kl_penalty(token_rewards_BR, kl_BR, mask_BR,
                                                                        self.kl_ctrl.value)
                self.kl_ctrl.update(float(mean_kl), len(batch))
                metrics |= {"kl/reward_kl": float(mean_kl), "kl/coef": float(self.kl_ctrl.value)}
            if self.estimator == core_algos.AdvEstimator.GAE:
                adv_BR, ret_BR = core_algos.gae_advantages(token_rewards_BR, batch.values_BR, mask_BR, a.gamma, a.lam)
            else:
                adv_BR, ret_BR = core_algos.reinforce_pp_advantages(token_rewards_BR, mask_BR, a.gamma)
        else:
            adv_BR, ret_BR = core_algos.compute_advantages(
                self.estimator, rewards_B=batch.rewards_B, group_ids_B=batch.group_ids_B, mask_BR=mask_BR,
                gamma=a.gamma, lam=a.lam, normalize_std=a.norm_adv_by_std_in_grpo)
        batch.advantages_BR, batch.returns_BR = adv_BR, ret_BR
        return metrics | {"advantages/mean": float(core_algos.masked_mean(adv_BR, mask_BR))}

    def on_parts(self, group, batch: RolloutBatch, call, what: str) -> list:
        """Split the batch over the group's workers and run `call(worker, part)` on each (a remote
        call: `lambda w, part: w.compute_values.remote(part)`); the results, in worker order."""
        parts = batch.split(len(group.workers))
        return group.get([call(w, part) for w, part in zip(group.workers, parts)], what, self.step)

    def throughput(self, batch: RolloutBatch, seconds: dict) -> dict:
        tokens = int(batch.attention_mask_BT.sum())
        generated = sum(s.model_tokens for s in batch.info["stats"])
        out = {"throughput/generated_tokens_per_s": generated / max(seconds["rollout"], 1e-9)}
        if "update_actor" not in seconds:  # a critic warm-up step
            return out
        out["throughput/train_tokens_per_s"] = tokens / max(seconds["update_actor"], 1e-9)
        if self.peak_flops and self.n_params:
            # forward+backward ≈ 6 FLOPs per parameter per token (attention left out)
            out["throughput/mfu_actor_update"] = 6 * self.n_params * tokens * self.cfg.actor_rollout_ref.actor.ppo_epochs / (
                seconds["update_actor"] * self.peak_flops * self.sizes.world)
        return out

    # -- loop ----------------------------------------------------------------------------------

    def validate(self) -> dict:
        if not self.val_examples:
            return {}
        t = time.perf_counter()
        batch = self.rollout(self.val_examples, 1, greedy=True)
        _, metrics = self.score(batch)
        self.write_samples(batch, f"val_step_{self.step}")
        out = {f"val/{k}": v for k, v in metrics.items()}
        out["timing_s/validation"] = time.perf_counter() - t
        return out

    def write_samples(self, batch: RolloutBatch, name: str, limit: int = 64):
        """Trajectories with their token masks, for the report and for reading by eye."""
        path = os.path.join(self.out_dir, "samples", f"{name}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            for i in range(min(limit, len(batch))):
                f.write(json.dumps({"step": self.step, "data_source": batch.info["data_source"][i],
                                    "ground_truth": _jsonable(batch.info["ground_truth"][i]),
                                    "response": batch.info["response_text"][i],
                                    "response_ids": batch.info["response_ids"][i],
                                    "loss_mask": batch.info["loss_mask"][i],
                                    "reward": batch.info["reward"][i], **batch.info["stats"][i].as_row()}) + "\n")

    def save(self):
        from verl.checkpoint.export import export_hf
        root = os.path.join(self.out_dir, "checkpoints")
        state = {"step": self.step, "sampler": self.sampler.state(), "kl_coef": float(self.kl_ctrl.value),
                 "health": self.health.state(), "lr_scale": self.lr_scale}
        keep = self.cfg.trainer.keep_last_checkpoints
        if self.critic is not None:  # the critic first: the actor's `latest` marks a complete step
            self.critic.get([w.save.remote(root, self.step, state, keep) for w in self.critic.workers], "save",
                            self.step)
        self.policy.get([w.save.remote(root, self.step, state, keep) for w in self.policy.workers], "save", self.step)
        if self.cfg.trainer.export_hf_on_save:
            export_hf(os.path.join(root, f"global_step_{self.step}"), "actor",
                      os.path.join(self.out_dir, "hf_actor"), self.cfg.actor_rollout_ref.model.path,
                      overwrite=True)

    def resume(self):
        """Load the newest checkpoint that verifies: one whose files fail their checksums, lack a
        manifest (unless trainer.allow_unverified_checkpoint) or cannot be read is skipped with a
        warning naming the file, and the one before it is tried. The logs then drop the rows of the
        steps after it, which are trained again."""
        from verl.checkpoint.manifest import CheckpointCorrupt
        if self.cfg.trainer.resume_mode != "auto":
            return
        root = os.path.join(self.out_dir, "checkpoints")
        failed = []
        for step in self.resume_candidates(root):
            try:
                state = self.load_step(root, step, "resume", at=None)
            except CheckpointCorrupt as error:
                error = getattr(error, "cause", error)  # what the worker raised, without Ray's wrapping
                failed.append(str(error))
                log.warning("%s; trying the checkpoint before it", error)
                continue
            self.step = state["step"]
            self.sampler.restore(state["sampler"])
            self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)
            if "health" in state:
                self.health.restore(state["health"])
                self.lr_scale = state["lr_scale"]
            log.info("resumed from step %d (%s)", step, root)
            break
        else:
            if failed:
                raise RuntimeError(
                    f"No checkpoint under {root} verifies: {'; '.join(failed)}. To start fresh, set "
                    f"trainer.resume_mode=disable (the checkpoints are left as they are) or a new "
                    f"trainer.default_local_dir.")
        # Also with no checkpoint at all: the steps a crashed run logged before its first save are redone.
        self.trim_data_order()
        self.tracker.rewind(self.step)

    def resume_candidates(self, root: str) -> list[int]:
        """Steps under `root` to resume from, newest first; with a critic, only steps it saved too
        (it saves first: a step without the actor's half is incomplete)."""
        from verl.checkpoint.store import complete_steps, resume_steps
        steps = resume_steps(root)
        if self.critic is not None:
            critic_steps = set(complete_steps(os.path.join(root, "critic")))
            steps = [s for s in steps if s in critic_steps]
        return steps

    def load_step(self, root: str, step: int, what: str, at: int | None) -> dict:
        """Load checkpoint `step` into every worker (the policy's, then the critic's), for `what`
        (resume, rollback) at training step `at`; the trainer state saved with it. Raises
        CheckpointCorrupt where a file fails verification."""
        state = self.policy.get([w.load.remote(root, step) for w in self.policy.workers], what, at)[0]
        if self.critic is not None:
            self.critic.get([w.load.remote(root, step) for w in self.critic.workers], what, at)
        return state

    def newest_intact_step(self, root: str) -> tuple[int | None, list[str]]:
        """The newest checkpoint under `root` whose files verify (both halves with a critic), checked
        here on the driver without loading it; and why each newer one failed."""
        from verl.checkpoint.manifest import CheckpointCorrupt, verify_checkpoint
        from verl.checkpoint.store import checkpoint_dir
        allow, failed = self.cfg.trainer.allow_unverified_checkpoint, []
        for step in self.resume_candidates(root):
            try:
                verify_checkpoint(checkpoint_dir(root, step), allow)
                if self.critic is not None:
                    verify_checkpoint(checkpoint_dir(os.path.join(root, "critic"), step), allow)
            except CheckpointCorrupt as error:
                failed.append(str(error))
                continue
            return step, failed
        return None, failed

    def trim_data_order(self) -> None:
        """Drop the data_order.jsonl lines of steps after the one resumed from: those steps are
        trained again, and each step is to be listed once."""
        path = os.path.join(self.out_dir, "data_order.jsonl")
        if not os.path.exists(path):
            return
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= self.step]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)

    def stop_if_not_finite(self, metrics: dict) -> None:
        """End the run at a step whose loss or gradient norm is nan or inf, before it is validated or
        saved: training on would save a broken state, and rotation would delete the good ones."""
        bad = non_finite_metrics(metrics)
        if not bad:
            return
        self.tracker.log(metrics, step=self.step)  # the bad values show next to the steps before them
        root = os.path.join(self.out_dir, "checkpoints")
        newest, failed = self.newest_intact_step(root)
        skipped = f" (newer ones fail verification: {'; '.join(failed)})" if failed else ""
        if newest is not None:
            where = (f"The newest checkpoint that verifies is step {newest} in {root}{skipped}: rerun to resume "
                     f"from it (trainer.resume_mode=auto) once the cause is fixed, e.g. with a lower "
                     f"actor_rollout_ref.actor.optim.lr.")
        elif failed:
            where = f"No checkpoint under {root} verifies{skipped}: a rerun would start fresh."
        else:
            where = "No checkpoint was saved before it."
        raise RuntimeError(f"step {self.step}: {', '.join(f'{k}={metrics[k]}' for k in bad)}: not finite, so the "
                           f"run stops here without validating or saving this state. {where}")

    def respond(self, signs: list[str], metrics: dict) -> bool:
        """What trainer.health.action says to do about this step's collapse signs. Returns whether
        the run rolled back (then this step's state is discarded, not saved)."""
        h = self.cfg.trainer.health
        what = f"step {self.step}: " + "; ".join(signs)
        if h.action == "warn":
            log.warning("%s. Training goes on (trainer.health.action=warn)", what)
            return False
        root = os.path.join(self.out_dir, "checkpoints")
        failed = []
        if h.action == "stop":
            reason = ("The run stops here (trainer.health.action=stop) without saving this step; rerun to resume "
                      "from the last checkpoint, e.g. with a lower actor_rollout_ref.actor.optim.lr, or set "
                      "trainer.health.action=rollback")
        elif self.health.rollbacks >= h.max_rollbacks:
            reason = (f"The run stops: it has rolled back {self.health.rollbacks} times already "
                      f"(trainer.health.max_rollbacks={h.max_rollbacks})")
        elif (target := self.roll_back(root, signs, failed)) is None:
            skipped = f" ({'; '.join(failed)})" if failed else ""
            reason = (f"No checkpoint saved while healthy that verifies is left under {root} to roll back "
                      f"to{skipped}: save more often (trainer.save_freq) or keep more "
                      "(trainer.keep_last_checkpoints)")
        else:
            reason = None
        if reason:
            self.tracker.log(metrics, step=self.step)  # the signs show next to the steps before them
            raise Unhealthy(f"{what}. {reason}.")
        self.health.rolled_back(target)
        self.lr_scale *= h.lr_factor
        for group in (self.policy, self.critic):
            if group is not None:
                group.get([w.set_lr_scale.remote(self.lr_scale) for w in group.workers], "learning rate", self.step)
        log.warning("%s. Rolled back to the checkpoint of step %d with the learning rate at %g× the configured one "
                    "and fresh sampling seeds (rollback %d of at most %d; trainer.health.action=rollback)",
                    what, target, self.lr_scale, self.health.rollbacks, h.max_rollbacks)
        return True

    def roll_back(self, root: str, signs: list[str], failed: list[str]) -> int | None:
        """Load the checkpoint the health watch picks to go back to; where it fails verification, the
        one it picks among those left, and so on. The step loaded, or None; `failed` gets why each
        checkpoint tried was refused."""
        from verl.checkpoint.manifest import CheckpointCorrupt
        from verl.checkpoint.store import complete_steps
        kept = complete_steps(root)
        while (target := self.health.rollback_target(kept, signs)) is not None:
            try:
                self.load_step(root, target, "rollback", at=self.step)
                return target
            except CheckpointCorrupt as error:
                error = getattr(error, "cause", error)  # what the worker raised, without Ray's wrapping
                failed.append(str(error))
                log.warning("%s; rolling back to an earlier checkpoint instead", error)
                kept.remove(target)
        return None

    def profile(self, action: str) -> None:
        """Start or stop every worker's profiler around the step being run (trainer.profile_steps).
        In one process (trainer.single_process) the policy's profiler sees the critic's work too."""
        groups = [self.policy]
        if self.critic is not None and not self.cfg.trainer.single_process:
            groups.append(self.critic)
        for group in groups:
            if action == "start":
                group.get([w.start_profile.remote() for w in group.workers], "profiler start", self.step)
            else:
                prefix = os.path.join(self.out_dir, "profile", f"step{self.step + 1}_{group.name}")
                files = group.get([w.stop_profile.remote(f"{prefix}{rank}") for rank, w in enumerate(group.workers)],
                                  "profiler stop", self.step)
                log.info("step %d profiled: %s", self.step + 1, ", ".join(f for fs in files for f in fs))

    def fit(self):
        from tqdm import tqdm

        # trainer.time_limit_minutes counts from here: resuming, validation and saving are included,
        # so the limit is the wall clock this run spends training (model loading comes before).
        start = time.perf_counter()
        self.resume()
        run = self.cfg.trainer
        if run.val_only:
            self.tracker.log(self.validate(), step=self.step)
            self.tracker.finish()
            return
        if run.val_before_train and self.step == 0:
            self.tracker.log(self.validate(), step=0)
        if run.health.action == "rollback" and self.step == 0:   # a healthy state to go back to from the start
            self.save()
            self.health.saved(0, healthy=True)
        with tqdm(total=self.total_steps, initial=self.step, desc="training", unit="step") as bar:
            while self.step < self.total_steps:
                examples = self.sampler.next_batch()
                with open(os.path.join(self.out_dir, "data_order.jsonl"), "a") as f:  # for audits of resume
                    f.write(json.dumps({"step": self.step + 1, "indices": [e.index for e in examples]}) + "\n")
                profiled = self.step + 1 in run.profile_steps
                if profiled:
                    self.profile("start")
                t = time.perf_counter()
                metrics = self.train_step(examples)
                metrics["timing_s/step"] = time.perf_counter() - t   # the traces' writing left out
                if profiled:
                    self.profile("stop")
                self.step += 1
                if run.health.action != "rollback":
                    self.stop_if_not_finite(metrics)
                metrics["data/epoch"] = self.sampler.epoch
                elapsed_s = time.perf_counter() - start
                last = is_last_step(self.step, self.total_steps, elapsed_s, run.time_limit_minutes)
                if run.test_freq > 0 and (self.step % run.test_freq == 0 or last) and not non_finite_metrics(metrics):
                    metrics |= self.validate()
                signs = self.health.check(self.step, metrics)
                metrics["health/alarms"] = float(len(signs))
                rolled_back = bool(signs) and self.respond(signs, metrics)
                if rolled_back:
                    metrics["health/rollbacks"] = float(self.health.rollbacks)
                # Before the save: a save that fails (a full disk) stops the run, and the step's row is kept.
                self.tracker.log(metrics, step=self.step)
                if not rolled_back and run.save_freq > 0 and (self.step % run.save_freq == 0 or last):
                    self.save()
                    self.health.saved(self.step, healthy=not signs)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                if last and self.step < self.total_steps:
                    log.info("stopped on the time limit at step %d of %d: %.1f min spent, "
                             "trainer.time_limit_minutes=%g", self.step, self.total_steps, elapsed_s / 60,
                             run.time_limit_minutes)
                    break
        self.tracker.finish()


def is_last_step(step: int, total_steps: int, elapsed_s: float, limit_minutes: float | None) -> bool:
    """After `step` steps and `elapsed_s` seconds of `fit`: is this step the last one? Yes at the
    planned total, or once the time limit is spent (a step that has started always finishes)."""
    return step >= total_steps or (limit_minutes is not None and elapsed_s >= 60 * limit_minutes)


def _merge_worker_metrics(dicts: list[dict], prefix: str = "") -> dict:
    """The workers' metrics under `prefix` + name: averaged over workers, except peak memory
    (`memory/…`), where the fullest worker is what meets the GPU's capacity."""
    keys = set().union(*dicts)
    return {prefix + k: float((np.max if k.startswith("memory/") else np.mean)([d[k] for d in dicts if k in d]))
            for k in keys}


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    return x
