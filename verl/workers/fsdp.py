"""FSDP2 plumbing shared by the Actor, Reference and Critic workers.

- `init_distributed`: one process group per worker process (NCCL on GPUs, gloo on CPU).
- `build_causal_lm` / `build_value_model`: fp32 master weights, dropout off, optional gradient
  checkpointing (of every decoder layer, or of an evenly spread fraction of them).
- `shard`: FSDP2 (`fully_shard`) on every decoder layer, then on the root; `compile_layers`:
  torch.compile of each decoder layer's forward (optional); `accumulation_steps`: one
  all-gather and one reduce-scatter per optimizer step instead of per micro-batch (optional).
- `varlen_attention` / `pick_attn_implementation`: the attention used for packed rows (below).
- `full_state_dict_iter`: full tensors one at a time, for pushing weights to the rollout engine.
- `forward_packed` / `forward_padded`: response log-probs (and entropy); `values_packed` /
  `values_padded`: critic values. The packed forms are what the workers use; the padded forms are
  the plain reference the tests compare against.
- `clip_grad_norm_`, `build_optimizer`, `build_lr_scheduler`, `move_optimizer_state`, `loss_units`,
  `shuffled_mini_batches`, `check_batch_sizes`, `mixed_precision_context`: training helpers used by
  both Actor and Critic (the loss-scaling rule they implement is explained in `verl.workers.actor`).

Packing. Rows are [left-padded prompt | right-padded response] (see `verl.protocol`). A forward over
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
Their log-probs and entropy come from `core_algos.logprobs_and_entropy`, which works through the
vocabulary-wide logits in chunks and keeps only the bf16 logits for backward.
For a value model we own the wrapper (`ValueModel`) and it does the same with its value head.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import itertools
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from verl.protocol import RolloutBatch
from verl.trainer.core_algos import LossAgg, logprobs_and_entropy

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# Process group and devices


def init_distributed(timeout_minutes: int = 30) -> tuple[int, int]:
    """Join the process group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (env://).

    NCCL when CUDA is available (and the CUDA device is set from LOCAL_RANK first), gloo otherwise.
    Returns (rank, world_size); does nothing but return them if the group already exists.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed needs the environment variables {missing}: launch with torchrun, or set "
            f"RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each worker before creating it")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kwargs = {}
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        backend = "nccl"
        kwargs["device_id"] = torch.device("cuda", local_rank)  # eager NCCL init, no device guessing
    else:
        backend = "gloo"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=timeout_minutes), **kwargs)
    return rank, world_size


def compute_device() -> torch.device:
    """Where forwards run: the current CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _comm_device() -> torch.device:
    """Device for tensors we all-reduce ourselves: NCCL only moves CUDA tensors, gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_scalar(value: float, op=dist.ReduceOp.SUM) -> float:
    """A python number reduced over all ranks (unchanged without a process group)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=op)
    return t.item()


# ---------------------------------------------------------------------------------------------------
# Models


VARLEN_ATTN = "varlen"  # the name under which `varlen_attention` is registered with transformers
_VARLEN_KERNEL = None  # set by register_varlen_attention


def pick_attn_implementation(mixed_precision: bool) -> str:
    """On CUDA in bf16: flash-attention-2 where the package is installed, else torch's own
    FlashAttention varlen kernel (`varlen`). Otherwise SDPA with an explicit packing mask (neither
    flash kernel has fp32 or CPU code)."""
    from transformers.utils import is_flash_attn_2_available

    if torch.cuda.is_available() and mixed_precision:
        if is_flash_attn_2_available():
            return "flash_attention_2"
        if _torch_varlen() is not None:
            register_varlen_attention()
            return VARLEN_ATTN
    return "sdpa"


@functools.cache
def _torch_varlen():
    """(varlen_attn, its keyword arguments for causal attention, whether it takes enable_gqa), or
    None for a torch without it (< 2.10). torch 2.10 took `is_causal`; later versions `window_size`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def register_varlen_attention() -> None:
    """Make `attn_implementation="varlen"` known to transformers (idempotent). Models using it take
    no mask: transformers skips mask creation for implementations it has no mask function for."""
    from transformers import AttentionInterface

    global _VARLEN_KERNEL
    _VARLEN_KERNEL = _torch_varlen()  # looked up once, outside code that torch.compile traces
    AttentionInterface.register(VARLEN_ATTN, varlen_attention)



def varlen_attention(module, query_BHTD, key_BHTD, value_BHTD, attention_mask, scaling=None, dropout=0.0,
                     cu_seq_lens_q=None, max_length_q=None, **_):
    """A transformers attention function for ONE packed sequence (batch 1) made of rows whose
    boundaries are `cu_seq_lens_q` ([0, len0, len0+len1, ...], int32): causal inside each row, nothing
    across rows. Returns ([1, T, H, D], None) as transformers expects. Dropout is off in our models."""
    if cu_seq_lens_q is None or query_BHTD.shape[0] != 1:
        raise ValueError("varlen attention needs one packed row (batch 1) and cu_seq_lens_q: call the model "
                         "through verl.workers.fsdp.forward_packed, or use attn_implementation='sdpa'")
    # [1, H, T, D] -> [T, H, D], the layout of the varlen kernels
    q_THD, k_TKD, v_TKD = (x[0].transpose(0, 1) for x in (query_BHTD, key_BHTD, value_BHTD))
    if q_THD.is_cuda:
        varlen_attn, causal, takes_gqa = _VARLEN_KERNEL
        kwargs = dict(causal)
        # Under autocast the rotary embedding (fp32 cos/sin) hands us fp32 queries and keys while
        # the value projection is bf16; the flash kernel takes 16-bit inputs only.
        dtype = value_BHTD.dtype
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("varlen attention computes in bf16/fp16: use mixed precision (FSDP's policy or "
                             "autocast), or attn_implementation='sdpa' for fp32")
        q_THD, k_TKD = q_THD.to(dtype), k_TKD.to(dtype)
        if k_TKD.shape[1] != q_THD.shape[1]:
            if takes_gqa:
                kwargs["enable_gqa"] = True
            else:  # query head h reads key/value head h // group
                group = q_THD.shape[1] // k_TKD.shape[1]
                k_TKD, v_TKD = k_TKD.repeat_interleave(group, 1), v_TKD.repeat_interleave(group, 1)
        out_THD = varlen_attn(q_THD.contiguous(), k_TKD.contiguous(), v_TKD.contiguous(), cu_seq_lens_q,
                              cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, **kwargs)
    else:  # no flash kernels on the CPU: SDPA per row gives the same result
        bounds = cu_seq_lens_q.tolist()
        out_THD = torch.cat([
            torch.nn.functional.scaled_dot_product_attention(
                q_THD[s:e].transpose(0, 1), k_TKD[s:e].transpose(0, 1), v_TKD[s:e].transpose(0, 1),
                is_causal=True, scale=scaling, enable_gqa=True).transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])])
    return out_THD[None], None


def _disable_dropout(model: nn.Module) -> None:
    # PPO's ratio must be exactly 1 where nothing changed: old log-probs (no grad, eval-like) and the
    # update's log-probs (train mode, needed for gradient checkpointing) must come from the same
    # deterministic function. Most LLM configs have dropout 0 already; some do not.
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def _enable_gradient_checkpointing(model, ratio: float = 1.0) -> None:
    """Checkpoint round(ratio × layers) decoder layers, spread evenly over the depth (0.5: every other
    layer). The others keep their activations for backward: less recompute, more memory."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"gradient checkpointing ratio {ratio}: use the fraction of decoder layers to "
                         f"checkpoint, in [0, 1]")
    if ratio == 0:
        return
    layers, n_checkpointed = [], 0  # ratio 1: all layers, as transformers does it, no layer lookup
    if ratio < 1:
        layers = _decoder_layers(model)
        n_checkpointed = round(ratio * len(layers))
        if n_checkpointed == 0:
            return
        if n_checkpointed < len(layers) and not all(hasattr(layer, "gradient_checkpointing") for layer in layers):
            raise ValueError(
                f"gradient checkpointing ratio {ratio}: the decoder layers of {type(model).__name__} have no "
                f"per-layer `gradient_checkpointing` flag (transformers' GradientCheckpointingLayer), so only "
                f"all of them can be checkpointed: use a ratio of 1 or 0")
    # Non-reentrant checkpointing: the reentrant variant does not work with FSDP2's hooks and needs
    # inputs that require grad.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    # Keep layers i·n/k for i < k (evenly spaced, distinct because n/k ≥ 1); switch the others off.
    checkpointed = {i * len(layers) // n_checkpointed for i in range(n_checkpointed)}
    for i, layer in enumerate(layers):
        if i not in checkpointed:
            layer.gradient_checkpointing = False


def build_causal_lm(path: str, dtype: torch.dtype = torch.float32, gradient_checkpointing: float = 0.0,
                    attn_implementation: str = "sdpa") -> nn.Module:
    """A Hugging Face causal LM on the CPU in `dtype` (keep fp32 for trained models: these are the
    master weights; FSDP's mixed precision casts to bf16 for compute). `gradient_checkpointing`: the
    fraction of decoder layers checkpointed, in [0, 1] (True is 1.0, False 0.0)."""
    from transformers import AutoModelForCausalLM

    if attn_implementation == VARLEN_ATTN:
        register_varlen_attention()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    _disable_dropout(model)
    _enable_gradient_checkpointing(model, float(gradient_checkpointing))
    return model


class ValueModel(nn.Module):
    """A decoder-only backbone (`AutoModel`: the causal LM without its lm_head) and a linear value
    head, initialised to zero so that the first values are 0 instead of noise of the size of the
    hidden states.

    Why not `AutoModelForTokenClassification(num_labels=1)`: it exists only for some architectures,
    while `AutoModel` loads the base model of every decoder-only checkpoint (the lm_head weights are
    simply not used). The backbone sits at `.model`, like in HF causal LMs, so `shard` finds the
    decoder layers the same way. `forward` mirrors the causal LM's `logits_to_keep` argument.
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.model = backbone
        self.config = backbone.config
        hidden = self.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=next(backbone.parameters()).dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False,
                **attention_kwargs):
        hidden_BTH = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=use_cache, **attention_kwargs).last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        # [B, kept]; a copy, not a view: FSDP2 warns on (and an in-place op would break) a view output
        return self.value_head(hidden_BTH[:, keep]).squeeze(-1).clone()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)


