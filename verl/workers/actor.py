"""The policy (Actor) and the frozen reference policy (Reference), one instance per worker process.

Each process holds an FSDP2 shard of the model (or the whole model when no process group exists:
single-process runs and tests) and works on its own part of the step's trajectories. The update
loop, batch sizes and loss scaling are the ones the critic shares: `verl.workers.update.TrainedModel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.batch import RolloutBatch
from verl.trainer.config import ActorConfig, ModelConfig
from verl.trainer.core_algos import agg_loss, kl_penalty, policy_loss, truncated_importance_weights
from verl.workers.distributed import compute_device, mixed_precision_context, shard
from verl.workers.modeling import build_causal_lm, compile_layers, pick_attn_implementation
from verl.workers.packing import forward_packed, tokens_per_pack
from verl.workers.update import TrainedModel


def checkpointed_share(model: ModelConfig) -> float:
    """Share of the decoder layers recomputed in backward (0: none)."""
    return model.gradient_checkpointing_ratio if model.enable_gradient_checkpointing else 0.0


def _load_policy_model(model: ModelConfig, gradient_checkpointing: float, param_offload: bool,
                       mixed_precision: bool, device: torch.device):
    # attn_implementation None picks the fastest available (modeling.pick_attn_implementation)
    lm = build_causal_lm(model.path, torch.float32, gradient_checkpointing,
                         attn_implementation=model.attn_implementation or pick_attn_implementation(mixed_precision))
    if dist.is_initialized():
        shard(lm, cpu_offload=param_offload, mixed_precision=mixed_precision)
    else:
        lm.to(device)
    if model.use_torch_compile:
        compile_layers(lm)
    return lm


@torch.no_grad()
def _logprobs_in_micro_batches(model, batch: RolloutBatch, micro_batch_size: int, temperature: float,
                               max_tokens_per_pack: int, compute_entropy: bool, mixed_precision: bool):
    model.eval()
    device = compute_device()
    logprobs, entropies = [], []
    # Same number of micro-batches on every rank (ranks hold equal numbers of trajectories).
    for start in range(0, len(batch), micro_batch_size):
        micro = batch.select(slice(start, start + micro_batch_size)).to(device)
        with mixed_precision_context(dist.is_initialized(), mixed_precision):
            logprobs_BR, entropy_BR = forward_packed(
                model, micro.input_ids_BT, micro.attention_mask_BT, micro.prompt_width, temperature,
                compute_entropy=compute_entropy, max_tokens_per_pack=max_tokens_per_pack)
        logprobs.append(logprobs_BR.cpu())
        if compute_entropy:
            entropies.append(entropy_BR.cpu())
    return torch.cat(logprobs), torch.cat(entropies) if compute_entropy else None


class Actor(TrainedModel):
    """FSDP2-sharded causal LM trained with the PPO clipped loss (plus entropy bonus and KL loss).

    `micro_batch_size`: trajectories per forward/backward on this process; `temperature`: the
    rollout's, which the log-probs divide the logits by; `total_steps`: training steps the learning-
    rate schedule spans (None: constant schedules only)."""

    role = "actor"

    def __init__(self, model: ModelConfig, cfg: ActorConfig, *, micro_batch_size: int,
                 total_steps: int | None = None, temperature: float = 1.0, seed: int = 0):
        device = compute_device()
        self.mixed_precision = cfg.fsdp_config.mixed_precision and device.type == "cuda"
        lm = _load_policy_model(model, checkpointed_share(model), cfg.fsdp_config.param_offload,
                                self.mixed_precision, device)
        super().__init__(lm, cfg.optim, cfg.fsdp_config, total_steps=total_steps, grad_clip=cfg.grad_clip,
                         micro_batch_size=micro_batch_size, ppo_epochs=cfg.ppo_epochs, loss_agg=cfg.loss_agg_mode,
                         state_masking=cfg.state_masking, seed=seed)
        self.cfg = cfg
        self.temperature = temperature
        self.max_tokens_per_pack = tokens_per_pack(cfg.max_tokens_per_pack, device)

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """logprobs_BR of the response tokens under the current weights (fp32, CPU, 0 on padding)."""
        return _logprobs_in_micro_batches(self.model, batch, self.micro_batch_size, self.temperature,
                                          self.max_tokens_per_pack, False, self.mixed_precision)[0]

    def compute_logprobs_and_entropy(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return _logprobs_in_micro_batches(self.model, batch, self.micro_batch_size, self.temperature,
                                          self.max_tokens_per_pack, True, self.mixed_precision)

    def update(self, batch: RolloutBatch, mini_batch_size: int, shuffle: bool = True,
               loss_norm_length: float | None = None) -> dict[str, float]:
        """One training step of PPO on this process's trajectories. Needs batch.advantages_BR,
        ref_logprobs_BR with `use_kl_loss`, and old_logprobs_BR unless `ppo_epochs` is 1 (then the
        update finds them itself: see `_own_old_logprobs`). Returns metrics averaged over
        micro-batches (pg_loss, entropy, clipfrac, approx_kl, kl_loss) and optimizer steps (grad_norm).
        `loss_norm_length`: the constant of the seq-mean-token-sum-norm aggregation (Dr.GRPO)."""
        cfg = self.cfg
        if batch.advantages_BR is None:
            raise ValueError("actor update needs batch.advantages_BR")
        own_old = batch.old_logprobs_BR is None   # the trainer's old_log_probs=auto
        if own_old and self.ppo_epochs != 1:
            raise ValueError(f"actor update needs batch.old_logprobs_BR with ppo_epochs={self.ppo_epochs}: a second "
                             "epoch trains on samples the first one has moved away from")
        if cfg.use_kl_loss and batch.ref_logprobs_BR is None:
            raise ValueError("use_kl_loss needs batch.ref_logprobs_BR (enable the reference model)")

        def micro_loss(micro: RolloutBatch, mask_BR: torch.Tensor):
            with mixed_precision_context(dist.is_initialized(), self.mixed_precision):
                logprobs_BR, entropy_BR = forward_packed(
                    self.model, micro.input_ids_BT, micro.attention_mask_BT, micro.prompt_width, self.temperature,
                    compute_entropy=True, max_tokens_per_pack=self.max_tokens_per_pack,
                    entropy_grad=cfg.entropy_coeff != 0)
            old_BR = logprobs_BR.detach() if micro.old_logprobs_BR is None else micro.old_logprobs_BR
            weights_BR, is_stats = None, {}
            if micro.rollout_logprobs_BR is not None:  # sampled by older weights (trainer.overlap_rollout)
                weights_BR, is_stats = truncated_importance_weights(old_BR, micro.rollout_logprobs_BR,
                                                                    micro.loss_mask_BR, cfg.rollout_is_cap)
            pg_loss, pg_stats = policy_loss(logprobs_BR, old_BR, micro.advantages_BR, mask_BR,
                                            cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c,
                                            agg=self.loss_agg, norm_length=loss_norm_length, weights_BR=weights_BR)
            entropy = agg_loss(entropy_BR, mask_BR, self.loss_agg, loss_norm_length)
            loss = pg_loss - cfg.entropy_coeff * entropy if cfg.entropy_coeff else pg_loss
            stats = {"pg_loss": pg_loss.item(), "entropy": entropy.item(), "clipfrac": pg_stats["clipfrac"],
                     "approx_kl": pg_stats["approx_kl"], **{f"rollout_is_{k}": v for k, v in is_stats.items()}}
            if cfg.use_kl_loss:
                kl = agg_loss(kl_penalty(logprobs_BR, micro.ref_logprobs_BR, cfg.kl_loss_type), mask_BR,
                              self.loss_agg, loss_norm_length)
                loss = loss + cfg.kl_loss_coef * kl
                stats["kl_loss"] = kl.item()
            return loss, stats

        return self.run_update(batch, mini_batch_size, micro_loss, shuffle,
                               before_first_step=self._own_old_logprobs if own_old else None)

    def _own_old_logprobs(self, minis: list[RolloutBatch]) -> None:
        """The log-probs the ratio starts from, without the trainer's separate pass. The first
        mini-batch trains on the rollout's weights, so its own forward gives them (the ratio starts
        at 1). The later ones train after one or more optimizer steps: their log-probs under the
        rollout's weights are computed here, before the first step. That is the separate pass less
        one mini-batch, with no round trip through the driver."""
        for mini in minis[1:]:
            mini.old_logprobs_BR = self.compute_logprobs(mini)


class Reference:
    """The frozen initial policy: log-probs only, no optimizer. `param_offload` keeps its shards on
    the CPU between calls (it runs once per step)."""

    def __init__(self, model: ModelConfig, *, param_offload: bool = False, mixed_precision: bool = True,
                 micro_batch_size: int = 4, max_tokens_per_pack: int = 16384, temperature: float = 1.0):
        device = compute_device()
        self.mixed_precision = mixed_precision and device.type == "cuda"
        self.model = _load_policy_model(model, 0.0, param_offload, self.mixed_precision, device)
        self.model.requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_pack = tokens_per_pack(max_tokens_per_pack, device)
        self.temperature = temperature

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """ref_logprobs_BR (fp32, CPU, 0 on padding)."""
        return _logprobs_in_micro_batches(self.model, batch, self.micro_batch_size, self.temperature,
                                          self.max_tokens_per_pack, False, self.mixed_precision)[0]
