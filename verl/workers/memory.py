"""Token budgets of micro-batches and the share of recomputed layers, measured at start-up.

What bounds the memory of a forward/backward is the number of tokens it packs, which the policy
decides (multi-turn responses vary several-fold), so micro-batches are cut by tokens
(`use_dynamic_bsz`, verl's keys). Where a budget key is null, this module picks it on the GPU, once
every role is built and the rollout engine sleeps:

- Two probe passes of synthetic rows (PROBE_TOKENS) measure the peak memory above what is already
  held; a straight line through the two peaks gives bytes per token and a fixed part (gradients,
  all-gathered layers, kernel workspace). Measured rather than modelled: it covers the attention
  kernel, torch.compile's fusions and the vocabulary-wide logits of this model on this GPU.
- The memory a step may use is what the GPU has free now plus what PyTorch holds cached, less the
  optimizer state not allocated yet (AdamW's two moments appear at the first optimizer step, or come
  back from the CPU with optimizer_offload), less what the other role on the same GPU will allocate
  (the critic's, reported by the driver), less HEADROOM of the GPU.
- The update's recomputation (`gradient_checkpointing_ratio` null): probes with no layer recomputed
  and with all of them give the two slopes; the fewest recomputed layers whose budget still reaches
  TARGET_TOKENS (or the longest row the run can produce, if longer) win, since recomputing costs a
  third more compute per layer, and beyond that size a larger micro-batch buys little.
- A run whose longest row does not fit even with every layer recomputed stops here, at start-up,
  with the figures and the keys to change.
- The first real update checks the measurement: where the peak of its forward/backward passes went
  past what the plan allowed (real rows costing more a token than the synthetic ones), the update's
  budget shrinks to the cost it measured (`correct`), with a warning. The peak counts from what was
  held when the plan was made, the frame of the probes' line, and stops before the first optimizer
  step: that step's memory (AdamW's moments, allocated there on the first update) was planned apart
  as pending, and no budget of tokens would change it.

On the CPU nothing is probed: budgets are CPU_TOKENS and every layer is recomputed (as before).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl.batch import RolloutBatch, pack_trajectories
from verl.utils.process_group import all_reduce_scalar
from verl.workers.modeling import decoder_layers, recompute_layers

log = logging.getLogger(__name__)

GIB = 1 << 30
PROBE_TOKENS = (1024, 4096)   # the two probe sizes
PROBE_ROW = 1024              # tokens per synthetic row (prompt and response)
TARGET_TOKENS = 8192          # what a micro-batch should reach before layers are recomputed
MAX_TOKENS = 65536            # no budget beyond this (4× past what the probes measured is a guess)
HEADROOM = 0.08               # share of the GPU kept free for fragmentation and what the probes miss
CPU_TOKENS = 2048             # on the CPU, where nothing is measured: about what the demo's micro-batches
                              # of 4 trajectories held before


@dataclass
class Line:
    """Peak memory of one pass as a function of its tokens: fixed + per_token × tokens (bytes)."""
    fixed: float
    per_token: float

    def tokens(self, available: float) -> int:
        return max(0, int((available - self.fixed) / max(self.per_token, 1.0)))


def measure(probe: Callable[[int], None], sizes=PROBE_TOKENS, held: float | None = None) -> Line:
    """Run `probe(tokens)` at each size and fit the peak memory above what is held between passes.
    A first, unmeasured run takes what happens once (torch.compile's compilation and autotuning) and
    leaves what every pass keeps (gradients: the update's probes zero them in place), which joins the
    fixed part. Without that, the peak of a small probe falls at the end of its backward, where the
    gradients outweigh the activations, and the fit's slope comes out too low. `held`: the bytes
    allocated when the memory available was measured (default: now). What the probes keep counts from
    there, so that a second line, measured while the first one's gradients are still held, counts
    them too."""
    before = torch.cuda.memory_allocated() if held is None else held
    probe(sizes[0])
    kept = torch.cuda.memory_allocated() - before
    peaks = []
    for n in sizes:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        probe(n)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    (n0, n1), (p0, p1) = sizes, peaks
    per_token = max(0.0, (p1 - p0) / (n1 - n0))
    return Line(fixed=max(0.0, p0 - per_token * n0) + max(0, kept), per_token=per_token)


def available_bytes(pending: float) -> float:
    """Memory this process may still fill: free on the GPU, plus cached by PyTorch and unused, less
    `pending` (state that will be allocated before the pass) and the headroom."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return free + cached - pending - HEADROOM * total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, offloaded: bool) -> float:
    """GPU memory AdamW's moments will take that they do not take now: all of it before the first
    step or when offloaded to the CPU between updates (two fp32 copies of the local shards)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or params[0].device.type != "cuda":  # parameters (and so the state) offloaded
        return 0.0
    if optimizer.state and not offloaded:
        return 0.0
    return 2.0 * sum(_local(p).numel() * _local(p).element_size() for p in params)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class Plan:
    update_tokens: int
    forward_tokens: int
    notes: list[str]                # the arithmetic, for the trainer's log
    update_line: Line | None = None  # what the update's budget was measured from (for `correct`)
    update_available: float = 0.0
    update_held: float = 0.0         # bytes allocated when `update_available` was measured


def correct(budget: int, line: Line, available: float, observed: float, tokens: int) -> int:
    """The update's budget after a real update: `observed` bytes at the peak of its passes above what
    was held when the plan was made, for a largest micro-batch of `tokens`. The probes see synthetic
    rows; if the real rows cost more a token, the budget shrinks to what the measured cost allows (all
    ranks take the smallest)."""
    if observed <= available or tokens <= 0:
        return int(all_reduce_scalar(budget, dist.ReduceOp.MIN))
    per_token = max(line.per_token, (observed - line.fixed) / tokens)
    return int(all_reduce_scalar(min(budget, Line(line.fixed, per_token).tokens(available)), dist.ReduceOp.MIN))


def _between(none: Line, full: Line, k: int, layers: int) -> Line:
    """The line with k of `layers` layers recomputed, between the probes with none and all."""
    share = k / layers
    return Line(none.fixed + (full.fixed - none.fixed) * share,
                none.per_token + (full.per_token - none.per_token) * share)


def plan(model, update_probe: Callable[[int], None] | None, forward_probe: Callable[[int], None], *, role: str,
         update_tokens: int | None, forward_tokens: int | None, measure_update: bool, measure_forward: bool,
         choose_recompute: bool, longest_row: int, pending_update: float, pending_forward: float,
         keys: dict[str, str]) -> Plan:
    """Budgets for `model` (see the module docstring). `update_tokens` / `forward_tokens`: the
    budgets as configured (None: trajectory micro-batches, or to be measured); `measure_*`: measure
    that budget; `choose_recompute`: pick the recomputed layers (else the configured ones stay).
    `pending_*`: bytes that will be allocated before each kind of pass. `keys`: the config keys of
    the update's and the forward's budgets and of the ratio, for messages. Every rank gets the same
    plan: the smallest budgets and the most recomputed layers of any rank."""
    longest_row = int(all_reduce_scalar(longest_row, dist.ReduceOp.MAX))
    notes, update_line, update_avail, update_held = [], None, 0.0, 0.0
    if choose_recompute or measure_update:
        avail = available_bytes(pending_update)
        held = torch.cuda.memory_allocated()
        if choose_recompute:
            layers = len(decoder_layers(model))
            recompute_layers(model, 0)
            none = measure(update_probe, held=held)
            recompute_layers(model, layers)
            full = measure(update_probe, held=held)
            target = update_tokens or min(max(TARGET_TOKENS, longest_row), MAX_TOKENS)
            chosen = next((k for k in range(layers + 1) if _between(none, full, k, layers).tokens(avail) >= target),
                          layers)
            chosen = int(all_reduce_scalar(chosen, dist.ReduceOp.MAX))
            recompute_layers(model, chosen)
            line = _between(none, full, chosen, layers)
            how = (f"{none.per_token / 2**20:.2f} MiB a token with no layer recomputed, {full.per_token / 2**20:.2f} "
                   f"with all {layers}: {chosen} recomputed ({keys['ratio']})")
        else:
            line = measure(update_probe, held=held)
            how = f"{line.per_token / 2**20:.2f} MiB a token"
        fits = int(all_reduce_scalar(line.tokens(avail), dist.ReduceOp.MIN))   # every rank decides alike
        notes.append(f"{role} update: {avail / GIB:.1f} GiB available (free + cached - {pending_update / GIB:.1f} GiB "
                     f"pending - headroom), {line.fixed / GIB:.1f} GiB fixed, {how}: {fits} tokens fit")
        if measure_update:
            update_tokens = min(fits, MAX_TOKENS)
            update_line, update_avail, update_held = line, avail, held
            notes.append(f"{role} update: {update_tokens} tokens per micro-batch ({keys['update']})")
        if fits < longest_row or (update_tokens is not None and update_tokens < longest_row):
            raise RuntimeError(
                f"{role}: a micro-batch of the update fits {fits} tokens on this GPU ({avail / GIB:.1f} GiB available, "
                f"{line.per_token / 2**20:.2f} MiB a token, {line.fixed / GIB:.1f} GiB fixed) with a budget of "
                f"{update_tokens or '-'} ({keys['update']}), and the longest trajectory the run can produce has "
                f"{longest_row} tokens. Lower data.max_prompt_length or the response lengths, recompute layers "
                f"({keys['ratio']}), offload (fsdp_config.optimizer_offload, param_offload), or shard over more GPUs")
    if measure_forward:
        line = measure(forward_probe)
        avail = available_bytes(pending_forward)
        forward_tokens = int(all_reduce_scalar(min(line.tokens(avail), MAX_TOKENS), dist.ReduceOp.MIN))
        notes.append(f"{role} forward passes: {avail / GIB:.1f} GiB available, {line.per_token / 2**20:.2f} MiB a "
                     f"token: {forward_tokens} tokens per micro-batch ({keys['forward']})")
        if forward_tokens < longest_row:
            raise RuntimeError(
                f"{role}: a forward of {longest_row} tokens (the longest trajectory the run can produce) does not fit "
                f"on this GPU ({avail / GIB:.1f} GiB available, {line.per_token / 2**20:.2f} MiB a token): lower "
                "data.max_prompt_length or the response lengths, offload (fsdp_config.param_offload), or shard over "
                "more GPUs")
    torch.cuda.empty_cache()
    for note in notes:
        log.info(note)
    return Plan(update_tokens, forward_tokens, notes, update_line, update_avail, update_held)


def synthetic_batch(tokens: int, vocab_size: int) -> RolloutBatch:
    """Rows of PROBE_ROW random tokens (a short prompt, the rest response) holding `tokens` in all."""
    rows, prompt = max(1, tokens // PROBE_ROW), 16
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab_size, (rows, PROBE_ROW), generator=g).tolist()
    return pack_trajectories([r[:prompt] for r in ids], [r[prompt:] for r in ids],
                             [[1] * (PROBE_ROW - prompt)] * rows, list(range(rows)), pad_id=0)