def build_value_model(path: str, dtype: torch.dtype = torch.float32, gradient_checkpointing: float = 0.0,
                      attn_implementation: str = "sdpa") -> ValueModel:
    """`ValueModel` with the backbone of the checkpoint at `path` (a causal LM checkpoint is fine).
    `gradient_checkpointing` as in `build_causal_lm`."""
    from transformers import AutoModel

    if attn_implementation == VARLEN_ATTN:
        register_varlen_attention()
    backbone = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    model = ValueModel(backbone)
    _disable_dropout(model)
    _enable_gradient_checkpointing(model, float(gradient_checkpointing))
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return list(layers)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(
            f"no decoder layers found in {type(model).__name__} (looked for `model.model.layers` and modules "
            f"whose class name ends with 'DecoderLayer'): extend verl.workers.fsdp._decoder_layers for it")
    return layers


def compile_layers(model: nn.Module) -> nn.Module:
    """torch.compile each decoder layer's forward (not the module call: FSDP2's hooks and
    activation checkpointing stay outside the compiled code). Fuses the elementwise work between
    the matmuls (norms, rotary embedding, SiLU·gate, residual adds), which in eager mode costs about
    as much memory traffic as the matmuls cost compute. Dynamic shapes: every pack has its own length."""
    for layer in _decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return model


