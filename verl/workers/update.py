"""The update loop shared by Actor and Critic (`TrainedModel`) and its helpers: gradient clipping
over shards, AdamW, the learning-rate schedule, optimizer-state offload, loss units, mini-batches."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from verl.batch import RolloutBatch, token_budget_parts
from verl.core_algos import LossAgg
from verl.utils.process_group import all_reduce_scalar, comm_device, world_size
from verl.workers.distributed import accumulation_steps, compute_device

logger = logging.getLogger(__name__)


def clip_grad_norm_(parameters, max_norm: float | None) -> float:
    """Global L2 norm of the gradients over all ranks, and clip them to `max_norm` (None: no clip).

    Written out instead of `torch.nn.utils.clip_grad_norm_` because it must also work with
    CPU-offloaded FSDP2 shards (the DTensor reduction would try NCCL on CPU tensors). FSDP2 shards
    every parameter over all ranks with no overlap, so the global squared norm is the sum over
    ranks of the local shards' squared norms. Returns the norm before clipping (inf/nan pass
    through: the caller skips the step).
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g.detach())
    sq = torch.zeros((), dtype=torch.float64, device=comm_device())
    for gs in by_device.values():  # one host transfer per device, not per parameter
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in gs])
        sq += norms.double().pow(2).sum().to(sq.device)
    if dist.is_initialized() and any(isinstance(p.grad, DTensor) for p in parameters):
        dist.all_reduce(sq)
    total = math.sqrt(sq.item())
    if max_norm is not None and max_norm > 0 and math.isfinite(total) and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(scale)
    return total


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]):
    # Weight decay on all parameters (norm weights and biases included): simple, and what the
    # original Search-R1 (verl) runs did. Frozen ones (a LoRA model's base weights) have no state.
    params = [p for p in model.parameters() if p.requires_grad]
    # The fused CUDA kernel: one launch per step instead of a few per parameter tensor.
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=fused or None)


