"""The value model (Critic) for PPO with GAE, one instance per worker process.

Same shape as `verl.workers.actor.Actor`: an FSDP2 shard of a `ValueModel` (decoder backbone plus a
zero-initialised linear value head, see `verl.workers.modeling`) trained by the update loop the
actor shares (`verl.workers.update.TrainedModel`), so the update is independent of the
micro-batch and rank split in the same way.

values_BR[:, j] is the value of the state just before response token j is written: the head reads
the hidden state of the token before it, the same position whose logits predict token j.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.batch import RolloutBatch
from verl.config.schema import ActorConfig, CriticConfig
from verl.core_algos import value_loss
from verl.workers.distributed import compute_device, mixed_precision_context, shard
from verl.workers.lora import add_adapters
from verl.workers.memory import synthetic_batch
from verl.workers.modeling import build_value_model, pick_attn_implementation
from verl.workers.packing import tokens_per_pack, values_packed
from verl.workers.update import TokenBudgets, TrainedModel, micro_batches, plan_before_first_pass


class Critic(TrainedModel):
    """FSDP2-sharded value model trained with the clipped value loss.

    As in the original trainer, the critic takes its epochs, gradient clip, loss aggregation and
    state masking from the actor's keys (`shared`); `cfg.model.path` must be set (the trainer fills
    it with the policy's path when the critic's is null)."""

    role = "critic"

    def __init__(self, cfg: CriticConfig, shared: ActorConfig, *, micro_batch_size: int,
                 total_steps: int | None = None, seed: int = 0):
        device = compute_device()
        fsdp = cfg.model.fsdp_config
        self.mixed_precision = fsdp.mixed_precision and device.type == "cuda"
        ratio = cfg.model.gradient_checkpointing_ratio
        checkpointed = (1.0 if ratio is None else ratio) if cfg.model.enable_gradient_checkpointing else 0.0
        dynamic = shared.use_dynamic_bsz if cfg.use_dynamic_bsz is None else cfg.use_dynamic_bsz
        budgets = TokenBudgets.from_config(
            (dynamic, cfg.ppo_max_token_len_per_gpu), (dynamic, cfg.forward_max_token_len_per_gpu),
            cfg.model.enable_gradient_checkpointing and ratio is None, device,
            {"update": "critic.ppo_max_token_len_per_gpu", "forward": "critic.forward_max_token_len_per_gpu",
             "ratio": "critic.model.gradient_checkpointing_ratio"})
        model = build_value_model(cfg.model.path, torch.float32, checkpointed,
                                  attn_implementation=pick_attn_implementation(self.mixed_precision))
        if cfg.model.lora_rank:   # on the backbone; the value head trains in full
            add_adapters(model.model, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.target_modules, seed,
                         "critic.model")
        if dist.is_initialized():
            shard(model, cpu_offload=fsdp.param_offload, mixed_precision=self.mixed_precision)
        else:
            model.to(device)
        super().__init__(model, cfg.optim, fsdp, total_steps=total_steps, grad_clip=shared.grad_clip,
                         micro_batch_size=micro_batch_size, ppo_epochs=shared.ppo_epochs,
                         loss_agg=shared.loss_agg_mode, state_masking=shared.state_masking, seed=seed,
                         budgets=budgets)
        self.cfg = cfg
        self.max_tokens_per_pack = tokens_per_pack(shared.max_tokens_per_pack, device)

    def _values(self, micro: RolloutBatch) -> torch.Tensor:
        with mixed_precision_context(dist.is_initialized(), self.mixed_precision):
            return values_packed(self.model, micro.input_ids_BT, micro.attention_mask_BT, micro.prompt_width,
                                 self.max_tokens_per_pack)

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """values_BR (fp32, CPU, 0 on padding)."""
        plan_before_first_pass(self, batch)
        return self._values_in_micro_batches(batch, self.budgets.forward)

    @torch.no_grad()
    def _values_in_micro_batches(self, batch: RolloutBatch, max_tokens: int | None) -> torch.Tensor:
        self.model.eval()
        values_BR = torch.zeros(len(batch), batch.input_ids_BT.shape[1] - batch.prompt_width)
        for rows in micro_batches(batch, max_tokens, self.micro_batch_size):
            values_BR[rows] = self._values(batch.select(rows).to(self.device)).cpu()
        return values_BR

    def _probe_update(self, tokens: int) -> None:
        micro = synthetic_batch(tokens, self.model.config.get_text_config().vocab_size).to(self.device)
        self.model.train()
        self._values(micro).mean().backward()
        self.optimizer.zero_grad(set_to_none=False)   # kept between probes (memory.measure)

    def _probe_forward(self, tokens: int) -> None:
        batch = synthetic_batch(tokens, self.model.config.get_text_config().vocab_size)
        with torch.no_grad():
            self.model.eval()
            self._values(batch.to(self.device))

    def update(self, batch: RolloutBatch, mini_batch_size: int, shuffle: bool = True,
               loss_norm_length: float | None = None) -> dict[str, float]:
        """One training step of the clipped value loss on this process's trajectories. Needs
        batch.values_BR (rollout-time values) and batch.returns_BR. Returns vf_loss, vf_clipfrac,
        vpred_mean (averaged over micro-batches), grad_norm (over optimizer steps) and lr."""
        if batch.values_BR is None or batch.returns_BR is None:
            raise ValueError("critic update needs batch.values_BR (from compute_values) and batch.returns_BR")

        def micro_loss(micro: RolloutBatch, mask_BR: torch.Tensor):
            values_BR = self._values(micro)
            loss, stats = value_loss(values_BR, micro.values_BR, micro.returns_BR, mask_BR,
                                     self.cfg.cliprange_value, self.loss_agg, loss_norm_length)
            vpred_mean = float((values_BR.detach() * mask_BR).sum() / mask_BR.sum().clamp(min=1))
            return loss, {"vf_loss": loss.item(), "vf_clipfrac": stats["vf_clipfrac"], "vpred_mean": vpred_mean}

        return self.run_update(batch, mini_batch_size, micro_loss, shuffle)
