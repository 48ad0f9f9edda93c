"""The training loop, run by the Ray driver (single controller).

One step, as data: prompts → rollout on every worker (agent loop + colocated engine) → rewards
(the responses as the workers decoded them, reward function named in the config) → old/ref
log-probs, values → advantages (pure functions in core_algos) → critic and actor updates → new
weights pushed into the engines. Validation, metrics and checkpoints around it, and an optional
wall-clock limit (`trainer.time_limit_minutes`) that makes the step running when it is spent the
last one. With algorithm.filter_groups (DAPO's dynamic sampling) the rollout and reward repeat on
the sampler's next prompts until enough groups have rewards that differ; a step then consumes more
prompts than data.train_batch_size, and a run of total_training_steps goes further into the data.
With trainer.rollout_ahead_steps = k >= 1 rollout workers of their own generate the next k steps'
batches while a step trains (verl.trainer.rollout_ahead), and the weights go to them after each update.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import time

import numpy as np
import torch

from verl import core_algos
from verl.batch import RolloutBatch, balanced_order
from verl.config.schema import TrainerConfig
from verl.config.sizes import Sizes
from verl.trainer.health import HealthWatch, Unhealthy, non_finite_metrics
from verl.trainer.metrics import (PEAK_FLOPS, Timer, load_reward_fn, merge_worker_metrics, reward_kwargs_for,
                                  score_trajectories, takes_extra_info, throughput_metrics, write_samples)
from verl.trainer.resume import Checkpoints, trim_data_order
from verl.trainer.rollout_ahead import RolloutAhead
from verl.utils.dataset import Example, PromptSampler

log = logging.getLogger(__name__)


class FilterGroupsExhausted(RuntimeError):
    """algorithm.filter_groups: too few groups kept within max_num_gen_batches generation batches."""


class ToolFailures(RuntimeError):
    """Too many of a step's tool calls (searches) failed to train on the step."""


