"""Advantage estimators, KL penalties and losses: pure functions of tensors.

Shape letters: B = trajectories, R = response tokens, V = vocabulary. Every `mask_BR` here is the
loss mask: 1.0 on tokens the model wrote, 0.0 on retrieved observations and on padding (Search-R1's
"state masking"). Nothing in this module reads a config object; the trainer passes plain values.

Where we deviate from the papers or from common implementations, on purpose:
- GAE and REINFORCE++ run their recursion over model tokens only. Observation tokens are written by
  the environment, not chosen by the policy, so they are not steps of the MDP: the recursion links
  each model token directly to the NEXT model token, skipping the observation in between (with no
  discount for the skipped positions). Running it over every response position instead would
  bootstrap from critic values on retrieved text and discount the reward by the length of the
  passages, which says nothing about the quality of the model's actions. Token rewards that sit on
  masked positions are ignored (`token_level_rewards` never puts one there).
- GRPO's group std is unbiased (like `torch.std`); a group of one trajectory gets advantage 0, as
  does RLOO's, since there is nothing to compare it with.
- PPO's ratio is clipped to [1 - clip_low, 1 + clip_high] (separate ranges, DAPO's "clip-higher"),
  with optional dual clip (Ye et al. 2020): for negative advantages the loss is capped at -c * A.
- The log-ratio is clamped to ±20 before `exp` in the policy loss and the k3 KL: values are
  unchanged in any realistic case, but one stale token can no longer produce inf / NaN gradients.
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
- DAPO's overlong penalty stays at -penalty_factor past the length limit, where verl's keeps falling.
"""
from __future__ import annotations

import math
from enum import StrEnum

import torch

# exp(20) ≈ 4.9e8: far beyond any clip range, yet well inside float32.
_MAX_LOG_RATIO = 20.0


class AdvEstimator(StrEnum):
    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce_plus_plus"
    REINFORCE_PP_BASELINE = "reinforce_plus_plus_baseline"


class KLPenalty(StrEnum):
    K1 = "k1"    # log p - log ref: unbiased, high variance, can be negative
    ABS = "abs"
    K2 = "k2"    # 0.5 (log p - log ref)^2
    K3 = "k3"    # Schulman's low-variance estimator, always >= 0


# Names used by existing configs for the same estimators.
_KL_ALIASES = {"kl": KLPenalty.K1, "mse": KLPenalty.K2, "low_var_kl": KLPenalty.K3}


class LossAgg(StrEnum):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"   # Dr.GRPO: divide by a constant length


def _as_enum(enum_cls, value, what: str, aliases: dict | None = None):
    if aliases and value in aliases:
        return aliases[value]
    try:
        return enum_cls(value)
    except ValueError:
        names = [e.value for e in enum_cls] + list(aliases or {})
        raise ValueError(f"unknown {what} {value!r}; choose one of {names}") from None


# ----------------------------------------------------------------------------- masked statistics

def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of `x` where `mask` is 1; 0 where the mask is empty.

    `torch.where` rather than `x * mask`, so inf / NaN at masked positions (e.g. log-probs of
    padding) cannot leak into the result or its gradient.
    """
    keep = mask.bool()
    total = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=dim)
    count = mask.to(x.dtype).sum(dim=dim)
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all positions where `mask` is 1 (Bessel-corrected by default).

    Fewer than two counted values give 0 rather than NaN.
    """
    mean = masked_mean(x, mask)
    sq = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.to(x.dtype).sum()
        # torch.where rather than a python `if`: no host sync on GPU.
        sq = torch.where(count > 1, sq * count / (count - 1).clamp(min=1), 0.0)
    return sq


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Normalise `x` to unit variance over the masked positions; zero mean unless `shift_mean=False`.

    Masked-out positions are transformed too (the caller masks them again if it needs zeros).
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    return whitened if shift_mean else whitened + mean


# ----------------------------------------------------------------------------- rewards

