"""DAPO's dynamic sampling (keep the groups whose rewards differ) and its overlong reward shaping.

DAPO's overlong penalty stays at -penalty_factor past the length limit, where verl's keeps falling.
"""
from __future__ import annotations

import math

import torch

from verl.core_algos.common import group_index


def varied_groups(metric_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    """bool_B: whether the trajectory's group has at least two different metric values, i.e. gives
    a group estimator a signal (DAPO's dynamic sampling keeps those groups). A group of one is kept,
    as verl keeps it. verl compares the group's std with 0; max > min is the same test without the
    rounding of a std of equal floats."""
    index_B, G = group_index(group_ids_B)
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
