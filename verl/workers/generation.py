"""One rollout call, shared by every process that generates: the policy worker's colocated engine
(trainer.rollout_ahead_steps = 0) and the rollout workers of their own processes (k >= 1). Both run
these same lines, so that the same weights, prompts and seed give the same tokens in either."""
from __future__ import annotations

import torch

from verl.batch import RolloutBatch, pack_trajectories


def sample_trajectories(agent, engine, rollout, prompts: list[list[int]], temperature: float, top_p: float,
                        max_tokens: int, seed: int | None, logprobs: bool) -> list:
    """The agent loop over `prompts`. `rollout`: the actor_rollout_ref.rollout config. `seed` (the step's,
    for this worker) makes the samples repeat: each request's own (vLLM on CPU ignores those), or with
    rollout.request_seeds=false the engine's one stream, re-seeded here."""
    from verl.workers.rollout.engine import SamplingConfig
    if seed is not None and not rollout.request_seeds:  # one stream for the call, not one a request
        engine.reseed(seed)
        seed = None
    return agent.run(prompts, SamplingConfig(temperature, top_p, max_tokens, seed=seed,
                                             logit_bias=rollout.logit_bias or None, logprobs=logprobs))


def trajectories_batch(trajectories: list, prompts: list[list[int]], group_ids: list[int], tokenizer,
                       logprobs: bool, loop_cls) -> RolloutBatch:
    """The trajectories as the step's typed batch, their responses decoded (by every worker for its
    own rows: on the driver the decode of the whole step grew with the cluster, benchmarks/RESULTS.md,
    "Weak scaling"); with `logprobs`, the engine's log-probs as batch.rollout_logprobs_BR."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = pack_trajectories(prompts, [t.response_ids for t in trajectories], [t.loss_mask for t in trajectories],
                              group_ids, pad)
    if logprobs:
        batch.rollout_logprobs_BR = rollout_logprobs_BR(trajectories, batch.loss_mask_BR.shape[1], loop_cls)
    texts = tokenizer.batch_decode([t.response_ids for t in trajectories], skip_special_tokens=True)
    batch.info = {"stats": [t.stats() for t in trajectories],  # TrajectoryStats
                  "response_text": texts,
                  "response_ids": [list(t.response_ids) for t in trajectories],
                  "loss_mask": [list(t.loss_mask) for t in trajectories]}
    return batch


def rollout_logprobs_BR(trajectories, width: int, loop_cls) -> torch.Tensor:
    """The trajectories' engine log-probs as a [B, R] tensor, right-padded with 0."""
    out_BR = torch.zeros((len(trajectories), width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        values = getattr(t, "rollout_logprobs", None)
        if values is None:
            raise RuntimeError(f"actor_rollout_ref.rollout.calculate_log_probs needs the log-prob of every sampled "
                               f"token, and the agent loop {loop_cls.__module__}:{loop_cls.__name__} returned a "
                               "trajectory without them (Trajectory.rollout_logprobs): pass Generation.logprobs "
                               "on, or set actor_rollout_ref.rollout.calculate_log_probs=false")
        out_BR[i, :len(values)] = torch.tensor(values, dtype=torch.float32)
    return out_BR