def token_level_rewards(rewards_B: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    """Place each outcome reward on the last model token of its row (the last position with mask 1).

    The reward comes after the model's final action (its `<answer>` or EOS), so that token is the one
    credited; trailing observations or padding after it get nothing. A row without any model token
    gets no reward at all: there is no action to credit, and the losses ignore that row anyway.
    """
    B, R = mask_BR.shape
    has_model_token_B = mask_BR.sum(dim=-1) > 0
    # argmax over the flipped mask finds the first 1 from the right.
    last_B = (R - 1) - mask_BR.flip(-1).gt(0).to(torch.int8).argmax(dim=-1)
    rewards_BR = torch.zeros(B, R, dtype=rewards_B.dtype, device=rewards_B.device)
    rewards_BR[torch.arange(B, device=rewards_B.device), last_B] = rewards_B
    return rewards_BR * has_model_token_B[:, None].to(rewards_BR.dtype)


# ----------------------------------------------------------------------------- advantage estimators

def gae_advantages(token_rewards_BR: torch.Tensor, values_BR: torch.Tensor, mask_BR: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over model tokens only (see the module docstring).

    Returns (advantages_BR whitened over the mask, returns_BR = raw advantages + values); both are 0
    on masked positions. After a row's last model token the episode ends: the bootstrap value is 0.
    """
    B, R = mask_BR.shape
    keep_BR = mask_BR.bool()
    rewards_BR = torch.where(keep_BR, token_rewards_BR, 0.0).float()
    values_BR = torch.where(keep_BR, values_BR.detach(), 0.0).float()
    # Value and advantage of the next model token to the right; they carry unchanged across an
    # observation so the recursion jumps over it.
    next_value_B = torch.zeros(B, dtype=torch.float32, device=values_BR.device)
    next_adv_B = torch.zeros_like(next_value_B)
    advantages_BR = torch.zeros_like(values_BR)
    for t in reversed(range(R)):
        keep_B = keep_BR[:, t]
        delta_B = rewards_BR[:, t] + gamma * next_value_B - values_BR[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        advantages_BR[:, t] = torch.where(keep_B, adv_B, 0.0)
        next_value_B = torch.where(keep_B, values_BR[:, t], next_value_B)
        next_adv_B = torch.where(keep_B, adv_B, next_adv_B)
    returns_BR = (advantages_BR + values_BR) * mask_BR
    advantages_BR = masked_whiten(advantages_BR, mask_BR) * mask_BR
    return advantages_BR, returns_BR


def _group_index(group_ids_B: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to 0..G-1."""
    _, index_B = torch.unique(group_ids_B, return_inverse=True)
    return index_B, int(index_B.max()) + 1 if index_B.numel() else 0


def _group_sum(x_B: torch.Tensor, index_B: torch.Tensor, G: int) -> torch.Tensor:
    return torch.zeros(G, dtype=x_B.dtype, device=x_B.device).index_add_(0, index_B, x_B)


def _group_mean_and_count(rewards_B: torch.Tensor, group_ids_B: torch.Tensor):
    """Per-trajectory mean of its group and the group's size (both shape B)."""
    index_B, G = _group_index(group_ids_B)
    count_G = torch.bincount(index_B, minlength=G).to(rewards_B.dtype)
    mean_G = _group_sum(rewards_B, index_B, G) / count_G
    return mean_G[index_B], count_G[index_B], index_B, G


def grpo_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor, mask_BR: torch.Tensor,
                    normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage (r - group mean) / (group std + eps), broadcast over model tokens.

    `normalize_std=False` is Dr.GRPO: dividing by the std up-weights prompts whose rewards barely
    differ (too easy or too hard), a bias Dr.GRPO removes.
    """
    rewards_B = rewards_B.float()
    mean_B, count_B, index_B, G = _group_mean_and_count(rewards_B, group_ids_B)
    adv_B = rewards_B - mean_B
    if normalize_std:
        sq_G = _group_sum(adv_B ** 2, index_B, G)
        std_B = (sq_G[index_B] / (count_B - 1).clamp(min=1)).sqrt()
        adv_B = adv_B / (std_B + eps)
    adv_B = torch.where(count_B > 1, adv_B, 0.0)
    return adv_B[:, None] * mask_BR


def rloo_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor,
                    mask_BR: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: r_i minus the mean reward of the other members of its group."""
    rewards_B = rewards_B.float()
    mean_B, count_B, _, _ = _group_mean_and_count(rewards_B, group_ids_B)
    others_mean_B = (mean_B * count_B - rewards_B) / (count_B - 1).clamp(min=1)
    adv_B = torch.where(count_B > 1, rewards_B - others_mean_B, 0.0)
    return adv_B[:, None] * mask_BR


def reinforce_pp_advantages(token_rewards_BR: torch.Tensor, mask_BR: torch.Tensor,
                            gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go over model tokens (observations skipped, as in GAE),
    whitened over the whole batch's model tokens. Returns (advantages_BR, returns_BR = raw returns)."""
    B, R = mask_BR.shape
    keep_BR = mask_BR.bool()
    rewards_BR = torch.where(keep_BR, token_rewards_BR, 0.0).float()
    next_return_B = torch.zeros(B, dtype=torch.float32, device=rewards_BR.device)
    returns_BR = torch.zeros_like(rewards_BR)
    for t in reversed(range(R)):
        ret_B = rewards_BR[:, t] + gamma * next_return_B
        returns_BR[:, t] = torch.where(keep_BR[:, t], ret_B, 0.0)
        next_return_B = torch.where(keep_BR[:, t], ret_B, next_return_B)
    advantages_BR = masked_whiten(returns_BR, mask_BR) * mask_BR
    return advantages_BR, returns_BR


def reinforce_pp_baseline_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor,
                                     mask_BR: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a group-mean baseline: (r - group mean), broadcast over model tokens, then
    whitened over all model tokens of the batch (a global, not per-group, scale)."""
    rewards_B = rewards_B.float()
    mean_B, _, _, _ = _group_mean_and_count(rewards_B, group_ids_B)
    adv_BR = (rewards_B - mean_B)[:, None] * mask_BR
    return masked_whiten(adv_BR, mask_BR) * mask_BR


def compute_advantages(estimator: AdvEstimator | str, *, rewards_B: torch.Tensor,
                       group_ids_B: torch.Tensor, mask_BR: torch.Tensor,
                       values_BR: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
                       normalize_std: bool = True,
                       token_rewards_BR: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns for one batch, both [B, R] and 0 on masked positions.

    Token-level estimators (GAE, REINFORCE++) read `token_rewards_BR` when given (e.g. outcome reward
    with the KL penalty already subtracted), else the outcome reward on the last model token. Group
    estimators read the outcome `rewards_B`. Without a critic, returns_BR is the advantage itself.
    """
    estimator = _as_enum(AdvEstimator, estimator, "advantage estimator")
    if token_rewards_BR is None and estimator in (AdvEstimator.GAE, AdvEstimator.REINFORCE_PP):
        token_rewards_BR = token_level_rewards(rewards_B, mask_BR)

    if estimator == AdvEstimator.GAE:
        if values_BR is None:
            raise ValueError("the GAE estimator needs critic values (values_BR); enable the critic or "
                             "pick an estimator without one: grpo, rloo, reinforce_plus_plus(_baseline)")
        return gae_advantages(token_rewards_BR, values_BR, mask_BR, gamma, lam)
    elif estimator == AdvEstimator.GRPO:
        adv_BR = grpo_advantages(rewards_B, group_ids_B, mask_BR, normalize_std=normalize_std)
    elif estimator == AdvEstimator.RLOO:
        adv_BR = rloo_advantages(rewards_B, group_ids_B, mask_BR)
    elif estimator == AdvEstimator.REINFORCE_PP:
        return reinforce_pp_advantages(token_rewards_BR, mask_BR, gamma)
    elif estimator == AdvEstimator.REINFORCE_PP_BASELINE:
        adv_BR = reinforce_pp_baseline_advantages(rewards_B, group_ids_B, mask_BR)
    else:
        raise AssertionError(f"unhandled estimator {estimator}")
    return adv_BR, adv_BR


# ----------------------------------------------------------------------------- DAPO

def varied_groups(metric_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    """bool_B: whether the trajectory's group has at least two different metric values, i.e. gives
    a group estimator a signal (DAPO's dynamic sampling keeps those groups). A group of one is kept,
    as verl keeps it. verl compares the group's std with 0; max > min is the same test without the
    rounding of a std of equal floats."""
    index_B, G = _group_index(group_ids_B)
    metric_B = metric_B.double()
    hi_G = torch.full((G,), -math.inf, dtype=torch.float64).scatter_reduce(0, index_B, metric_B, "amax")
    lo_G = torch.full((G,), math.inf, dtype=torch.float64).scatter_reduce(0, index_B, metric_B, "amin")
    count_G = torch.bincount(index_B, minlength=G)
    return ((hi_G > lo_G) | (count_G == 1))[index_B]


def overlong_penalty(lengths_B: torch.Tensor, max_length: int, buffer_length: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's overlong reward shaping: 0 up to `max_length - buffer_length` tokens, then falling
    linearly to -penalty_factor at `max_length`. verl's formula keeps falling past the limit; here
    the penalty stays at -penalty_factor there (a response past the limit: a multi-turn loop whose
    limit is per turn)."""
    over_B = (lengths_B.double() - (max_length - buffer_length)).clamp(0, buffer_length)
    return (-over_B / buffer_length * penalty_factor).float()


# ----------------------------------------------------------------------------- KL

def kl_penalty(logprobs_BR: torch.Tensor, ref_logprobs_BR: torch.Tensor,
               kind: KLPenalty | str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

    Kinds (aliases in brackets): k1 [kl] = log p - log ref; abs = |k1|; k2 [mse] = 0.5 k1^2;
    k3 [low_var_kl] = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    """
    kind = _as_enum(KLPenalty, kind, "KL penalty", _KL_ALIASES)
    log_ratio_BR = logprobs_BR - ref_logprobs_BR
    if kind == KLPenalty.K1:
        return log_ratio_BR
    elif kind == KLPenalty.ABS:
        return log_ratio_BR.abs()
    elif kind == KLPenalty.K2:
        return 0.5 * log_ratio_BR ** 2
    elif kind == KLPenalty.K3:
        # Clamping the exponent first keeps exp finite (and its gradient non-NaN); every value it
        # changes would be clamped to 10 by the output clamp anyway.
        neg_BR = (-log_ratio_BR).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (neg_BR.exp() - neg_BR - 1).clamp(-10.0, 10.0)
    raise AssertionError(f"unhandled KL penalty {kind}")


def apply_kl_penalty(token_rewards_BR: torch.Tensor, kl_BR: torch.Tensor, mask_BR: torch.Tensor,
                     beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-in-reward: subtract beta * kl on model tokens.

    Returns (rewards_BR, mean_kl) where mean_kl (a 0-dim tensor, detached) is each sequence's mean KL
    over its model tokens, averaged over sequences that have any.
    """
    kl_BR = torch.where(mask_BR.bool(), kl_BR, 0.0)
    rewards_BR = token_rewards_BR - beta * kl_BR
    has_tokens_B = (mask_BR.sum(dim=-1) > 0).float()
    seq_kl_B = masked_mean(kl_BR, mask_BR, dim=-1)
    mean_kl = masked_mean(seq_kl_B, has_tokens_B).detach()
    return rewards_BR, mean_kl


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, value: float):
        self.value = value

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. (2019): steer the measured KL toward `target_kl`.

    The relative error is clipped to ±0.2 so a single noisy KL estimate moves beta by at most
    20% * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


# ----------------------------------------------------------------------------- losses

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
    mode = _as_enum(LossAgg, mode, "loss aggregation")
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
        log_w_BR = (old_logprobs_BR - rollout_logprobs_BR).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
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
    log_ratio_BR = (logprobs_BR - old_logprobs_BR).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
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


def logprobs_and_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor, temperature: float = 1.0,
                         with_entropy: bool = False, entropy_grad: bool = True,
                         chunk_elements: int = 1 << 27) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[label] and, optionally, the entropy of that softmax.

    logits_NV may have any leading shape (…, V); labels match it without V. Both results are fp32
    (fp64 for fp64 logits): bf16 log-probs are too coarse for PPO's ratio. With `entropy_grad=False`
    the entropy is returned detached (for metrics).

    Memory: with a 150k-token vocabulary the logits are the largest tensor of an update (7,000 response
    tokens × 151,936 × 4 bytes = 4.3 GB per fp32 copy), and the plain composition (upcast, divide,
    log-softmax, softmax for the entropy) keeps several such copies alive. Here rows are processed in
    chunks of about `chunk_elements` values: only the logits as given (usually bf16) are kept for
    backward, which recomputes each chunk's softmax and writes the gradient chunk by chunk.
    """
    V = logits_NV.shape[-1]
    flat_NV, flat_N = logits_NV.reshape(-1, V), labels_N.reshape(-1)
    chunk_rows = max(1, chunk_elements // V)
    logprobs_N, entropy_N = _ChunkedLogprobs.apply(flat_NV, flat_N, float(temperature), chunk_rows, with_entropy)
    logprobs = logprobs_N.view(labels_N.shape)
    if not with_entropy:
        return logprobs, None
    entropy = entropy_N.view(labels_N.shape)
    return logprobs, entropy if entropy_grad else entropy.detach()


class _ChunkedLogprobs(torch.autograd.Function):
    """See `logprobs_and_entropy`. With z = logits / T, log p = z - logsumexp(z) and H = -Σ p log p:
    d logp_label / dz = onehot(label) - p,   dH / dz = -p ⊙ (log p + H).
    The entropy is summed over log p (finite even where p underflows to 0), not as lse - Σ p z,
    whose two terms grow with |z| and cancel."""

    @staticmethod
    def forward(ctx, logits_NV, labels_N, temperature, chunk_rows, with_entropy):
        dtype = torch.promote_types(logits_NV.dtype, torch.float32)
        N = logits_NV.shape[0]
        lse_N = torch.empty(N, dtype=dtype, device=logits_NV.device)
        logprobs_N = torch.empty_like(lse_N)
        entropy_N = torch.empty_like(lse_N) if with_entropy else None
        for s in range(0, N, chunk_rows):
            e = min(N, s + chunk_rows)
            z_cV = logits_NV[s:e].to(dtype, copy=True).div_(temperature)
            lse_N[s:e] = torch.logsumexp(z_cV, dim=-1)
            logp_cV = z_cV.sub_(lse_N[s:e, None])
            logprobs_N[s:e] = logp_cV.gather(-1, labels_N[s:e, None]).squeeze(-1)
            if with_entropy:
                entropy_N[s:e] = -(logp_cV.exp() * logp_cV).sum(-1)
        ctx.save_for_backward(logits_NV, labels_N, lse_N, entropy_N)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.set_materialize_grads(False)  # an unused output (e.g. a detached entropy) sends None
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, g_logprobs_N, g_entropy_N):
        logits_NV, labels_N, lse_N, entropy_N = ctx.saved_tensors
        T, N = ctx.temperature, logits_NV.shape[0]
        if g_logprobs_N is None and g_entropy_N is None:
            return torch.zeros_like(logits_NV), None, None, None, None
        grad_NV = torch.empty_like(logits_NV)
        for s in range(0, N, ctx.chunk_rows):
            e = min(N, s + ctx.chunk_rows)
            logp_cV = logits_NV[s:e].to(lse_N.dtype, copy=True).div_(T).sub_(lse_N[s:e, None])
            p_cV = logp_cV.exp()
            grad_cV = None
            if g_entropy_N is not None:  # in logp's memory
                grad_cV = logp_cV.add_(entropy_N[s:e, None]).mul_(p_cV).mul_(-g_entropy_N[s:e, None])
            if g_logprobs_N is not None:
                g_c1 = g_logprobs_N[s:e, None]
                minus_p_cV = p_cV.mul_(-g_c1)
                grad_cV = minus_p_cV if grad_cV is None else grad_cV.add_(minus_p_cV)
                grad_cV.scatter_add_(-1, labels_N[s:e, None], g_c1)
            grad_NV[s:e] = grad_cV.div_(T)
        return grad_NV, None, None, None, None
