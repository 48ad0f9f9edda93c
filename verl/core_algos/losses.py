"""Losses: PPO's clipped policy loss, the clipped value loss, the entropy bonus, their reduction to a
scalar over the model's tokens, and the truncated importance weights of off-policy tokens.

Where we deviate from the papers or from common implementations, on purpose:
- PPO's ratio is clipped to [1 - clip_low, 1 + clip_high] (separate ranges, DAPO's "clip-higher"),
  with optional dual clip (Ye et al. 2020): for negative advantages the loss is capped at -c * A.
- `policy_loss`'s "approx_kl" statistic is the k3 estimator of KL(pi_old || pi_theta):
  ratio - 1 - log(ratio), non-negative and unbiased on tokens sampled from pi_old.
- Trajectories that carry the engine's own log-probs (rollout.calculate_log_probs: the inference
  engine's numerics differ from the trainer's, and off-policy trajectories come from older weights)
  weight each token's PPO term by min(pi_old / pi_rollout, cap), the truncated importance weight
  of IMPALA's V-trace and of "truncated importance sampling" for RL with a separate inference
  engine. pi_old is the actor before this update, pi_rollout the engine's
  log-prob of the sampled token; the weights carry no gradient. The PPO ratio itself stays
  pi_theta / pi_old, so clipping keeps its usual meaning (the decoupled objective).
- Masked means over an empty mask are 0, not NaN, and sequences without a model token are left out
  of per-sequence means: a trajectory whose model wrote nothing (e.g. truncated at the prompt)
  contributes no loss and no gradient instead of poisoning the batch.
"""
from __future__ import annotations

from enum import StrEnum

import torch

from verl.core_algos.common import MAX_LOG_RATIO, as_enum, masked_mean


class LossAgg(StrEnum):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"   # Dr.GRPO: divide by a constant length