@dataclass
class LRFactor:
    """Multiplier of the base learning rate at scheduler step `step` (one step per training step):
    linear warm-up from 1/warmup_steps to 1, then constant or cosine down to `min_lr_ratio` at
    `total_steps`. A callable object (not a lambda) so LambdaLR's state_dict can save it."""
    warmup_steps: int
    total_steps: int | None
    schedule: str
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer, warmup_steps: int, total_steps: int | None, schedule: str, min_lr_ratio: float):
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule={schedule!r}: use 'constant' or 'cosine'")
    if schedule == "cosine" and not total_steps:
        raise ValueError("lr_schedule='cosine' needs total_steps (the number of training steps)")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, LRFactor(warmup_steps, total_steps, schedule, min_lr_ratio))


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move the optimizer's state tensors (Adam moments: twice the parameters' size) to `device`.
    Used to park them on the CPU between updates. Blocking copies: simple and always correct.
    0-dim tensors (Adam's step counters) stay where the optimizer keeps them (the CPU).

    `DTensor.to` moves the local shard and keeps the sharding (a DTensor whose shard is on the CPU
    while its mesh is on CUDA, like FSDP2's own CPU-offloaded parameters); `DTensor.from_local`
    would not do: it moves the shard to the mesh's device."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device)


def loss_units(mask_BR: torch.Tensor, agg: str) -> float:
    """What `agg_loss(…, mask_BR, agg)` averages over: unmasked tokens for token-mean, sequences
    with at least one unmasked token for the seq-mean modes."""
    if LossAgg(agg) == LossAgg.TOKEN_MEAN:
        return float(mask_BR.sum())
    return float((mask_BR.sum(-1) > 0).sum())


def check_batch_sizes(n_trajectories: int, mini_batch_size: int, micro_batch_size: int, role: str) -> None:
    if mini_batch_size <= 0 or n_trajectories % mini_batch_size:
        raise ValueError(
            f"{role}: {n_trajectories} trajectories on this process cannot be split into mini-batches of "
            f"{mini_batch_size}: make the trajectories per step divisible by ppo_mini_batch_size")
    if mini_batch_size % micro_batch_size:
        raise ValueError(
            f"{role}: mini-batch of {mini_batch_size} trajectories is not divisible by the micro-batch size "
            f"{micro_batch_size}: change ppo_micro_batch_size or ppo_mini_batch_size")


def micro_batches(batch: RolloutBatch, max_tokens: int | None, rows: int) -> list[list[int]]:
    """Row indices of the micro-batches of `batch`: at most `max_tokens` tokens each (prompt and
    response, what a packed forward processes), or `rows` trajectories each when max_tokens is None.
    By tokens, every rank runs the number of micro-batches the rank that needs the most asks for:
    under FSDP each forward is a collective, so all ranks must run the same number."""
    if max_tokens is None:
        return [list(range(start, min(start + rows, len(batch)))) for start in range(0, len(batch), rows)]
    tokens = batch.attention_mask_BT.sum(1).tolist()
    count = int(all_reduce_scalar(len(token_budget_parts(tokens, max_tokens)), dist.ReduceOp.MAX))
    if count > len(batch):
        raise RuntimeError(f"another rank needs {count} micro-batches and this one holds {len(batch)} trajectories: "
                           "ranks must hold equal numbers of trajectories")
    return token_budget_parts(tokens, max_tokens, parts=count)


def shuffled_mini_batches(batch: RolloutBatch, mini_batch_size: int, seed: int, shuffle: bool) -> list[RolloutBatch]:
    """The batch's rows in a seeded random order (same seed, same order: runs are reproducible and
    resumable), cut into mini-batches."""
    if shuffle:
        order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(len(batch))
    return [batch.select(order[i:i + mini_batch_size]) for i in range(0, len(batch), mini_batch_size)]


# ---------------------------------------------------------------------------------------------------
# The update loop


@dataclass
class TokenBudgets:
    """Tokens per micro-batch of a role's update and of its no-grad forwards (None: trajectory
    micro-batches), and what is still to be measured on the GPU (verl.workers.memory)."""
    update: int | None
    forward: int | None
    measure_update: bool = False
    measure_forward: bool = False
    choose_recompute: bool = False
    keys: dict | None = None   # config keys named in messages: update, forward, ratio

    @property
    def unplanned(self) -> bool:
        return self.measure_update or self.measure_forward or self.choose_recompute

    @classmethod
    def from_config(cls, update: tuple[bool, int | None], forward: tuple[bool, int | None], choose_recompute: bool,
                    device: torch.device, keys: dict) -> "TokenBudgets":
        """From (use_dynamic_bsz, max tokens) of the update and of the forwards: a null budget is
        measured on a GPU and CPU_TOKENS on the CPU, where the recomputation stays as configured."""
        from verl.workers.memory import CPU_TOKENS
        gpu = device.type == "cuda"

        def tokens(dynamic, value):
            return (value or (None if gpu else CPU_TOKENS)) if dynamic else None
        return cls(tokens(*update), tokens(*forward), gpu and update[0] and not update[1],
                   gpu and forward[0] and not forward[1], gpu and update[0] and choose_recompute, keys)


def plan_before_first_pass(role, batch: RolloutBatch) -> None:
    """`role.plan_memory` with the batch's longest row, where a budget is still to be measured
    (runs without the trainer's start-up call: benchmarks, tests)."""
    if role.budgets.unplanned:
        role.plan_memory(int(batch.attention_mask_BT.sum(1).max()))


MicroLoss = Callable[[RolloutBatch, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


class TrainedModel:
    """A model being trained, with AdamW, its learning-rate schedule and the update loop that actor
    and critic share. Subclasses build the model and say how a micro-batch's loss is computed.

    Weights, optimizer and scheduler are public attributes (`model`, `optimizer`, `scheduler`):
    checkpointing (torch.distributed.checkpoint) and the weight push to the rollout engine work on
    them directly.

    Batch sizes are per process: `mini_batch_size` trajectories per optimizer step, and per
    forward/backward at most `budgets.update` tokens (use_dynamic_bsz: what bounds memory is the
    tokens, whose count the policy decides) or else `micro_batch_size` trajectories. One `update`
    call is one training step: `ppo_epochs` passes over the process's trajectories, each a sequence
    of optimizer steps on shuffled mini-batches; the learning-rate scheduler steps once per call (so
    warm-up and decay count training steps, whatever the number of mini-batches and epochs).

    Loss scaling (gradient accumulation and data parallelism). Each mini-batch must get the gradient
    of ONE loss: the chosen aggregation (`core_algos.agg_loss`) over all its trajectories on all
    ranks. Every aggregation is a mean over "units": tokens for token-mean, sequences that have at
    least one unmasked token for the seq-mean modes. A micro-batch's aggregated loss is the mean over
    its own units, so it is scaled by

        weight = units(micro-batch) / units(mini-batch, summed over ranks) × world_size

    (the × world_size undoes FSDP's averaging of gradients over ranks). Summed over micro-batches and
    averaged over ranks this gives exactly Σ unit losses / Σ units, so the update does not depend on
    how trajectories are split into micro-batches or ranks — in particular, ranks with different token
    counts are weighted by tokens for token-mean (a plain mean of per-rank means would not be). The
    cost is one scalar all-reduce per mini-batch.
    """

    role = "model"  # names the role in errors and warnings

    def __init__(self, model: nn.Module, optim, fsdp, *, total_steps: int | None, grad_clip: float | None,
                 micro_batch_size: int, ppo_epochs: int, loss_agg: str, state_masking: bool, seed: int,
                 budgets: TokenBudgets | None = None):
        """`optim`: an OptimConfig, `fsdp`: an FSDPConfig (verl.config.schema). `budgets`: tokens per
        micro-batch (use_dynamic_bsz); None: `micro_batch_size` trajectories."""
        self.device = compute_device()
        self.model = model
        self.optimizer = build_optimizer(model, optim.lr, optim.weight_decay, tuple(optim.betas))
        warmup_steps = int(optim.lr_warmup_steps_ratio * total_steps) if total_steps else 0
        self.scheduler = build_lr_scheduler(self.optimizer, warmup_steps, total_steps, optim.lr_schedule,
                                            optim.min_lr_ratio)
        self.base_lr = optim.lr
        self.grad_clip = grad_clip
        # Offloading the optimizer state only helps while the parameters are on the GPU.
        self.optimizer_offload = fsdp.optimizer_offload and torch.cuda.is_available() and not fsdp.param_offload
        self.unsharded_accumulation = fsdp.unsharded_accumulation
        self.micro_batch_size = micro_batch_size
        self.budgets = budgets or TokenBudgets(None, None)
        self.ppo_epochs = ppo_epochs
        self.loss_agg = LossAgg(loss_agg).value  # fail at construction on an unknown name
        self.state_masking = state_masking
        self.seed = seed

    _measured = None   # the Plan of a budget measured at start-up, until the first update

    def plan_memory(self, longest_row: int, others_pending: float = 0.0) -> list[str]:
        """Measure the token budgets left null and choose the recomputed layers (verl.workers.memory),
        once, while this GPU holds what it will hold during the step. `longest_row`: the longest
        trajectory the run can produce; `others_pending`: what another role on this GPU will still
        allocate. Called at start-up by the trainer, else before the first pass that needs it.
        Returns the arithmetic of the choice, for the log."""
        b = self.budgets
        if not b.unplanned:
            return []
        from verl.workers import memory
        adam = memory.optimizer_state_bytes(self.optimizer, self.optimizer_offload)
        plan = memory.plan(self.model, self._probe_update, self._probe_forward, role=self.role,
                           update_tokens=b.update, forward_tokens=b.forward, measure_update=b.measure_update,
                           measure_forward=b.measure_forward, choose_recompute=b.choose_recompute,
                           longest_row=longest_row, pending_update=adam + others_pending,
                           pending_forward=(0.0 if self.optimizer_offload else adam) + others_pending, keys=b.keys)
        self.optimizer.zero_grad(set_to_none=True)   # the probes' gradients
        torch.cuda.empty_cache()
        self.budgets = TokenBudgets(plan.update_tokens if b.update or b.measure_update else None,
                                    plan.forward_tokens if b.forward or b.measure_forward else None)
        self._measured = plan if plan.update_line else None
        return plan.notes

    def _check_measured_budget(self, passes_peak: float, largest_micro: int) -> None:
        """After the first update with a measured budget: shrink it if the peak of its passes
        (`passes_peak` bytes allocated, up to the first optimizer step) went past what the plan allowed
        (verl.workers.memory.correct), with a warning."""
        from verl.workers.memory import GIB, correct
        plan, self._measured = self._measured, None
        observed = passes_peak - plan.update_held
        budget = correct(self.budgets.update, plan.update_line, plan.update_available, observed, largest_micro)
        if budget >= self.budgets.update:
            return
        note = (f"{self.role} update: {observed / GIB:.1f} GiB for micro-batches of up to {largest_micro} tokens, more "
                f"than the {plan.update_available / GIB:.1f} GiB planned: {budget} tokens per micro-batch from now on")
        logger.warning(note)
        self.budgets = dataclasses.replace(self.budgets, update=budget)

    def pending_bytes(self) -> float:
        """GPU memory this role will allocate during a step beyond what it holds now (its optimizer
        state before the first step, or while offloaded)."""
        from verl.workers.memory import optimizer_state_bytes
        return optimizer_state_bytes(self.optimizer, self.optimizer_offload) if torch.cuda.is_available() else 0.0

    def _probe_update(self, tokens: int) -> None:
        raise NotImplementedError

    def _probe_forward(self, tokens: int) -> None:
        raise NotImplementedError

    def set_lr_scale(self, scale: float) -> None:
        """The learning rate becomes `scale` × the configured one, from now on and at every point of
        its schedule (the schedule multiplies the base rate, which the checkpoint carries)."""
        self.scheduler.base_lrs = [self.base_lr * scale for _ in self.optimizer.param_groups]
        for group, base, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * factor(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def loss_mask(self, batch: RolloutBatch) -> torch.Tensor:
        """Tokens that count in the loss: the model's own (`state_masking`, the default) or every
        response token (the paper's ablation that trains on retrieved tokens too)."""
        return batch.loss_mask_BR if self.state_masking else batch.response_mask_BR

    def run_update(self, batch: RolloutBatch, mini_batch_size: int, micro_loss: MicroLoss,
                   shuffle: bool = True, before_first_step: Callable[[list[RolloutBatch]], None] | None = None
                   ) -> dict[str, float]:
        """One training step: `micro_loss(micro, mask_BR) -> (loss, stats)` for every micro-batch,
        gradients accumulated over a mini-batch, one optimizer step per mini-batch. Returns the
        stats averaged over micro-batches, grad_norm averaged over optimizer steps, and lr.
        `before_first_step(minis)`: called with the first epoch's mini-batches, in training order,
        while the weights are still those of the rollout (it may fill in their fields)."""
        plan_before_first_pass(self, batch)
        by_tokens = self.budgets.update
        check_batch_sizes(len(batch), mini_batch_size, mini_batch_size if by_tokens else self.micro_batch_size,
                          self.role)
        step = self.scheduler.last_epoch
        lr = self.scheduler.get_last_lr()[0]

        def mini_batches(epoch: int) -> list[RolloutBatch]:
            return shuffled_mini_batches(batch, mini_batch_size, self.seed + 100_003 * step + epoch, shuffle)

        first = mini_batches(0)
        if before_first_step is not None:   # before the optimizer state comes back onto the GPU
            before_first_step(first)
        if self.optimizer_offload:
            move_optimizer_state(self.optimizer, self.device)
        checking = self._measured is not None and torch.cuda.is_available()
        if checking:
            torch.cuda.reset_peak_memory_stats()
        passes_peak = None   # while checking: (peak bytes, largest micro-batch) of the passes before the first step
        self.model.train()
        sums: dict[str, float] = {}
        n_micro, grad_norms, largest_micro = 0, [], 0
        for epoch in range(self.ppo_epochs):
            minis = first if epoch == 0 else mini_batches(epoch)
            for mini in minis:
                total_units = all_reduce_scalar(loss_units(self.loss_mask(mini), self.loss_agg))
                self.optimizer.zero_grad(set_to_none=True)
                micros = [mini.select(rows) for rows in micro_batches(mini, by_tokens, self.micro_batch_size)]
                for micro in accumulation_steps(self.model, micros, self.unsharded_accumulation):
                    largest_micro = max(largest_micro, int(micro.attention_mask_BT.sum()))
                    micro = micro.to(self.device)
                    mask_BR = self.loss_mask(micro)
                    weight = loss_units(mask_BR, self.loss_agg) / total_units * world_size() if total_units > 0 else 0.0
                    loss, stats = micro_loss(micro, mask_BR)
                    (loss * weight).backward()
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                    n_micro += 1
                if checking and passes_peak is None:
                    passes_peak = (torch.cuda.max_memory_allocated(), largest_micro)
                grad_norms.append(self._optimizer_step())
        self.scheduler.step()
        if checking and passes_peak is not None:
            self._check_measured_budget(*passes_peak)
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
        else:  # one bad batch must not destroy the weights; every rank sees the same global norm
            logger.warning("%s: gradient norm is %s, skipping this optimizer step", self.role, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm
