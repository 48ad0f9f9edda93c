"""Packed forwards: response log-probs (and entropy) and critic values without padding.

- `forward_packed` / `values_packed`: what the workers use; `forward_padded` / `values_padded`: the
  plain reference the tests compare against.

Packing. Rows are [left-padded prompt | right-padded response] (see `verl.batch`). A forward over
the padded batch spends compute on padding, which in multi-turn search rollouts (very different
response lengths) is often most of the batch. `forward_packed` drops the padding and concatenates
the real tokens of several rows into ONE sequence of length L (batch dimension 1), with position ids
restarting at 0 for every row, and keeps rows from attending to each other:
- with flash-attention-2 (`attn_implementation="flash_attention_2"`), transformers reads the row
  boundaries from the position ids (varlen kernel, no mask): one pack per call;
- with our `varlen` attention (the default on CUDA in bf16 when the flash-attn package is absent),
  we pass the row boundaries (`cu_seq_lens_q`) and torch's own FlashAttention varlen kernel
  (`torch.nn.attention.varlen`) runs without a mask: one pack per call, no O(L²) memory. On the CPU
  the same function runs SDPA row by row (exact, for tests);
- otherwise (SDPA, eager) we pass an explicit block-diagonal causal mask of shape [1, 1, L, L]. It
  costs O(L²) memory (bool for SDPA: 64 MiB at L = 8192; SDPA's memory-efficient kernel turns it into
  an L×L bias of the compute dtype), so rows are grouped into packs of at most `max_tokens_per_pack`
  real tokens (a single longer row gets a pack of its own) and the model runs once per pack.

Under FSDP every forward is a collective (parameters are all-gathered layer by layer), so all ranks
must run the same number of forwards. The pack count depends on each rank's own data, so
`forward_packed` agrees on it with one all-reduce (MAX) and ranks that need fewer packs split theirs
further. The callers already run the same number of micro-batches on every rank.

Logits only where needed: the model is called through its root `forward` (FSDP2 unshards the root's
parameters — embeddings, final norm, lm_head — only in the root's forward hook, so calling
`model.model` and `model.lm_head` separately would meet sharded weights) with `logits_to_keep` set to
the positions that predict response tokens, so lm_head runs on those rows of the hidden states only.
Given the loss mask, only on the rows that predict a model-written token: an observation (retrieved
passages, most of a search trajectory's response) is read by the model but never scored, so its
vocabulary-wide logits would be computed and softmaxed for nothing; its log-prob comes back as 0.
Their log-probs and entropy come from `core_algos.logprobs_and_entropy`, which works through the
vocabulary-wide logits in chunks and keeps only the bf16 logits for backward.
For a value model we own the wrapper (`ValueModel`) and it does the same with its value head.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from verl.core_algos import logprobs_and_entropy
from verl.utils.process_group import all_reduce_scalar
from verl.workers.modeling import VARLEN_ATTN, ValueModel


TOKENS_PER_PACK = 8192   # forward_packed's default pack size (the trainer's comes from its key)


def tokens_per_pack(max_tokens: int | None, device: torch.device) -> int | None:
    """The pack size a model on `device` should use. Without a varlen kernel a pack needs a mask, and
    attention then costs the square of the pack's length; on the CPU (no varlen kernel) that outweighs
    what larger matrix products gain, so one row per pack (benchmarks/RESULTS.md, "The demo")."""
    return 1 if device.type == "cpu" else max_tokens


def plan_packs(lengths: list[int], max_tokens: int | None, min_packs: int = 1) -> list[range]:
    """Consecutive row ranges whose token counts sum to at most `max_tokens` (a longer row gets a
    range of its own), split further until there are at least `min_packs` of them."""
    packs: list[range] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths):
        if i > start and max_tokens is not None and tokens + n > max_tokens:
            packs.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    packs.append(range(start, len(lengths)))
    if min_packs > len(lengths):
        raise ValueError(f"cannot split {len(lengths)} rows into {min_packs} packs")
    while len(packs) < min_packs:  # halve the pack with the most rows
        i = max(range(len(packs)), key=lambda j: len(packs[j]))
        r = packs[i]
        mid = r.start + len(r) // 2
        packs[i:i + 1] = [range(r.start, mid), range(mid, r.stop)]
    return packs


def _agree_on_pack_count(n: int) -> int:
    return int(all_reduce_scalar(n, dist.ReduceOp.MAX))


def _response_positions(attention_mask_BT: torch.Tensor, prompt_width: int):
    """Which response tokens exist, and check that the token before each one is real (the layout
    of `verl.batch`: contiguous real tokens, at least one prompt token)."""
    real_BT = attention_mask_BT.bool()
    target_BR = real_BT[:, prompt_width:]
    prev_BR = real_BT[:, prompt_width - 1:-1] if prompt_width > 0 else torch.zeros_like(target_BR)
    if not bool((prev_BR | ~target_BR).all()):
        raise ValueError(
            "every response token must follow a real token: rows must be [left-padded prompt | right-padded "
            "response] with a non-empty prompt (build batches with verl.batch.pack_trajectories)")
    return real_BT, target_BR


def _packed_outputs(model, input_ids_BT, attention_mask_BT, prompt_width, max_tokens_per_pack, needed_BR=None):
    """For each pack: (row range, target_bR, out_N...) where out holds the model's output (logits or
    values) at the N positions that predict the pack's response tokens (those of `needed_BR` where
    given), in row-major order."""
    real_BT, target_BR = _response_positions(attention_mask_BT, prompt_width)
    if needed_BR is not None:
        target_BR = target_BR & needed_BR.bool()
    P = prompt_width
    attn = getattr(model.config, "_attn_implementation", "sdpa")
    flash = attn in ("flash_attention_2", VARLEN_ATTN)  # no mask: one pack, any length
    lengths = real_BT.sum(1).tolist()
    packs = plan_packs(lengths, None if flash else max_tokens_per_pack)
    n_packs = _agree_on_pack_count(len(packs))
    if n_packs > len(packs):
        packs = plan_packs(lengths, None if flash else max_tokens_per_pack, min_packs=n_packs)
    for rows in packs:
        real_bT = real_BT[rows.start:rows.stop]
        ids_L = input_ids_BT[rows.start:rows.stop][real_bT]
        pos_bT = real_bT.long().cumsum(1) - 1
        pos_L = pos_bT[real_bT]
        # Index of every real token inside the packed sequence; -1 on padding.
        flat_bT = real_bT.flatten().long().cumsum(0).view_as(real_bT) - 1
        target_bR = target_BR[rows.start:rows.stop]
        src_N = flat_bT[:, P - 1:-1][target_bR]  # the position whose output predicts response token j
        kwargs = {}
        if attn == VARLEN_ATTN:
            mask = None
            lengths_b = lengths[rows.start:rows.stop]
            kwargs = {"cu_seq_lens_q": torch.tensor([0, *itertools.accumulate(lengths_b)], dtype=torch.int32,
                                                    device=ids_L.device),
                      "max_length_q": max(lengths_b)}
        elif flash:
            mask = None  # transformers derives the row boundaries (cu_seqlens) from position_ids
        else:
            row_L = torch.arange(len(rows), device=real_bT.device)[:, None].expand_as(real_bT)[real_bT]
            L = ids_L.shape[0]
            causal_LL = torch.ones(L, L, dtype=torch.bool, device=ids_L.device).tril_()
            mask = (causal_LL & (row_L[:, None] == row_L[None, :]))[None, None]
            if attn == "eager":
                # eager attention adds the mask to the scores
                dtype = next(model.parameters()).dtype
                mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        out = model(input_ids=ids_L[None], attention_mask=mask, position_ids=pos_L[None], logits_to_keep=src_N,
                    use_cache=False, **kwargs)
        out = out.logits if hasattr(out, "logits") else out
        yield rows, target_bR, out[0]


def _scatter_rows(values_N: torch.Tensor, target_bR: torch.Tensor) -> torch.Tensor:
    out_bR = torch.zeros(target_bR.shape, dtype=values_N.dtype, device=values_N.device)
    out_bR[target_bR] = values_N  # index_put keeps the autograd graph of values_N
    return out_bR


def forward_packed(model, input_ids_BT, attention_mask_BT, prompt_width: int, temperature: float = 1.0,
                   compute_entropy: bool = False, max_tokens_per_pack: int | None = TOKENS_PER_PACK,
                   entropy_grad: bool = True, loss_mask_BR: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens, padding removed (see module docstring).

    Returns logprobs_BR (fp32, 0 where the response is padding, or where `loss_mask_BR` is 0 when
    given) and entropy_BR or None. Gradients
    flow unless called under no_grad; `entropy_grad=False` computes the entropy for metrics only.
    Under FSDP this is a collective: every rank must call it the same number of times.
    """
    P = prompt_width
    logprobs, entropies = [], []
    for rows, target_bR, logits_NV in _packed_outputs(model, input_ids_BT, attention_mask_BT, P, max_tokens_per_pack,
                                                      loss_mask_BR):
        labels_N = input_ids_BT[rows.start:rows.stop, P:][target_bR]
        logprobs_N, entropy_N = logprobs_and_entropy(logits_NV, labels_N, temperature, compute_entropy, entropy_grad)
        logprobs.append(_scatter_rows(logprobs_N, target_bR))
        if compute_entropy:
            entropies.append(_scatter_rows(entropy_N, target_bR))
    return torch.cat(logprobs), torch.cat(entropies) if compute_entropy else None


