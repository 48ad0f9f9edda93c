"""The workers' GPU memory after an update, on CUDA (skipped without it)."""
from __future__ import annotations

import pytest
import torch

from verl.workers.worker_process import release_cached_memory

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MIB = 1 << 20


def _leave_cached(mib: int) -> int:
    """Allocate and free `mib` MiB: PyTorch keeps the block cached. Returns what is reserved then."""
    block = torch.empty(mib * MIB, dtype=torch.uint8, device="cuda")
    del block
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved()


def test_an_updates_cache_goes_back_to_the_gpu():
    kept = torch.ones(MIB, device="cuda")  # something the worker still holds
    reserved = _leave_cached(512)
    free_before = torch.cuda.mem_get_info()[0]
    metrics = release_cached_memory()
    after = metrics["memory/after_update_reserved_gib"] * 2**30
    assert after == torch.cuda.memory_reserved()
    assert reserved - after >= 512 * MIB
    assert torch.cuda.mem_get_info()[0] - free_before >= 512 * MIB  # other processes can have it
    assert kept.sum().item() == MIB  # live tensors are untouched
