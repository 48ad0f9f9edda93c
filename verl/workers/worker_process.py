"""What every worker process does, whatever its role: joining the process group at a rendezvous,
profiling a step, and how PyTorch's allocator holds GPU memory between the phases of a step."""
from __future__ import annotations

import os

import torch


def join_process_group(rank: int, world: int, addr: str, port: int, device: str):
    if world == 1:
        # One process: the roles run unsharded and no communicator is needed (creating an NCCL
        # one failed on a virtualised GPU node: "Failed to CUDA calloc async").
        return
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=addr, MASTER_PORT=str(port),
                      LOCAL_RANK="0")
    # NVLink multicast must stay off on shared hosts.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from verl.utils.process_group import init_distributed
    init_distributed()


def rendezvous() -> tuple[str, int]:
    """This node's address and a port free on it, for rank 0 to host the process group."""
    import socket

    import ray
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def release_cached_memory() -> dict:
    """After an update, give the blocks PyTorch's allocator keeps cached back to the GPU, so that
    what comes next on it can use them: the engine waking up, or, without sleep mode, other
    processes sharing the GPU (the cache of an update's peak would otherwise be held through the
    whole rollout). Returns the memory this process still holds, as a metric."""
    torch.cuda.empty_cache()
    return {"memory/after_update_reserved_gib": torch.cuda.memory_reserved() / 2**30}


def expandable_segments(on: bool) -> None:
    """Switch PyTorch's allocator to expandable segments (on) or back to fixed blocks (off). Training
    passes allocate tensors of a new length at every micro-batch; in fixed blocks the cache fragments
    and the update's reserved memory grew well past its allocated peak until a step ran out of memory.
    Off while the engine wakes and weights are pushed to it: vLLM's sleep mode refuses expandable
    segments, and the push hands CUDA IPC handles of its tensors to the engine's process. New blocks
    follow the setting; `release_cached_memory` returns the others after each update."""
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{on}")


class ProfiledWorker:
    """What the driver calls around a step of trainer.profile_steps (verl.utils.profiling)."""
    profiler = None

    def start_profile(self) -> None:
        from verl.utils.profiling import StepProfiler
        self.profiler = StepProfiler()
        self.profiler.start()

    def stop_profile(self, path_prefix: str) -> list[str]:
        return self.profiler.stop(path_prefix)