def agg_loss(loss_BR: torch.Tensor, mask_BR: torch.Tensor, mode: LossAgg | str,
             norm_length: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the masked tokens.

    token-mean: every model token weighs the same (long answers weigh more);
    seq-mean-token-sum: sum per sequence, mean over sequences;
    seq-mean-token-mean: mean per sequence, mean over sequences (every sequence weighs the same);
    seq-mean-token-sum-norm: sum per sequence / `norm_length` (default R), mean over sequences —
    Dr.GRPO's constant normaliser, free of a length bias.
    Sequences without a masked token are left out of the sequence means.
    """
    mode = as_enum(LossAgg, mode, "loss aggregation")
    if mode == LossAgg.TOKEN_MEAN:
        return masked_mean(loss_BR, mask_BR)
    keep_BR = mask_BR.bool()
    seq_sum_B = torch.where(keep_BR, loss_BR, 0.0).sum(dim=-1)
    count_B = mask_BR.sum(dim=-1)
    if mode == LossAgg.SEQ_MEAN_TOKEN_SUM:
        seq_B = seq_sum_B
    elif mode == LossAgg.SEQ_MEAN_TOKEN_MEAN:
        seq_B = seq_sum_B / count_B.clamp(min=1)
    elif mode == LossAgg.SEQ_MEAN_TOKEN_SUM_NORM:
        seq_B = seq_sum_B / (mask_BR.shape[-1] if norm_length is None else norm_length)
    else:
        raise AssertionError(f"unhandled loss aggregation {mode}")
    return masked_mean(seq_B, (count_B > 0).to(seq_B.dtype))


def truncated_importance_weights(old_logprobs_BR: torch.Tensor, rollout_logprobs_BR: torch.Tensor,
                                 model_mask_BR: torch.Tensor, cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights min(pi_old / pi_rollout, cap) on the model's tokens, 1 elsewhere (tokens the
    policy did not sample, e.g. observations when the loss covers them). No gradient.

    Stats over the model's tokens: mean weight before truncation, share truncated, and the k3
    estimate of KL(pi_rollout || pi_old), the distance between the sampling and the trained policy.
    """
    if cap < 1.0:
        raise ValueError(f"the importance-weight cap must be >= 1, got {cap}")
    with torch.no_grad():
        log_w_BR = (old_logprobs_BR - rollout_logprobs_BR).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        w_BR = log_w_BR.exp()
        stats = {"mean": masked_mean(w_BR, model_mask_BR).item(),
                 "truncated": masked_mean((w_BR > cap).float(), model_mask_BR).item(),
                 "kl": masked_mean(w_BR - 1 - log_w_BR, model_mask_BR).item()}
        weights_BR = torch.where(model_mask_BR.bool(), w_BR.clamp(max=cap), torch.ones_like(w_BR))
    return weights_BR, stats


def policy_loss(logprobs_BR: torch.Tensor, old_logprobs_BR: torch.Tensor, advantages_BR: torch.Tensor,
                mask_BR: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip_c: float | None = None, agg: LossAgg | str = LossAgg.TOKEN_MEAN,
                norm_length: float | None = None,
                weights_BR: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate, ratio clipped to [1 - clip_low, 1 + clip_high], optional dual clip;
    `weights_BR` (e.g. truncated importance weights) multiply each token's term.

    Returns (loss, stats) with python-float stats: clipfrac (tokens where the clipped term is
    active), approx_kl (k3 estimate of KL(pi_old || pi_theta)), dual_clip_frac, ratio_max.
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (e.g. 3), got {dual_clip_c}")
    log_ratio_BR = (logprobs_BR - old_logprobs_BR).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio_BR = log_ratio_BR.exp()
    unclipped_BR = -advantages_BR * ratio_BR
    clipped_BR = -advantages_BR * ratio_BR.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BR = torch.maximum(unclipped_BR, clipped_BR)
    if dual_clip_c is not None:
        # With A < 0 and a huge ratio the clipped surrogate is unbounded: cap it at -c * A.
        capped_BR = torch.minimum(loss_BR, -dual_clip_c * advantages_BR)
        dual_clipped_BR = (advantages_BR < 0) & (capped_BR < loss_BR)
        loss_BR = torch.where(advantages_BR < 0, capped_BR, loss_BR)
    else:
        dual_clipped_BR = torch.zeros_like(mask_BR, dtype=torch.bool)
    if weights_BR is not None:
        loss_BR = loss_BR * weights_BR
    loss = agg_loss(loss_BR, mask_BR, agg, norm_length)

    with torch.no_grad():
        keep_BR = mask_BR.bool()
        stats = {
            "clipfrac": masked_mean((clipped_BR > unclipped_BR).float(), mask_BR).item(),
            "approx_kl": masked_mean(ratio_BR - 1 - log_ratio_BR, mask_BR).item(),
            "dual_clip_frac": masked_mean(dual_clipped_BR.float(), mask_BR).item(),
            "ratio_max": torch.where(keep_BR, ratio_BR, 0.0).max().item() if keep_BR.any() else 0.0,
        }
    return loss, stats


def value_loss(values_BR: torch.Tensor, old_values_BR: torch.Tensor, returns_BR: torch.Tensor,
               mask_BR: torch.Tensor, clip_range: float = 0.2, agg: LossAgg | str = LossAgg.TOKEN_MEAN,
               norm_length: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip within ±clip_range of the
    rollout-time value. Stats: vf_clipfrac (tokens where the clipped term is the larger)."""
    clipped_values_BR = old_values_BR + (values_BR - old_values_BR).clamp(-clip_range, clip_range)
    unclipped_sq_BR = (values_BR - returns_BR) ** 2
    clipped_sq_BR = (clipped_values_BR - returns_BR) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped_sq_BR, clipped_sq_BR), mask_BR, agg, norm_length)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((clipped_sq_BR > unclipped_sq_BR).float(), mask_BR).item()}
    return loss, stats


def entropy_loss(entropy_BR: torch.Tensor, mask_BR: torch.Tensor, agg: LossAgg | str = LossAgg.TOKEN_MEAN,
                 norm_length: float | None = None) -> torch.Tensor:
    """Aggregated entropy of the model tokens (positive); the caller subtracts coef * this from the
    loss to reward exploration."""
    return agg_loss(entropy_BR, mask_BR, agg, norm_length)
