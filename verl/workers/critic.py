"""The value model (Critic) for PPO with GAE, one instance per worker process.

Same shape as `verl.workers.actor.Actor`: an FSDP2 shard of a `ValueModel` (decoder backbone plus a
zero-initialised linear value head, see `verl.workers.fsdp`), AdamW, a learning-rate scheduler that
steps once per `update` call, mini-batches and micro-batches in trajectories per process, and the
same loss scaling rule (see the Actor's module docstring), so the update is independent of the
micro-batch and rank split.

values_BR[:, j] is the value of the state just before response token j is written: the head reads
the hidden state of the token before it, the same position whose logits predict token j.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from verl.protocol import RolloutBatch
from verl.trainer.core_algos import LossAgg, value_loss
from verl.workers.fsdp import (accumulation_steps, all_reduce_scalar, build_lr_scheduler, build_optimizer,
                               build_value_model, check_batch_sizes, clip_grad_norm_, compute_device, loss_units,
                               mixed_precision_context, move_optimizer_state, pick_attn_implementation, shard,
                               shuffled_mini_batches, values_packed, world_size)

logger = logging.getLogger(__name__)


class Critic:
    """FSDP2-sharded value model with AdamW and a learning-rate schedule."""

    def __init__(self, model_path: str, *, lr: float = 1e-5, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.999), warmup_steps: int = 0, total_steps: int | None = None,
                 lr_schedule: str = "constant", min_lr_ratio: float = 0.0, grad_clip: float | None = 1.0,
                 gradient_checkpointing: float = 1.0, param_offload: bool = False, optimizer_offload: bool = False,
                 mixed_precision: bool = True, unsharded_accumulation: bool = False,
                 micro_batch_size: int = 4, max_tokens_per_pack: int = 16384,
                 seed: int = 0):
        self.device = compute_device()
        self.sharded = dist.is_initialized()
        # gradient_checkpointing: fraction of decoder layers recomputed in backward (True = 1.0, False = 0.0)
        model = build_value_model(model_path, torch.float32, gradient_checkpointing,
                                  attn_implementation=pick_attn_implementation(mixed_precision))
        if self.sharded:
            shard(model, cpu_offload=param_offload, mixed_precision=mixed_precision)
        else:
            model.to(self.device)
        self.model = model
        self.optimizer = build_optimizer(self.model, lr, weight_decay, betas)
        self.scheduler = build_lr_scheduler(self.optimizer, warmup_steps, total_steps, lr_schedule, min_lr_ratio)
        self.grad_clip = grad_clip
        self.optimizer_offload = optimizer_offload and torch.cuda.is_available() and not param_offload
        # keep full weights and gradients across a mini-batch's micro-batches (fsdp.accumulation_steps)
        self.unsharded_accumulation = unsharded_accumulation
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_pack = max_tokens_per_pack
        self.seed = seed
        self.mixed_precision = mixed_precision

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """values_BR (fp32, CPU, 0 on padding)."""
        self.model.eval()
        values = []
        for start in range(0, len(batch), self.micro_batch_size):
            micro = batch.select(slice(start, start + self.micro_batch_size)).to(self.device)
            with mixed_precision_context(self.sharded, self.mixed_precision):
                values.append(values_packed(self.model, micro.input_ids_BT, micro.attention_mask_BT,
                                            micro.prompt_width, self.max_tokens_per_pack).cpu())
        return torch.cat(values)

    def update(self, batch: RolloutBatch, *, ppo_epochs: int = 1, mini_batch_size: int,
               clip_range_value: float = 0.5, loss_agg: str = "token-mean", state_masking: bool = True,
               shuffle: bool = True, loss_norm_length: float | None = None) -> dict[str, float]:
        """One training step of the clipped value loss on this process's trajectories. Needs
        batch.values_BR (rollout-time values) and batch.returns_BR. Returns vf_loss, vf_clipfrac,
        vpred_mean (averaged over micro-batches), grad_norm (over optimizer steps) and lr."""
        check_batch_sizes(len(batch), mini_batch_size, self.micro_batch_size, "critic")
        if batch.values_BR is None or batch.returns_BR is None:
            raise ValueError("critic update needs batch.values_BR (from compute_values) and batch.returns_BR")
        LossAgg(loss_agg)

        if self.optimizer_offload:
            move_optimizer_state(self.optimizer, self.device)
        self.model.train()
        sums = {"vf_loss": 0.0, "vf_clipfrac": 0.0, "vpred_mean": 0.0}
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
                    with mixed_precision_context(self.sharded, self.mixed_precision):
                        values_BR = values_packed(self.model, micro.input_ids_BT, micro.attention_mask_BT,
                                                  micro.prompt_width, self.max_tokens_per_pack)
                    loss, stats = value_loss(values_BR, micro.values_BR, micro.returns_BR, micro_mask_BR,
                                             clip_range_value, loss_agg, loss_norm_length)
                    (loss * weight).backward()
                    sums["vf_loss"] += loss.item()
                    sums["vf_clipfrac"] += stats["vf_clipfrac"]
                    sums["vpred_mean"] += float((values_BR.detach() * micro_mask_BR).sum() / micro_mask_BR.sum().clamp(min=1))
                    n_micro += 1
                grad_norms.append(self._optimizer_step())
        self.scheduler.step()
        if self.optimizer_offload:
            move_optimizer_state(self.optimizer, torch.device("cpu"))
        metrics = {k: v / max(1, n_micro) for k, v in sums.items()}
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["lr"] = lr
        return metrics

    def _optimizer_step(self) -> float:
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.grad_clip)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("critic: gradient norm is %s, skipping this optimizer step", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm
