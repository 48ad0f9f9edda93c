"""FSDP2 over the process group (verl.utils.process_group): sharding a model, gradient accumulation
over micro-batches, gathering full weights for the rollout engine, and the compute precision.

- `shard`: FSDP2 (`fully_shard`) on every decoder layer, then on the root; `accumulation_steps`:
  one all-gather and one reduce-scatter per optimizer step instead of per micro-batch (optional).
- `full_state_dict_iter`: full tensors one at a time, for pushing weights to the rollout engine.
- `mixed_precision_context`: bf16 compute for a model that is not sharded (one process on a GPU).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from verl.utils.process_group import comm_device
from verl.workers.modeling import decoder_layers

logger = logging.getLogger(__name__)


def compute_device() -> torch.device:
    """Where forwards run: the current CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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
    for layer in decoder_layers(model):
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
    layers = decoder_layers(model)  # the root keeps its weights after forward anyway (FSDP2's rule)
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


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective for a DTensor); other tensors as they are."""
    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    device = comm_device()
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
        return full_tensor(t if dtype is None else t.to(dtype))

    for name, param in model.named_parameters():
        yield name, full(param.detach())
    for name, buf in persistent_buffers(model):
        yield name, full(buf)


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) of the buffers a state dict holds (the persistent ones)."""
    for module_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf is None or buf_name in module._non_persistent_buffers_set:
                continue
            yield f"{module_name}.{buf_name}" if module_name else buf_name, buf


# ---------------------------------------------------------------------------------------------------


def mixed_precision_context(sharded: bool, mixed_precision: bool):
    # Sharded models get bf16 compute from FSDP's MixedPrecisionPolicy; an unsharded model on a GPU
    # (single-process runs) gets it from autocast.
    if mixed_precision and not sharded and torch.cuda.is_available():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
