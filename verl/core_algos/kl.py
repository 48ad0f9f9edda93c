"""KL: per-token estimates of KL(pi || pi_ref), the KL penalty subtracted from the reward, and the
controllers of its coefficient (fixed, or adaptive toward a target KL)."""
from __future__ import annotations

from enum import StrEnum

import torch

from verl.core_algos.common import MAX_LOG_RATIO, as_enum, masked_mean


class KLPenalty(StrEnum):
    K1 = "k1"    # log p - log ref: unbiased, high variance, can be negative
    ABS = "abs"
    K2 = "k2"    # 0.5 (log p - log ref)^2
    K3 = "k3"    # Schulman's low-variance estimator, always >= 0


# Names used by existing configs for the same estimators.
_KL_ALIASES = {"kl": KLPenalty.K1, "mse": KLPenalty.K2, "low_var_kl": KLPenalty.K3}


def kl_penalty(logprobs_BR: torch.Tensor, ref_logprobs_BR: torch.Tensor,
               kind: KLPenalty | str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

    Kinds (aliases in brackets): k1 [kl] = log p - log ref; abs = |k1|; k2 [mse] = 0.5 k1^2;
    k3 [low_var_kl] = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    """
    kind = as_enum(KLPenalty, kind, "KL penalty", _KL_ALIASES)
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
        neg_BR = (-log_ratio_BR).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
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
