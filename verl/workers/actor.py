"""The policy (Actor) and the frozen reference policy (Reference), one instance per worker process.

Each process holds an FSDP2 shard of the model (or the whole model when no process group exists:
single-process runs and tests) and works on its own part of the step's trajectories. Weights,
optimizer and scheduler are public attributes (`model`, `optimizer`, `scheduler`): checkpointing
(torch.distributed.checkpoint) and the weight push to the rollout engine (`full_state_dict_iter`)
work on them directly.

Batch sizes are in trajectories and per process: `mini_batch_size` trajectories per optimizer step,
`micro_batch_size` per forward/backward. One `update` call is one training step: `ppo_epochs` passes
over the process's trajectories, each a sequence of optimizer steps on shuffled mini-batches; the
learning-rate scheduler steps once per `update` (so warm-up and decay are counted in training steps,
whatever the number of mini-batches and epochs).

Loss scaling (gradient accumulation and data parallelism). Each mini-batch must get the gradient
of ONE loss: the chosen aggregation (`core_algos.agg_loss`) over all its trajectories on all ranks.
Every aggregation is a mean over "units": tokens for token-mean, sequences that have at least one
unmasked token for the seq-mean modes. A micro-batch's aggregated loss is the mean over its own
units, so we scale it by

    weight = units(micro-batch) / units(mini-batch, summed over ranks) × world_size

(the × world_size undoes FSDP's averaging of gradients over ranks). Summed over micro-batches and
averaged over ranks this gives exactly Σ unit losses / Σ units, so the update does not depend on
how trajectories are split into micro-batches or ranks — in particular, ranks with different token
counts are weighted by tokens for token-mean (a plain mean of per-rank means would not be). The cost
is one scalar all-reduce per mini-batch.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from verl.protocol import RolloutBatch
from verl.trainer.core_algos import LossAgg, agg_loss, kl_penalty, policy_loss
from verl.workers.fsdp import (accumulation_steps, all_reduce_scalar, build_causal_lm, build_lr_scheduler,
                               build_optimizer, check_batch_sizes, clip_grad_norm_, compile_layers, compute_device,
                               forward_packed, loss_units, mixed_precision_context, move_optimizer_state,
                               pick_attn_implementation, shard, shuffled_mini_batches, world_size)

logger = logging.getLogger(__name__)


def _load_policy_model(model_path, gradient_checkpointing, param_offload, mixed_precision, device,
                       attn_implementation=None, use_torch_compile=False):
    model = build_causal_lm(model_path, torch.float32, gradient_checkpointing,
                            attn_implementation=attn_implementation or pick_attn_implementation(mixed_precision))
    if dist.is_initialized():
        shard(model, cpu_offload=param_offload, mixed_precision=mixed_precision)
    else:
        model.to(device)
    if use_torch_compile:
        compile_layers(model)
    return model


@torch.no_grad()
def _logprobs_in_micro_batches(model, batch: RolloutBatch, micro_batch_size: int, temperature: float,
                               max_tokens_per_pack: int, compute_entropy: bool, sharded: bool, mixed_precision: bool):
    model.eval()
    device = compute_device()
    logprobs, entropies = [], []
    # Same number of micro-batches on every rank (ranks hold equal numbers of trajectories).
    for start in range(0, len(batch), micro_batch_size):
        micro = batch.select(slice(start, start + micro_batch_size)).to(device)
        with mixed_precision_context(sharded, mixed_precision):
            logprobs_BR, entropy_BR = forward_packed(
                model, micro.input_ids_BT, micro.attention_mask_BT, micro.prompt_width, temperature,
                compute_entropy=compute_entropy, max_tokens_per_pack=max_tokens_per_pack)
        logprobs.append(logprobs_BR.cpu())
        if compute_entropy:
            entropies.append(entropy_BR.cpu())
    return torch.cat(logprobs), torch.cat(entropies) if compute_entropy else None


class Actor:
    """FSDP2-sharded causal LM with AdamW and a learning-rate schedule."""

    def __init__(self, model_path: str, *, lr: float = 1e-6, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.999), warmup_steps: int = 0, total_steps: int | None = None,
                 lr_schedule: str = "constant", min_lr_ratio: float = 0.0, grad_clip: float | None = 1.0,
                 gradient_checkpointing: float = 1.0, param_offload: bool = False, optimizer_offload: bool = False,
                 mixed_precision: bool = True, unsharded_accumulation: bool = False,
                 micro_batch_size: int = 4, max_tokens_per_pack: int = 16384,
                 temperature: float = 1.0, seed: int = 0, attn_implementation: str | None = None,
                 use_torch_compile: bool = False):
        self.device = compute_device()
        self.sharded = dist.is_initialized()
        # attn_implementation: None picks the fastest available (see fsdp.pick_attn_implementation)
        # gradient_checkpointing: fraction of decoder layers recomputed in backward (True = 1.0, False = 0.0)
        self.model = _load_policy_model(model_path, gradient_checkpointing, param_offload, mixed_precision, self.device,
                                        attn_implementation, use_torch_compile)
        self.optimizer = build_optimizer(self.model, lr, weight_decay, betas)
        self.scheduler = build_lr_scheduler(self.optimizer, warmup_steps, total_steps, lr_schedule, min_lr_ratio)
        self.grad_clip = grad_clip
        # Offloading the optimizer state only helps while the parameters are on the GPU.
        self.optimizer_offload = optimizer_offload and torch.cuda.is_available() and not param_offload
        # keep full weights and gradients across a mini-batch's micro-batches (fsdp.accumulation_steps)
        self.unsharded_accumulation = unsharded_accumulation
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_pack = max_tokens_per_pack
        self.temperature = temperature
        self.seed = seed
        self.mixed_precision = mixed_precision

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """logprobs_BR of the response tokens under the current weights (fp32, CPU, 0 on padding)."""
        return _logprobs_in_micro_batches(self.model, batch, self.micro_batch_size, self.temperature,
                                          self.max_tokens_per_pack, False, self.sharded, self.mixed_precision)[0]

    def compute_logprobs_and_entropy(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return _logprobs_in_micro_batches(self.model, batch, self.micro_batch_size, self.temperature,
                                          self.max_tokens_per_pack, True, self.sharded, self.mixed_precision)

    def update(self, batch: RolloutBatch, *, ppo_epochs: int = 1, mini_batch_size: int, clip_low: float = 0.2,
               clip_high: float = 0.2, dual_clip_c: float | None = None, loss_agg: str = "token-mean",
               entropy_coef: float = 0.0, use_kl_loss: bool = False, kl_loss_coef: float = 0.001,
               kl_loss_type: str = "low_var_kl", state_masking: bool = True, shuffle: bool = True,
               loss_norm_length: float | None = None) -> dict[str, float]:
        """One training step of PPO on this process's trajectories (see the module docstring for
        batch sizes and loss scaling). Needs batch.old_logprobs_BR and advantages_BR, and
        ref_logprobs_BR with `use_kl_loss`. `state_masking=False` trains on retrieved tokens too
        (the ablation of Search-R1's paper). Returns metrics averaged over micro-batches (losses,
        clipfrac, approx_kl, entropy) and optimizer steps (grad_norm)."""
        check_batch_sizes(len(batch), mini_batch_size, self.micro_batch_size, "actor")
        if batch.old_logprobs_BR is None or batch.advantages_BR is None:
            raise ValueError("actor update needs batch.old_logprobs_BR and batch.advantages_BR")
        if use_kl_loss and batch.ref_logprobs_BR is None:
            raise ValueError("use_kl_loss needs batch.ref_logprobs_BR (enable the reference model)")
        LossAgg(loss_agg)  # fail before any forward on an unknown name

        if self.optimizer_offload:
            move_optimizer_state(self.optimizer, self.device)
        self.model.train()
        sums: dict[str, float] = {}
        n_micro, grad_norms = 0, []
        step = self.scheduler.last_epoch
        lr = self.scheduler.get_last_lr()[0]
        for epoch in range(ppo_epochs):
            for mini in shuffled_mini_batches(batch, mini_batch_size, self.seed + 100_003 * step + epoch, shuffle):
                mask_BR = mini.loss_mask_BR if state_masking else mini.response_mask_BR
                total_units = all_reduce_scalar(loss_units(mask_BR, loss_agg))
                self.optimizer.zero_grad(set_to_none=True)
                micros = mini.split(mini_batch_size // self.micro_batch_size)
                for micro in accumulation_steps(self.model, micros, self.unsharded_accumulation):
                    micro = micro.to(self.device)
                    micro_mask_BR = micro.loss_mask_BR if state_masking else micro.response_mask_BR
                    weight = (loss_units(micro_mask_BR, loss_agg) / total_units * world_size()
                              if total_units > 0 else 0.0)
                    loss, stats = self._micro_loss(micro, micro_mask_BR, clip_low, clip_high, dual_clip_c, loss_agg,
                                                   entropy_coef, use_kl_loss, kl_loss_coef, kl_loss_type,
                                                   loss_norm_length)
                    (loss * weight).backward()
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                    n_micro += 1
                grad_norms.append(self._optimizer_step())
        self.scheduler.step()
        if self.optimizer_offload:
            move_optimizer_state(self.optimizer, torch.device("cpu"))
        metrics = {k: v / max(1, n_micro) for k, v in sums.items()}
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["lr"] = lr
        return metrics

    def _micro_loss(self, micro, mask_BR, clip_low, clip_high, dual_clip_c, loss_agg, entropy_coef,
                    use_kl_loss, kl_loss_coef, kl_loss_type, norm_length):
        with mixed_precision_context(self.sharded, self.mixed_precision):
            logprobs_BR, entropy_BR = forward_packed(
                self.model, micro.input_ids_BT, micro.attention_mask_BT, micro.prompt_width, self.temperature,
                compute_entropy=True, max_tokens_per_pack=self.max_tokens_per_pack,
                entropy_grad=entropy_coef != 0)
        pg_loss, pg_stats = policy_loss(logprobs_BR, micro.old_logprobs_BR, micro.advantages_BR, mask_BR,
                                        clip_low, clip_high, dual_clip_c, agg=loss_agg, norm_length=norm_length)
        entropy = agg_loss(entropy_BR, mask_BR, loss_agg, norm_length)
        loss = pg_loss - entropy_coef * entropy if entropy_coef else pg_loss
        stats = {"pg_loss": pg_loss.item(), "entropy": entropy.item(), "clipfrac": pg_stats["clipfrac"],
                 "approx_kl": pg_stats["approx_kl"]}
        if use_kl_loss:
            kl = agg_loss(kl_penalty(logprobs_BR, micro.ref_logprobs_BR, kl_loss_type), mask_BR, loss_agg, norm_length)
            loss = loss + kl_loss_coef * kl
            stats["kl_loss"] = kl.item()
        return loss, stats

    def _optimizer_step(self) -> float:
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.grad_clip)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # one bad batch must not destroy the weights; every rank sees the same global norm
            logger.warning("actor: gradient norm is %s, skipping this optimizer step", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm


class Reference:
    """The frozen initial policy: log-probs only, no optimizer. `param_offload` keeps its shards on
    the CPU between calls (it runs once per step)."""

    def __init__(self, model_path: str, *, param_offload: bool = False, mixed_precision: bool = True,
                 micro_batch_size: int = 4, max_tokens_per_pack: int = 16384, temperature: float = 1.0,
                 attn_implementation: str | None = None, use_torch_compile: bool = False):
        self.device = compute_device()
        self.sharded = dist.is_initialized()
        self.model = _load_policy_model(model_path, False, param_offload, mixed_precision, self.device,
                                        attn_implementation, use_torch_compile)
        self.model.requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_pack = max_tokens_per_pack
        self.temperature = temperature
        self.mixed_precision = mixed_precision

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """ref_logprobs_BR (fp32, CPU, 0 on padding)."""
        return _logprobs_in_micro_batches(self.model, batch, self.micro_batch_size, self.temperature,
                                          self.max_tokens_per_pack, False, self.sharded, self.mixed_precision)[0]
