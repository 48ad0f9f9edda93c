"""What the estimators, the KL terms and the losses share: masked and per-group statistics, the bound
on log-ratios, and reading a variant's name.

Where we deviate from common implementations, on purpose:
- The log-ratio is clamped to ±20 before `exp` in the policy loss and the k3 KL: values are
  unchanged in any realistic case, but one stale token can no longer produce inf / NaN gradients.
"""
from __future__ import annotations

import torch

# exp(20) ≈ 4.9e8: far beyond any clip range, yet well inside float32.
MAX_LOG_RATIO = 20.0


def as_enum(enum_cls, value, what: str, aliases: dict | None = None):
    if aliases and value in aliases:
        return aliases[value]
    try:
        return enum_cls(value)
    except ValueError:
        names = [e.value for e in enum_cls] + list(aliases or {})
        raise ValueError(f"unknown {what} {value!r}; choose one of {names}") from None


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


def group_index(group_ids_B: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to 0..G-1."""
    _, index_B = torch.unique(group_ids_B, return_inverse=True)
    return index_B, int(index_B.max()) + 1 if index_B.numel() else 0


def group_sum(x_B: torch.Tensor, index_B: torch.Tensor, G: int) -> torch.Tensor:
    return torch.zeros(G, dtype=x_B.dtype, device=x_B.device).index_add_(0, index_B, x_B)


def group_mean_and_count(rewards_B: torch.Tensor, group_ids_B: torch.Tensor):
    """Per-trajectory mean of its group and the group's size (both shape B)."""
    index_B, G = group_index(group_ids_B)
    count_G = torch.bincount(index_B, minlength=G).to(rewards_B.dtype)
    mean_G = group_sum(rewards_B, index_B, G) / count_G
    return mean_G[index_B], count_G[index_B], index_B, G
