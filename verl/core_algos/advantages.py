"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (with and without a group
baseline), and `compute_advantages`, which picks one by name.

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
"""
from __future__ import annotations

from enum import StrEnum

import torch

from verl.core_algos.common import as_enum, group_mean_and_count, group_sum, masked_whiten


class AdvEstimator(StrEnum):
    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce_plus_plus"
    REINFORCE_PP_BASELINE = "reinforce_plus_plus_baseline"


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


def grpo_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor, mask_BR: torch.Tensor,
                    normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage (r - group mean) / (group std + eps), broadcast over model tokens.

    `normalize_std=False` is Dr.GRPO: dividing by the std up-weights prompts whose rewards barely
    differ (too easy or too hard), a bias Dr.GRPO removes.
    """
    rewards_B = rewards_B.float()
    mean_B, count_B, index_B, G = group_mean_and_count(rewards_B, group_ids_B)
    adv_B = rewards_B - mean_B
    if normalize_std:
        sq_G = group_sum(adv_B ** 2, index_B, G)
        std_B = (sq_G[index_B] / (count_B - 1).clamp(min=1)).sqrt()
        adv_B = adv_B / (std_B + eps)
    adv_B = torch.where(count_B > 1, adv_B, 0.0)
    return adv_B[:, None] * mask_BR


def rloo_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor,
                    mask_BR: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: r_i minus the mean reward of the other members of its group."""
    rewards_B = rewards_B.float()
    mean_B, count_B, _, _ = group_mean_and_count(rewards_B, group_ids_B)
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
    mean_B, _, _, _ = group_mean_and_count(rewards_B, group_ids_B)
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
    estimator = as_enum(AdvEstimator, estimator, "advantage estimator")
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
