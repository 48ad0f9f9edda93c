"""Advantage estimators, KL penalties and losses: pure functions of tensors.

Shape letters: B = trajectories, R = response tokens, V = vocabulary. Every `mask_BR` here is the
loss mask: 1.0 on tokens the model wrote, 0.0 on retrieved observations and on padding (Search-R1's
"state masking"). Nothing in this package reads a config object; the trainer passes plain values.

One module per job, each read on its own (a module's docstring says where it deviates from the
papers or from common implementations, on purpose):
- `advantages.py`: the advantage estimators (GAE, GRPO, RLOO, REINFORCE++) and `compute_advantages`;
- `kl.py`: KL penalties, KL-in-reward, and the KL coefficient's controllers;
- `losses.py`: the policy, value and entropy losses, their aggregation, truncated importance weights;
- `logprobs.py`: log-probs and entropy from logits, in chunks;
- `dapo.py`: DAPO's dynamic-sampling filter and overlong penalty;
- `common.py`: what they share: masked and per-group statistics, the log-ratio bound, variant names.
"""
from verl.core_algos.advantages import (AdvEstimator, compute_advantages, gae_advantages, grpo_advantages,
                                        reinforce_pp_advantages, reinforce_pp_baseline_advantages, rloo_advantages,
                                        token_level_rewards)
from verl.core_algos.common import masked_mean, masked_var, masked_whiten
from verl.core_algos.dapo import overlong_penalty, varied_groups
from verl.core_algos.kl import AdaptiveKLController, FixedKLController, KLPenalty, apply_kl_penalty, kl_penalty
from verl.core_algos.logprobs import logprobs_and_entropy
from verl.core_algos.losses import (LossAgg, agg_loss, entropy_loss, policy_loss, truncated_importance_weights,
                                    value_loss)

__all__ = ["AdaptiveKLController", "AdvEstimator", "FixedKLController", "KLPenalty", "LossAgg", "agg_loss",
           "apply_kl_penalty", "compute_advantages", "entropy_loss", "gae_advantages", "grpo_advantages",
           "kl_penalty", "logprobs_and_entropy", "masked_mean", "masked_var", "masked_whiten", "overlong_penalty",
           "policy_loss", "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "rloo_advantages",
           "token_level_rewards", "truncated_importance_weights", "value_loss", "varied_groups"]