def shard(model: nn.Module, cpu_offload: bool = False, mixed_precision: bool = True) -> nn.Module:
    """FSDP2 over all ranks: one unit per decoder layer (so only one layer's full weights exist at a
    time), then the root (embeddings, final norm, heads). Parameters stay in their dtype (fp32 master
    weights); on CUDA with `mixed_precision` they are all-gathered and used in bf16, and gradients are
    reduced in fp32. `cpu_offload` keeps the shards (and so the optimizer step) on the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    on_cuda = torch.cuda.is_available()
    kwargs = {}
    if mixed_precision and on_cuda:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mixed_precision:
        logger.info("mixed precision is for CUDA only; computing in fp32 on the CPU")
    if cpu_offload and on_cuda:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif cpu_offload:
        logger.info("parameter offload is for CUDA only; parameters are on the CPU already")
    else:
        kwargs["offload_policy"] = OffloadPolicy()
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def accumulation_steps(model: nn.Module, micro_batches: list, unsharded: bool) -> Iterator:
    """Yield the micro-batches of one optimizer step, setting FSDP2 up for gradient accumulation.

    By default FSDP2 all-gathers a layer's weights in every forward and again in every backward,
    and reduce-scatters its gradients after every backward: per micro-batch, two all-gathers of the
    bf16 weights and one reduce-scatter of fp32 gradients (≈ 24 GB of traffic for 3B). With
    `unsharded` the decoder layers keep their full weights from the first forward to the last
    backward, and gradients are summed unsharded (in the reduce dtype, fp32) and reduce-scattered
    once, after the last micro-batch. The cost is memory: the whole model's bf16 weights and fp32
    gradients unsharded on every GPU (18 GB for 3B) while the step runs. Without FSDP (one
    process) or with `unsharded=False` the micro-batches pass through untouched.
    """
    from torch.distributed.fsdp import FSDPModule

    if not (unsharded and isinstance(model, FSDPModule)):
        yield from micro_batches
        return
    layers = _decoder_layers(model)  # the root keeps its weights after forward anyway (FSDP2's rule)
    for layer in layers:
        layer.set_reshard_after_forward(False, recurse=False)
    try:
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            yield micro
    finally:
        for layer in layers:
            layer.set_reshard_after_forward(True, recurse=False)
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    device = _comm_device()
    if local.device != device:
        # CPU-offloaded shards: NCCL cannot gather CPU tensors, so gather on the GPU.
        local = local.to(device)
        t = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False)
    return t.full_tensor()


def full_state_dict_iter(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter and persistent buffer, one at a time, so that at most
    one full parameter exists beside the shards. A collective: every rank must consume the whole
    iterator. Names are those of the unwrapped HF model (FSDP2 adds no prefixes); tied weights come
    once (`named_parameters` removes duplicates, as the rollout engines expect)."""
    def full(t):  # cast the shard, then gather: fewer bytes moved when dtype is narrower
        return _full_tensor(t if dtype is None else t.to(dtype))

    for name, param in model.named_parameters():
        yield name, full(param.detach())
    for module_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf is None or buf_name in module._non_persistent_buffers_set:
                continue
            yield f"{module_name}.{buf_name}" if module_name else buf_name, full(buf)


# ---------------------------------------------------------------------------------------------------
# Forwards: response log-probs, entropies and values


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
    of `verl.protocol`: contiguous real tokens, at least one prompt token)."""
    real_BT = attention_mask_BT.bool()
    target_BR = real_BT[:, prompt_width:]
    prev_BR = real_BT[:, prompt_width - 1:-1] if prompt_width > 0 else torch.zeros_like(target_BR)
    if not bool((prev_BR | ~target_BR).all()):
        raise ValueError(
            "every response token must follow a real token: rows must be [left-padded prompt | right-padded "
            "response] with a non-empty prompt (build batches with verl.protocol.pack_trajectories)")
    return real_BT, target_BR


def _packed_outputs(model, input_ids_BT, attention_mask_BT, prompt_width, max_tokens_per_pack):
    """For each pack: (row range, target_bR, out_N...) where out holds the model's output (logits or
    values) at the N positions that predict the pack's response tokens, in row-major order."""
    real_BT, target_BR = _response_positions(attention_mask_BT, prompt_width)
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
                   compute_entropy: bool = False, max_tokens_per_pack: int | None = 8192,
                   entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens, padding removed (see module docstring).

    Returns logprobs_BR (fp32, 0 where the response is padding) and entropy_BR or None. Gradients
    flow unless called under no_grad; `entropy_grad=False` computes the entropy for metrics only.
    Under FSDP this is a collective: every rank must call it the same number of times.
    """
    P = prompt_width
    logprobs, entropies = [], []
    for rows, target_bR, logits_NV in _packed_outputs(model, input_ids_BT, attention_mask_BT, P, max_tokens_per_pack):
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
                  max_tokens_per_pack: int | None = 8192) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------------------
# Training helpers shared by Actor and Critic


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
    sq = torch.zeros((), dtype=torch.float64, device=_comm_device())
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
    # original Search-R1 (verl) runs did.
    params = list(model.parameters())
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


def shuffled_mini_batches(batch: RolloutBatch, mini_batch_size: int, seed: int, shuffle: bool) -> list[RolloutBatch]:
    """The batch's rows in a seeded random order (same seed, same order: runs are reproducible and
    resumable), cut into mini-batches."""
    if shuffle:
        order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed))
    else:
        order = torch.arange(len(batch))
    return [batch.select(order[i:i + mini_batch_size]) for i in range(0, len(batch), mini_batch_size)]


def mixed_precision_context(sharded: bool, mixed_precision: bool):
    # Sharded models get bf16 compute from FSDP's MixedPrecisionPolicy; an unsharded model on a GPU
    # (single-process runs) gets it from autocast.
    if mixed_precision and not sharded and torch.cuda.is_available():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
