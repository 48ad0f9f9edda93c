"""Both Triton block-max kernels run on the CPU through Triton's interpreter, so their indexing
(tiles, the persistent loop, out-of-range rows, the block reduction) is checked without a GPU.
Speed and the GPU's own constraints (TMA alignment, shared memory) are the GPU tests' part."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch, triton
from search_r1.retrieval import triton_blockmax as tb
torch.manual_seed(0)
B, D = 40, 64
n_rows = 128 * 7 + 3          # a partial tile of vectors and rows after the last whole block
n_full = n_rows // 128 * 128
q = torch.randn(B, D).half()
x = torch.randn(n_rows, D).half()
ref = (q.float() @ x[:n_full].float().T).view(B, -1, 128).amax(2)
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
for name, kernel, grid, extra in [
        ("pointer", tb._blockmax_kernel, (2 * 4,), {}),
        ("tma", tb._blockmax_kernel_tma, (3,), {"NUM_PROGRAMS": 3})]:  # 3 programs walk 8 tiles
    out = torch.full((B, n_full // 128), float("nan"), dtype=x.dtype)
    kernel.fn[grid](q, x, out, B, 64, n_full, n_full // 128, D, BM=32, BN=256, BK=32, SUB=128, **extra)
    err = (out.float() - ref).abs().max().item()
    assert err < 0.02, (name, err)   # fp16 rounding of the stored maxima
    print(name, "ok", err)
"""


def test_kernels_match_block_maxima_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pointer ok" in done.stdout and "tma ok" in done.stdout
