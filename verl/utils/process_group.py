"""The process group's primitives, shared by the workers and the checkpoint store: joining it, who
this process is in it, and the few collectives that run without a tensor of the caller's. Each works
without a process group too, as the one process of a world of one."""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


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


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def comm_device() -> torch.device:
    """Device for tensors we all-reduce ourselves: NCCL only moves CUDA tensors, gloo CPU ones."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_scalar(value: float, op=dist.ReduceOp.SUM) -> float:
    """A python number reduced over all ranks (unchanged without a process group)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=op)
    return t.item()


def gather_objects(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order (a list of one without a process group)."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed `what` (and wait for all ranks otherwise): a rank
    that raised alone would leave the others waiting forever in the next collective."""
    failures = [f for f in gather_objects(None if error is None else f"rank {rank()}: {error!r}") if f]
    if error is not None:
        raise error
    if failures:
        raise RuntimeError(f"{what} failed on {failures[0]}")
