"""The policy (Actor) and the frozen reference policy (Reference), one instance per worker process.

Each process holds an FSDP2 shard of the model (or the whole model when no process group exists:
single-process runs and tests) and works on its own part of the step's trajectories. The update
loop, batch sizes and loss scaling are the ones the critic shares: `verl.workers.update.TrainedModel`.
With LoRA adapters (actor_rollout_ref.model.lora_rank, verl.workers.lora) only they train, and the
reference log-probs come from the actor with its adapters switched off (`compute_base_logprobs`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.batch import RolloutBatch
from verl.config.schema import ActorConfig, ModelConfig
from verl.core_algos import agg_loss, kl_penalty, policy_loss, truncated_importance_weights
from verl.workers.distributed import compute_device, mixed_precision_context, shard
from verl.workers.lora import adapters_disabled, add_adapters
from verl.workers.memory import synthetic_batch
from verl.workers.modeling import build_causal_lm, compile_layers, pick_attn_implementation
from verl.workers.packing import forward_packed, tokens_per_pack
from verl.workers.update import TokenBudgets, TrainedModel, micro_batches, plan_before_first_pass


def checkpointed_share(model: ModelConfig) -> float:
    """Share of the decoder layers recomputed in backward as built (0: none). A null ratio builds
    with every layer checkpointed; the memory plan then switches off as many as fit
    (verl.workers.memory)."""
    if not model.enable_gradient_checkpointing:
        return 0.0
    return 1.0 if model.gradient_checkpointing_ratio is None else model.gradient_checkpointing_ratio


def compiled(model: ModelConfig, device: torch.device) -> bool:
    return model.use_torch_compile if model.use_torch_compile is not None else device.type == "cuda"


def _load_policy_model(model: ModelConfig, gradient_checkpointing: float, param_offload: bool,
                       mixed_precision: bool, device: torch.device, adapters_seed: int | None = None):
    """`adapters_seed`: with model.lora_rank, the LoRA adapters are added (drawn from it) before sharding."""
    # attn_implementation None picks the fastest available (modeling.pick_attn_implementation)
    lm = build_causal_lm(model.path, torch.float32, gradient_checkpointing,
                         attn_implementation=model.attn_implementation or pick_attn_implementation(mixed_precision))
    if model.lora_rank and adapters_seed is not None:   # peft first, then FSDP2 shards what it built
        add_adapters(lm, model.lora_rank, model.lora_alpha, model.target_modules, adapters_seed,
                     "actor_rollout_ref.model")
    if dist.is_initialized():
        shard(lm, cpu_offload=param_offload, mixed_precision=mixed_precision)
    else:
        lm.to(device)
    if compiled(model, device):
        compile_layers(lm)
    return lm


@torch.no_grad()
def _logprobs_in_micro_batches(model, batch: RolloutBatch, micro_batch_size: int, max_tokens: int | None,
                               temperature: float, max_tokens_per_pack: int, compute_entropy: bool,
                               mixed_precision: bool, state_masking: bool):
    """Log-probs (and entropies) of the batch's response tokens, by micro-batches of `max_tokens`
    tokens (or `micro_batch_size` trajectories when None); rows come back in the batch's order.
    `state_masking`: only the model's own tokens are scored (0 on observations), as the loss reads them."""
    model.eval()
    device = compute_device()
    B, R = len(batch), batch.input_ids_BT.shape[1] - batch.prompt_width
    logprobs_BR = torch.zeros(B, R)
    entropy_BR = torch.zeros(B, R) if compute_entropy else None
    for rows in micro_batches(batch, max_tokens, micro_batch_size):
        micro = batch.select(rows).to(device)
        with mixed_precision_context(dist.is_initialized(), mixed_precision):
            logprobs_bR, entropy_bR = forward_packed(
                model, micro.input_ids_BT, micro.attention_mask_BT, micro.prompt_width, temperature,
                compute_entropy=compute_entropy, max_tokens_per_pack=max_tokens_per_pack,
                loss_mask_BR=micro.loss_mask_BR if state_masking else None)
        logprobs_BR[rows] = logprobs_bR.cpu()
        if compute_entropy:
            entropy_BR[rows] = entropy_bR.cpu()
    return logprobs_BR, entropy_BR


def _probe_logprobs(role, tokens: int) -> None:
    """One no-grad log-prob pass of `tokens` synthetic tokens, as the log-prob passes run them (memory plan)."""
    batch = synthetic_batch(tokens, role.model.config.get_text_config().vocab_size)
    _logprobs_in_micro_batches(role.model, batch, len(batch), None, role.temperature, role.max_tokens_per_pack,
                               False, role.mixed_precision, state_masking=False)   # every position scored: the most


class Actor(TrainedModel):
    """FSDP2-sharded causal LM trained with the PPO clipped loss (plus entropy bonus and KL loss).

    `micro_batch_size`: trajectories per forward/backward on this process; `temperature`: the
    rollout's, which the log-probs divide the logits by; `total_steps`: training steps the learning-
    rate schedule spans (None: constant schedules only)."""

    role = "actor"

    def __init__(self, model: ModelConfig, cfg: ActorConfig, *, micro_batch_size: int,
                 total_steps: int | None = None, temperature: float = 1.0, seed: int = 0,
                 log_prob_budget: tuple[bool | None, int | None] = (None, None)):
        """`log_prob_budget`: (use_dynamic_bsz, max tokens) of the old log-prob pass (rollout.log_prob_*
        keys; a null switch follows cfg.use_dynamic_bsz)."""
        device = compute_device()
        self.mixed_precision = cfg.fsdp_config.mixed_precision and device.type == "cuda"
        lm = _load_policy_model(model, checkpointed_share(model), cfg.fsdp_config.param_offload,
                                self.mixed_precision, device, adapters_seed=seed)
        dynamic, tokens = log_prob_budget
        budgets = TokenBudgets.from_config(
            (cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu),
            (cfg.use_dynamic_bsz if dynamic is None else dynamic, tokens),
            model.enable_gradient_checkpointing and model.gradient_checkpointing_ratio is None, device,
            {"update": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
             "forward": "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
             "ratio": "actor_rollout_ref.model.gradient_checkpointing_ratio"})
        super().__init__(lm, cfg.optim, cfg.fsdp_config, total_steps=total_steps, grad_clip=cfg.grad_clip,
                         micro_batch_size=micro_batch_size, ppo_epochs=cfg.ppo_epochs, loss_agg=cfg.loss_agg_mode,
                         state_masking=cfg.state_masking, seed=seed, budgets=budgets)
        self.cfg = cfg
        self.temperature = temperature
        self.max_tokens_per_pack = tokens_per_pack(cfg.max_tokens_per_pack, device)

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """logprobs_BR of the response tokens under the current weights (fp32, CPU, 0 on padding and,
        with state_masking, on observations)."""
        return self.compute_logprobs_and_entropy(batch, entropy=False)[0]

    def compute_logprobs_and_entropy(self, batch: RolloutBatch, entropy: bool = True):
        plan_before_first_pass(self, batch)
        return _logprobs_in_micro_batches(self.model, batch, self.micro_batch_size, self.budgets.forward,
                                          self.temperature, self.max_tokens_per_pack, entropy, self.mixed_precision,
                                          self.state_masking)

    def compute_base_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """logprobs_BR of the base model, the LoRA adapters switched off: the reference policy of a
        LoRA run (actor_rollout_ref.model.lora_rank), which builds no Reference."""
        plan_before_first_pass(self, batch)
        with adapters_disabled(self.model):
            return _logprobs_in_micro_batches(self.model, batch, self.micro_batch_size, self.budgets.forward,
                                              self.temperature, self.max_tokens_per_pack, False,
                                              self.mixed_precision, self.state_masking)[0]

    def _probe_update(self, tokens: int) -> None:
        """One forward/backward of `tokens` synthetic tokens, as the update runs them (memory plan)."""
        micro = synthetic_batch(tokens, self.model.config.get_text_config().vocab_size).to(self.device)
        self.model.train()
        with mixed_precision_context(dist.is_initialized(), self.mixed_precision):
            logprobs_BR, entropy_BR = forward_packed(
                self.model, micro.input_ids_BT, micro.attention_mask_BT, micro.prompt_width, self.temperature,
                compute_entropy=True, max_tokens_per_pack=self.max_tokens_per_pack,
                entropy_grad=self.cfg.entropy_coeff != 0)
        loss = logprobs_BR.mean() + (entropy_BR.mean() if entropy_BR.requires_grad else 0.0)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=False)   # kept between probes (memory.measure)

    def _probe_forward(self, tokens: int) -> None:
        _probe_logprobs(self, tokens)

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
                    entropy_grad=cfg.entropy_coeff != 0, loss_mask_BR=mask_BR)
            old_BR = logprobs_BR.detach() if micro.old_logprobs_BR is None else micro.old_logprobs_BR
            weights_BR, is_stats = None, {}
            if micro.rollout_logprobs_BR is not None:  # rollout.calculate_log_probs: the engine's own
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
                 micro_batch_size: int = 4, max_tokens_per_pack: int = 16384, temperature: float = 1.0,
                 budget: tuple[bool, int | None] = (False, None), state_masking: bool = True):
        """`budget`: (use_dynamic_bsz, max tokens) of its forwards (ref.log_prob_* keys); `state_masking`:
        the actor's (only the model's own tokens are scored)."""
        device = compute_device()
        self.mixed_precision = mixed_precision and device.type == "cuda"
        self.model = _load_policy_model(model, 0.0, param_offload, self.mixed_precision, device)
        self.model.requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_pack = tokens_per_pack(max_tokens_per_pack, device)
        self.temperature = temperature
        self.state_masking = state_masking
        self.budgets = TokenBudgets.from_config((False, None), budget, False, device, {
            "forward": "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"})

    def plan_memory(self, longest_row: int, others_pending: float = 0.0) -> list[str]:
        """Measure the forward budget if it is null (see TrainedModel.plan_memory)."""
        if not self.budgets.unplanned:
            return []
        from verl.workers import memory
        plan = memory.plan(self.model, None, self._probe_forward, role="reference", update_tokens=None,
                           forward_tokens=None, measure_update=False, measure_forward=True, choose_recompute=False,
                           longest_row=longest_row, pending_update=0.0, pending_forward=others_pending,
                           keys=self.budgets.keys)
        self.budgets = TokenBudgets(None, plan.forward_tokens)
        return plan.notes

    def _probe_forward(self, tokens: int) -> None:
        _probe_logprobs(self, tokens)

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """ref_logprobs_BR (fp32, CPU, 0 on padding and, with state_masking, on observations)."""
        plan_before_first_pass(self, batch)
        return _logprobs_in_micro_batches(self.model, batch, self.micro_batch_size, self.budgets.forward,
                                          self.temperature, self.max_tokens_per_pack, False, self.mixed_precision,
                                          self.state_masking)[0]