class PPOTrainer:
    def __init__(self, cfg: TrainerConfig, sizes: Sizes, policy, critic, sampler: PromptSampler,
                 val_examples: list[Example] | None, tracker, total_steps: int, device_name: str,
                 flops_per_token: float | None = None, rollout=None):
        """`flops_per_token`: the actor update's model FLOPs a token (`update_flops_per_token`), for the
        MFU estimate (None: no estimate); `rollout`:
        the rollout workers' group (trainer.rollout_ahead_steps >= 1), else None."""
        self.cfg, self.sizes, self.policy, self.critic = cfg, sizes, policy, critic
        self.generators = rollout or policy   # whose workers generate
        self.ahead = None if rollout is None else RolloutAhead(
            rollout, cfg.trainer.rollout_ahead_steps, lambda examples, step: self.rollout_calls(
                examples, cfg.actor_rollout_ref.rollout.n_agent, False, step, logprobs=True))
        self.sampler, self.val_examples = sampler, val_examples
        self.tracker, self.total_steps = tracker, total_steps
        self.reward_fn = load_reward_fn(cfg.reward.function)
        self.reward_kwargs = reward_kwargs_for(self.reward_fn, cfg.reward.reward_kwargs)
        self.reward_takes_extra_info = takes_extra_info(self.reward_fn)
        self.estimator = core_algos.AdvEstimator(cfg.algorithm.adv_estimator)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (core_algos.AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon)
                        if kl.type == "adaptive" else core_algos.FixedKLController(kl.kl_coef))
        self.use_reference = cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in device_name), None)
        self.flops_per_token = flops_per_token
        self.out_dir = cfg.trainer.default_local_dir
        self.step = 0
        self.health = HealthWatch(cfg.trainer.health)
        actor = cfg.actor_rollout_ref.actor
        # One epoch: the update finds the log-probs before it on its own (Actor.update), at less cost
        # than the separate pass; only the KL in the reward needs them before the update.
        self.old_from_update = (sizes is not None and actor.old_log_probs == "auto" and actor.ppo_epochs == 1
                                and not cfg.algorithm.use_kl_in_reward)
        self.lr_scale = 1.0   # trainer.health.lr_factor per rollback
        self.checkpoints = Checkpoints(cfg, policy, critic, self.out_dir)

    # -- the step ------------------------------------------------------------------------------

    def train_step(self, examples: list[Example]) -> dict:
        timer = Timer()
        n = self.cfg.actor_rollout_ref.rollout.n_agent
        # trainer.critic_warmup: the critic learns alone until then (self.step counts finished steps)
        actor_learns = self.step + 1 >= self.cfg.trainer.critic_warmup
        generated = None   # model tokens generated, where more were than the batch holds
        if self.cfg.algorithm.filter_groups.enable:
            batch, metrics, generated = self.rollout_varied_groups(examples, n, timer)
        else:
            with timer("rollout"):
                batch = self.rollout(examples, n, greedy=False,
                                     logprobs=self.cfg.actor_rollout_ref.rollout.calculate_log_probs)
            with timer("reward"):
                batch.rewards_B, metrics = self.score(batch)
        metrics |= self.roll_ahead()   # k >= 1: the next steps' rollouts start now, beside this step's update
        batch, balance = self.balance(batch)
        with timer("reward"):
            metrics |= self.drop_failed_tool_calls(batch)
        if not self.old_from_update:
            with timer("old_log_probs"):
                batch.old_logprobs_BR = batch.cat_responses(self.run_on_worker_parts(
                    self.policy, batch, lambda w, part: w.compute_log_probs.remote(part), "old log-probs"))
        if self.use_reference:
            with timer("ref_log_probs"):
                batch.ref_logprobs_BR = batch.cat_responses(self.run_on_worker_parts(
                    self.policy, batch, lambda w, part: w.compute_ref_log_probs.remote(part), "reference log-probs"))
        if self.critic is not None:
            with timer("values"):
                batch.values_BR = batch.cat_responses(self.run_on_worker_parts(
                    self.critic, batch, lambda w, part: w.compute_values.remote(part), "values"))
        with timer("advantages"):
            metrics |= self.compute_advantages(batch)
        if self.critic is not None:
            with timer("update_critic"):
                metrics |= merge_worker_metrics(self.run_on_worker_parts(
                    self.critic, batch, lambda w, part: w.update_critic.remote(part), "critic update"),
                    prefix="critic/")
        if actor_learns:
            with timer("update_actor"):
                metrics |= merge_worker_metrics(self.run_on_worker_parts(
                    self.policy, batch, lambda w, part: w.update_actor.remote(part), "actor update"))
        if actor_learns:
            with timer("weight_sync"):
                self.push_weights()
        return (metrics | balance | self.throughput(batch, timer.seconds, generated)
                | {f"timing_s/{k}": v for k, v in timer.seconds.items()})

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

    # -- DAPO's dynamic sampling (algorithm.filter_groups) ----------------------------------------

    def rollout_varied_groups(self, examples: list[Example], n: int, timer: Timer) -> tuple[RolloutBatch, dict, int]:
        """Generate and score `examples` × n, drop the groups whose filter metric is the same for
        every sample, and draw the next prompts from the sampler (listed in data_order.jsonl) until
        as many groups are kept as `examples` holds; the first of them, the rewards set. Timing
        covers every generation; the reward metrics are means over the generation batches (all of
        one size), so they describe what the policy generated, not the filtered batch. Stops the run
        past algorithm.filter_groups.max_num_gen_batches. Returns the batch, the metrics and the
        model tokens generated."""
        filter_groups = self.cfg.algorithm.filter_groups
        want = len(examples) * n
        kept, scored, dropped, generated, groups_seen = [], [], 0, 0, 0
        for gen_batch in itertools.count():
            if gen_batch:
                examples = self.draw_prompts(gen_batch + 1)
            with timer("rollout"):
                batch = self.rollout(examples, n, greedy=False, gen_batch=gen_batch,
                                     logprobs=self.cfg.actor_rollout_ref.rollout.calculate_log_probs)
            with timer("reward"):
                batch.rewards_B, metrics = self.score(batch)
            scored.append(metrics)
            generated += sum(s.model_tokens for s in batch.info["stats"])
            keep_B = core_algos.varied_groups(self.filter_metric_B(batch, filter_groups.metric), batch.group_ids_B)
            # Ids numbered anew across the step's batches: a prompt drawn twice (past an epoch's end)
            # makes two groups.
            index_B = torch.unique(batch.group_ids_B, return_inverse=True)[1]
            dropped += len(index_B.unique()) - len(index_B[keep_B].unique())
            batch.group_ids_B = index_B + groups_seen
            groups_seen += len(index_B.unique())
            kept.append(batch.select(keep_B.nonzero().flatten()))
            if sum(len(b) for b in kept) >= want:
                break
            if 0 < filter_groups.max_num_gen_batches <= gen_batch + 1:
                raise FilterGroupsExhausted(
                    f"step {self.step + 1}: {sum(len(b) for b in kept) // n} of the {want // n} groups kept after "
                    f"{gen_batch + 1} generation batches (algorithm.filter_groups.max_num_gen_batches="
                    f"{filter_groups.max_num_gen_batches}): the other groups' {filter_groups.metric} was the same for "
                    "every sample. The prompts may be too hard or too easy for the policy; raise the key (0: no "
                    "limit), or switch algorithm.filter_groups.enable off.")
        metrics = {k: float(np.mean([m[k] for m in scored if k in m])) for k in set().union(*scored)}
        metrics |= {"filter_groups/dropped_groups": float(dropped), "filter_groups/gen_batches": float(gen_batch + 1)}
        return RolloutBatch.concat(kept).select(slice(0, want)), metrics, generated

    @staticmethod
    def filter_metric_B(batch: RolloutBatch, metric: str) -> torch.Tensor:
        """The per-trajectory value of algorithm.filter_groups.metric (verl's names; config.FILTER_METRICS)."""
        if metric == "acc":
            return torch.tensor(batch.info["em"], dtype=torch.float64)
        if metric == "score":
            return torch.tensor(batch.info["score"], dtype=torch.float64)
        return batch.rewards_B   # seq_reward, seq_final_reward (checked at start-up: no KL in the reward)

    def draw_prompts(self, gen_batch: int = 1, step: int | None = None) -> list[Example]:
        """The sampler's next batch, listed in data_order.jsonl under the step it is drawn for (the
        next one, or `step` when drawn ahead) and its generation batch, counted from 1, with
        algorithm.filter_groups."""
        examples = self.sampler.next_batch()
        row = {"step": step or self.step + 1, "indices": [e.index for e in examples]}
        if self.cfg.algorithm.filter_groups.enable:
            row["gen_batch"] = gen_batch
        with open(os.path.join(self.out_dir, "data_order.jsonl"), "a") as f:  # for audits of resume
            f.write(json.dumps(row) + "\n")
        return examples

    # -- phases --------------------------------------------------------------------------------

    def rollout_calls(self, examples: list[Example], n: int, greedy: bool, step: int, logprobs: bool,
                      gen_batch: int = 0) -> list:
        """(worker, arguments of its `generate`) for the rollout of `step` (1-based): the rows, n per
        example, in equal contiguous parts. `gen_batch`: the step's generation batch, counted from 0
        (more than one with algorithm.filter_groups), each with seeds of its own."""
        rows = [e for e in examples for _ in range(n)]
        world = len(self.generators.workers)
        rows_per_worker = -(-len(rows) // world)
        rollout_cfg = self.cfg.actor_rollout_ref.rollout
        temperature, top_p = (0.0, 1.0) if greedy else (rollout_cfg.temperature, rollout_cfg.top_p)
        # One seed per step and worker, from trainer.seed: a resumed step samples what it would have.
        # A rollback gives the steps after it fresh seeds.
        seed = (self.cfg.trainer.seed * 1_000_003 + step * 10_007 + self.health.rollbacks * 7_919
                + gen_batch * 104_729) % 2**31
        parts = [rows[i * rows_per_worker:(i + 1) * rows_per_worker] for i in range(world)]
        return [(w, ([e.prompt_ids for e in part], [e.index for e in part], temperature, top_p,
                     self.cfg.data.max_response_length, (seed + 100_003 * i) % 2**31, logprobs))
                for i, (w, part) in enumerate(zip(self.generators.workers, parts)) if part]

    def rollout(self, examples: list[Example], n: int, greedy: bool, logprobs: bool = False,
                gen_batch: int = 0) -> RolloutBatch:
        if self.ahead is not None and not greedy:   # a training step's batch: generated ahead, or asked for now
            if self.step + 1 not in self.ahead.pending:   # (the first step; the first after a resume)
                self.ahead.submit(self.step + 1, examples, None)
            return self.with_reward_inputs(self.ahead.take(self.step + 1), examples, n)
        calls = self.rollout_calls(examples, n, greedy, self.step + 1, logprobs, gen_batch)
        parts = self.generators.get([w.generate.remote(*args) for w, args in calls], "rollout", self.step)
        return self.with_reward_inputs(RolloutBatch.concat(parts), examples, n)

    def roll_ahead(self) -> dict:
        """trainer.rollout_ahead_steps = k >= 1: ask the rollout workers for the rollouts of the steps up
        to k after this one that are not asked for yet, their prompts drawn now; they generate with the
        weights pushed so far while this step trains. The staleness of this step's batch."""
        if self.ahead is None:
            return {}
        for step in range(self.step + 2, min(self.step + 1 + self.ahead.steps, self.total_steps) + 1):
            if step not in self.ahead.pending:
                before = self.sampler.state()
                self.ahead.submit(step, self.draw_prompts(step=step), before)
        return self.ahead.metrics()

    def next_examples(self) -> list[Example]:
        """The next step's prompts: drawn ahead with its rollout, or now."""
        ahead = self.ahead.pending.get(self.step + 1) if self.ahead is not None else None
        return ahead.examples if ahead is not None else self.draw_prompts()

    def push_weights(self) -> None:
        """The actor's new weights into the engines, in memory: each policy worker's own (k = 0), or the
        rollout workers', each after the generations asked of it before (never in the middle of one)."""
        if self.ahead is None:
            self.policy.get([w.sync_weights.remote() for w in self.policy.workers], "weight sync", self.step)
        else:
            self.ahead.push(self.policy, self.step)

    @staticmethod
    def with_reward_inputs(batch: RolloutBatch, examples: list[Example], n: int) -> RolloutBatch:
        """`batch` (n trajectories per example, in order) with what the reward function reads of each
        example: its data source, ground truth and extra_info, and the response text whole."""
        batch.info["data_source"] = [e.data_source for e in examples for _ in range(n)]
        batch.info["ground_truth"] = [e.ground_truth for e in examples for _ in range(n)]
        batch.info["extra_info"] = [e.extra_info for e in examples for _ in range(n)]
        # a response begun in the prompt (data with a response prefix) is scored and logged whole
        prefixes = [e.response_prefix for e in examples for _ in range(n)]
        if any(prefixes):
            texts = batch.info["response_text"]
            batch.info["response_text"] = [prefix + text for prefix, text in zip(prefixes, texts)]
        return batch

    def score(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict]:
        return score_trajectories(batch, self.reward_fn, self.reward_kwargs, self.reward_takes_extra_info,
                                  shaping=self.overlong_shaping)

    def overlong_shaping(self, scores: list[float], stats: list) -> tuple[list[float], dict]:
        """reward.overlong_buffer (DAPO): the scores less the penalty of responses near
        data.max_response_length, counted in response tokens (the model's and the tools', as verl
        counts them); the mean penalty and the share of responses penalised."""
        buffer = self.cfg.reward.overlong_buffer
        if not buffer.enable:
            return scores, {}
        penalty_B = core_algos.overlong_penalty(torch.tensor([s.response_tokens for s in stats]),
                                                self.cfg.data.max_response_length, buffer.len, buffer.penalty_factor)
        return ([score + p for score, p in zip(scores, penalty_B.tolist())],
                {"reward/overlong_penalty": float(penalty_B.mean()),
                 "reward/overlong_share": float((penalty_B < 0).float().mean())})

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
        algo = self.cfg.algorithm
        mask_BR = batch.loss_mask_BR if self.cfg.actor_rollout_ref.actor.state_masking else batch.response_mask_BR
        metrics = {}
        if self.estimator in (core_algos.AdvEstimator.GAE, core_algos.AdvEstimator.REINFORCE_PP):
            token_rewards_BR = core_algos.token_level_rewards(batch.rewards_B, mask_BR)
            if algo.use_kl_in_reward:
                kl_BR = core_algos.kl_penalty(batch.old_logprobs_BR, batch.ref_logprobs_BR, algo.kl_penalty)
                token_rewards_BR, mean_kl = core_algos.apply_kl_penalty(token_rewards_BR, kl_BR, mask_BR,
                                                                        self.kl_ctrl.value)
                self.kl_ctrl.update(float(mean_kl), len(batch))
                metrics |= {"kl/reward_kl": float(mean_kl), "kl/coef": float(self.kl_ctrl.value)}
            if self.estimator == core_algos.AdvEstimator.GAE:
                adv_BR, ret_BR = core_algos.gae_advantages(token_rewards_BR, batch.values_BR, mask_BR, algo.gamma,
                                                           algo.lam)
            else:
                adv_BR, ret_BR = core_algos.reinforce_pp_advantages(token_rewards_BR, mask_BR, algo.gamma)
        else:
            adv_BR, ret_BR = core_algos.compute_advantages(
                self.estimator, rewards_B=batch.rewards_B, group_ids_B=batch.group_ids_B, mask_BR=mask_BR,
                gamma=algo.gamma, lam=algo.lam, normalize_std=algo.norm_adv_by_std_in_grpo)
        batch.advantages_BR, batch.returns_BR = adv_BR, ret_BR
        return metrics | {"advantages/mean": float(core_algos.masked_mean(adv_BR, mask_BR))}

    def run_on_worker_parts(self, group, batch: RolloutBatch, call, what: str) -> list:
        """Split the batch over the group's workers and run `call(worker, part)` on each (a remote
        call: `lambda w, part: w.compute_values.remote(part)`); the results, in worker order."""
        parts = batch.split(len(group.workers))
        return group.get([call(w, part) for w, part in zip(group.workers, parts)], what, self.step)

    def throughput(self, batch: RolloutBatch, seconds: dict, generated: int | None = None) -> dict:
        if self.ahead is not None:   # the rollout workers' time generating, not the step's wait for it
            seconds = seconds | {"rollout": self.ahead.generate_s}
        return throughput_metrics(batch, seconds, self.flops_per_token, self.peak_flops,
                                  self.cfg.actor_rollout_ref.actor.ppo_epochs, self.sizes.world, generated)

    # -- loop ----------------------------------------------------------------------------------

    def validate(self) -> dict:
        if not self.val_examples:
            return {}
        started = time.perf_counter()
        batch = self.rollout(self.val_examples, 1, greedy=True)
        _, metrics = self.score(batch)
        self.write_samples(batch, f"val_step_{self.step}")
        out = {f"val/{k}": v for k, v in metrics.items()}
        out["timing_s/validation"] = time.perf_counter() - started
        return out

    def write_samples(self, batch: RolloutBatch, name: str, limit: int = 64):
        write_samples(batch, os.path.join(self.out_dir, "samples", f"{name}.jsonl"), self.step, limit)

    def save(self):
        sampler = self.sampler.state() if self.ahead is None else self.ahead.sampler_state(self.sampler.state())
        state = {"step": self.step, "sampler": sampler, "kl_coef": float(self.kl_ctrl.value),
                 "health": self.health.state(), "lr_scale": self.lr_scale}
        self.checkpoints.save(self.step, state)

    def resume(self):
        """Resume from the newest checkpoint that verifies (Checkpoints.load_newest). The logs then drop
        the rows of the steps after it, which are trained again."""
        if self.cfg.trainer.resume_mode != "auto":
            return
        state = self.checkpoints.load_newest()
        if state is not None:
            self.step = state["step"]
            self.sampler.restore(state["sampler"])
            self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)
            if "health" in state:
                self.health.restore(state["health"])
                self.lr_scale = state["lr_scale"]
            if self.ahead is not None:   # the rollout workers take the checkpoint's weights
                self.ahead.restart(self.policy, self.step)
        # Also with no checkpoint at all: the steps a crashed run logged before its first save are redone.
        trim_data_order(self.out_dir, self.step)
        self.tracker.rewind(self.step)

    def stop_if_not_finite(self, metrics: dict) -> None:
        """End the run at a step whose loss or gradient norm is nan or inf, before it is validated or
        saved: training on would save a broken state, and rotation would delete the good ones."""
        bad = non_finite_metrics(metrics)
        if not bad:
            return
        self.tracker.log(metrics, step=self.step)  # the bad values show next to the steps before them
        root = self.checkpoints.root
        newest, failed = self.checkpoints.newest_intact()
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

    def respond_to_collapse_signs(self, signs: list[str], metrics: dict) -> bool:
        """What trainer.health.action says to do about this step's collapse signs. Returns whether
        the run rolled back (then this step's state is discarded, not saved)."""
        health_cfg = self.cfg.trainer.health
        what = f"step {self.step}: " + "; ".join(signs)
        if health_cfg.action == "warn":
            log.warning("%s. Training goes on (trainer.health.action=warn)", what)
            return False
        root = self.checkpoints.root
        failed = []
        if health_cfg.action == "stop":
            reason = ("The run stops here (trainer.health.action=stop) without saving this step; rerun to resume "
                      "from the last checkpoint, e.g. with a lower actor_rollout_ref.actor.optim.lr, or set "
                      "trainer.health.action=rollback")
        elif self.health.rollbacks >= health_cfg.max_rollbacks:
            reason = (f"The run stops: it has rolled back {self.health.rollbacks} times already "
                      f"(trainer.health.max_rollbacks={health_cfg.max_rollbacks})")
        elif (target := self.checkpoints.roll_back(lambda kept: self.health.rollback_target(kept, signs),
                                                   self.step, failed)) is None:
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
        if self.ahead is not None:   # what runs ahead came from the weights rolled away from
            self.ahead.restart(self.policy, self.step)
        self.lr_scale *= health_cfg.lr_factor
        for group in (self.policy, self.critic):
            if group is not None:
                group.get([w.set_lr_scale.remote(self.lr_scale) for w in group.workers], "learning rate", self.step)
        log.warning("%s. Rolled back to the checkpoint of step %d with the learning rate at %g× the configured one "
                    "and fresh sampling seeds (rollback %d of at most %d; trainer.health.action=rollback)",
                    what, target, self.lr_scale, self.health.rollbacks, health_cfg.max_rollbacks)
        return True

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
                examples = self.next_examples()
                profiled = self.step + 1 in run.profile_steps
                if profiled:
                    self.profile("start")
                step_started = time.perf_counter()
                metrics = self.train_step(examples)
                metrics["timing_s/step"] = time.perf_counter() - step_started   # the traces' writing left out
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
                rolled_back = bool(signs) and self.respond_to_collapse_signs(signs, metrics)
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
