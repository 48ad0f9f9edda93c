"""The actor's weights, after an update, into rollout workers of processes of their own
(trainer.rollout_ahead_steps >= 1), three ways (rollout.weight_transport):

- object_store: the first policy worker gathers the full weights, as CPU tensors in the engine's
  dtype, into one object of Ray's object store; every rollout worker reads it from there. Works on
  any placement, CPU included; costs a copy of the weights in host memory per push still unread.
- ipc: a policy worker and the rollout worker beside it on the same GPU. The policy worker gathers
  a full copy on the GPU and hands over CUDA IPC handles of it (verl.workers.rollout.shared_weights),
  so the bytes never leave the GPU; it holds the copy until the driver says the rollout worker has
  loaded it (`release_weights`), which is after the generations queued before the push.
- broadcast: a process group of its own joins the first policy worker (rank 0) and every rollout
  worker (NCCL on GPUs, Gloo on CPU) and the weights are broadcast tensor by tensor, no copy held.
  A broadcast needs both ends at once: the policy workers (and the driver) wait in it until the
  rollout workers have finished the generations queued before the push (with k = 1, while the
  trainer would wait for the next batch anyway).

Every policy rank takes part in the gather (`full_state_dict_iter` is a collective over them); the
weights of a push are the actor's after the update, whatever the transport.
"""
from __future__ import annotations

import datetime
import pickle
from enum import StrEnum

import torch

# A broadcast's receivers join it once the generations queued before the push are done: the group
# waits far longer than a collective usually does. A dead rollout worker still fails the run at
# once: the driver waits on the rollout workers' side of the push, not on this group.
WEIGHT_GROUP_TIMEOUT = datetime.timedelta(hours=2)


class WeightTransport(StrEnum):
    OBJECT_STORE = "object_store"
    IPC = "ipc"
    BROADCAST = "broadcast"


def torch_dtype(name: str) -> torch.dtype:
    """'torch.bfloat16' or 'bfloat16' → torch.bfloat16 (dtypes cross Ray as text)."""
    return getattr(torch, name.removeprefix("torch."))


def weight_group(addr: str, port: int, rank: int, world: int, device: str):
    """A process group of its own (not the default one, which the policy workers' FSDP uses) of the
    first policy worker (rank 0, hosting the store) and the rollout workers."""
    from torch.distributed import ProcessGroupGloo, TCPStore
    store = TCPStore(addr, port, world, is_master=rank == 0, wait_for_workers=False, timeout=WEIGHT_GROUP_TIMEOUT)
    if device == "cuda":
        from torch.distributed import ProcessGroupNCCL
        options = ProcessGroupNCCL.Options()
        options._timeout = WEIGHT_GROUP_TIMEOUT
        return ProcessGroupNCCL(store, rank, world, options)
    return ProcessGroupGloo(store, rank, world, WEIGHT_GROUP_TIMEOUT)


def broadcast(group, tensor: torch.Tensor) -> None:
    """`tensor` from rank 0 to every rank of `group`, in place."""
    from torch.distributed import BroadcastOptions
    options = BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([tensor], options).wait()


def received_weights(group, meta: list[tuple[str, tuple, str]], device: str):
    """(name, tensor) pairs as rank 0 broadcasts them, one at a time, in the order of `meta` (name,
    shape, dtype of each, as `WeightSender.weight_meta` lists them)."""
    for name, shape, dtype in meta:
        tensor = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
        broadcast(group, tensor)
        yield name, tensor


class WeightSender:
    """The policy worker's side of the pushes (mixed into PolicyWorker, which has `actor`, `rank`,
    `device` and `_allocator_for`): one method per transport, called on every policy rank at once."""
    _held: dict | None = None     # ipc: version → the full copies whose handles are out
    _weight_group = None          # broadcast: the group with the rollout workers (rank 0 only)

    def _full_weights(self, dtype: str):
        """The rollout workers' engines take full weights: with LoRA adapters, merged on the fly."""
        from verl.workers.distributed import full_state_dict_iter
        from verl.workers.lora import lora_layers, merged_state_dict_iter
        if lora_layers(self.actor.model):
            return merged_state_dict_iter(self.actor.model, dtype=torch_dtype(dtype))
        return full_state_dict_iter(self.actor.model, dtype=torch_dtype(dtype))

    def export_weights(self, dtype: str) -> list | None:
        """object_store: the full weights as CPU tensors in `dtype`, put into Ray's object store by
        rank 0, whose answer is [the object's ref] (inside a list, so the driver passes the ref on
        without fetching the weights); None from the other ranks, which take part in the gather."""
        import ray
        weights = {name: tensor.cpu() for name, tensor in self._full_weights(dtype)}
        return [ray.put(weights)] if self.rank == 0 else None

    def export_weights_ipc(self, version: int, dtype: str) -> bytes:
        """ipc: a full copy of the weights in `dtype` on this GPU, as CUDA IPC handles for the
        rollout worker beside it; the copy is held until `release_weights(version)`."""
        from verl.workers.rollout import shared_weights
        self._allocator_for(training=False)   # blocks of the expandable allocator cannot be shared by handle
        try:
            # a copy of its own even where the gather returns the parameter itself (one rank, same dtype)
            copies = [(name, tensor.clone()) for name, tensor in self._full_weights(dtype)]
        finally:
            self._allocator_for(training=True)
        self._held = (self._held or {}) | {version: copies}
        return shared_weights.pack(copies)

    def release_weights(self, version: int) -> None:
        """ipc: the rollout worker has loaded every push up to `version`: their copies go."""
        self._held = {v: copies for v, copies in (self._held or {}).items() if v > version}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def weight_rendezvous(self) -> tuple[str, int]:
        from verl.workers.worker_process import rendezvous
        return rendezvous()

    def join_weight_group(self, addr: str, port: int, world: int) -> None:
        """broadcast: rank 0 joins the group with the rollout workers, as its rank 0 (the others
        never send)."""
        if self.rank == 0:
            self._weight_group = weight_group(addr, port, 0, world, self.device)

    def weight_meta(self, dtype: str) -> list[tuple[str, tuple, str]] | None:
        """broadcast: what a push sends, in order (name, shape, dtype), listed by rank 0 from one
        gather that every rank takes part in."""
        meta = [(name, tuple(tensor.shape), str(tensor.dtype)) for name, tensor in self._full_weights(dtype)]
        return meta if self.rank == 0 else None

    def broadcast_weights(self, dtype: str) -> None:
        """broadcast: the full weights in `dtype`, tensor by tensor, from rank 0 to the rollout
        workers; the other ranks take part in the gather. Returns once every rollout worker has
        received them (they join after the generations queued before)."""
        for _, tensor in self._full_weights(dtype):
            if self.rank == 0:
                broadcast(self._weight_group, tensor.contiguous())
        if self.device == "cuda":   # NCCL returns before the transfer is done; the tensors must outlive it
            torch.cuda.synchronize()


def load_shared(engine, payload: bytes) -> None:
    """ipc, the rollout worker's side: load weights whose handles `payload` carries
    (shared_weights.pack). vLLM's worker maps them itself, in whichever process its model lives
    (the engine's own `load_weights` takes tensors); transformers loads them here."""
    if hasattr(engine, "llm"):   # VLLMEngine
        engine.llm.collective_rpc("load_shared_weights", args=(payload,))
        engine.llm.reset_prefix_cache()   # cached prefixes hold keys/values of the old weights
    else:
        engine.load_weights(pickle.loads(payload))