def _padded_position_ids(attention_mask_BT):
    # Positions count real tokens only, so a left-padded row sees the same positions as packed.
    return (attention_mask_BT.long().cumsum(1) - 1).clamp_(min=0)


def forward_padded(model, input_ids_BT, attention_mask_BT, prompt_width: int, temperature: float = 1.0,
                   compute_entropy: bool = False, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain padded forward that `forward_packed` must agree with (same outputs)."""
    P = prompt_width
    _, target_BR = _response_positions(attention_mask_BT, P)
    R = input_ids_BT.shape[1] - P
    logits_BRV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                       position_ids=_padded_position_ids(attention_mask_BT), logits_to_keep=R + 1,
                       use_cache=False).logits[:, :-1]  # positions P-1 … T-2 predict tokens P … T-1
    logprobs_BR, entropy_BR = logprobs_and_entropy(logits_BRV, input_ids_BT[:, P:], temperature,
                                                   compute_entropy, entropy_grad)
    zero = target_BR.logical_not()
    logprobs_BR = logprobs_BR.masked_fill(zero, 0.0)
    return logprobs_BR, entropy_BR.masked_fill(zero, 0.0) if compute_entropy else None


def values_packed(model: ValueModel, input_ids_BT, attention_mask_BT, prompt_width: int,
                  max_tokens_per_pack: int | None = TOKENS_PER_PACK) -> torch.Tensor:
    """values_BR: V of the state before each response token (the output at the token's predecessor,
    the same positions that predict it), fp32, 0 on padding."""
    values = [_scatter_rows(values_N.float(), target_bR) for _, target_bR, values_N in
              _packed_outputs(model, input_ids_BT, attention_mask_BT, prompt_width, max_tokens_per_pack)]
    return torch.cat(values)


def values_padded(model: ValueModel, input_ids_BT, attention_mask_BT, prompt_width: int) -> torch.Tensor:
    _, target_BR = _response_positions(attention_mask_BT, prompt_width)
    R = input_ids_BT.shape[1] - prompt_width
    values_BR = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                      position_ids=_padded_position_ids(attention_mask_BT), logits_to_keep=R + 1)[:, :-1]
    return values_BR.float().masked_fill(target_BR.logical_not(), 0.0)
