"""Block maxima of Q·Xᵀ in one fused Triton kernel (GPU only).

The PyTorch path writes every score of a chunk to memory and reads it back to take the maximum
of each block of 128 rows: 2·B·N·2 bytes of extra traffic, a large share of the search time at
large batches (benchmarks/RESULTS.md, "Exact dense search"). Here each program computes a
(queries × BN rows) tile of scores in registers and stores only the maximum of each 128-row
block, so the search runs at close to the speed of the matmul itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.autotune(
    configs=[triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
             for bm, bn, bk, w, s in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
                                      (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
                                      (64, 128, 64, 4, 4), (256, 128, 64, 8, 4), (128, 256, 32, 8, 5)]],
    key=["B_BUCKET", "D"])
@triton.jit
def _blockmax_kernel(q_ptr, x_ptr, out_ptr, B, B_BUCKET, N_ROWS, N_BLOCKS, D: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(B, BM)
    # Query tiles vary fastest, so the programs that share a tile of vectors run side by side
    # and the vectors come from HBM once (later readers hit L2).
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)  # N·D overflows int32 at 21M rows
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, D, BK):
        q = tl.load(q_ptr + offs_m[:, None] * D + (k + offs_k)[None, :],
                    mask=offs_m[:, None] < B, other=0.0)
        x = tl.load(x_ptr + offs_n[:, None] * D + (k + offs_k)[None, :],
                    mask=offs_n[:, None] < N_ROWS, other=0.0)
        acc = tl.dot(q, tl.trans(x), acc)
    NB: tl.constexpr = BN // SUB
    block_max = tl.max(tl.reshape(acc, (BM, NB, SUB)), axis=2)
    offs_b = pid_n * NB + tl.arange(0, NB)
    tl.store(out_ptr + offs_m[:, None] * N_BLOCKS + offs_b[None, :],
             block_max.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < B) & (offs_b[None, :] < N_BLOCKS))


def batch_bucket(b: int) -> int:
    """Autotuning is keyed on this, not on the exact batch size: the server's batches take every
    size, and tuning anew for each one would cost seconds per new size."""
    return next((x for x in BUCKETS if b <= x), BUCKETS[-1])


BUCKETS = (16, 64, 256, 1024)


# The same block maxima with the tiles brought in by the Hopper tensor-memory accelerator (TMA)
# and one program per SM walking over tiles (persistent). At batch ≥ 256 the search is bound by
# the tensor cores, and the pointer kernel above stays below cuBLAS's matmul alone
# (benchmarks/RESULTS.md, "The TMA kernel"): its loads go through registers and every tile pays
# its own pipeline start. TMA copies straight into shared memory and the persistent loop lets the
# next tile's loads overlap this tile's epilogue.
@triton.autotune(
    configs=[triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
             for bm, bn, bk, w, s in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4),
                                      (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (128, 256, 128, 8, 2),
                                      (256, 128, 64, 8, 3)]],
    key=["B_BUCKET", "D"])
@triton.jit
def _blockmax_kernel_tma(q_ptr, x_ptr, out_ptr, B, B_BUCKET, N_ROWS, N_BLOCKS, D: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr,
                         NUM_PROGRAMS: tl.constexpr):
    # Out-of-range rows of either operand read as zeros (TMA bounds), so no load needs a mask.
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[B, D], strides=[D, 1], block_shape=[BM, BK])
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[N_ROWS, D], strides=[D, 1], block_shape=[BN, BK])
    num_m = tl.cdiv(B, BM)
    num_tiles = num_m * tl.cdiv(N_ROWS, BN)
    NB: tl.constexpr = BN // SUB
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m = tile % num_m  # query tiles fastest: a tile of vectors is read from HBM once
        pid_n = tile // num_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, D, BK):
            q = q_desc.load([pid_m * BM, k])
            x = x_desc.load([pid_n * BN, k])
            acc = tl.dot(q, x.T, acc)
        block_max = tl.max(tl.reshape(acc, (BM, NB, SUB)), axis=2)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_b = pid_n * NB + tl.arange(0, NB)
        tl.store(out_ptr + offs_m[:, None] * N_BLOCKS + offs_b[None, :],
                 block_max.to(out_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < B) & (offs_b[None, :] < N_BLOCKS))


def tma_available(x_ND: torch.Tensor) -> bool:
    """Hopper or newer, and a Triton with device-side tensor descriptors."""
    return (x_ND.is_cuda and torch.cuda.get_device_capability(x_ND.device)[0] >= 9
            and hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator"))


def _descriptor_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def block_maxima(q_BD: torch.Tensor, x_ND: torch.Tensor, n_full: int, kernel: str = "auto") -> torch.Tensor:
    """(B, n_full / 128) maxima of q·x over each block of 128 consecutive rows of x[:n_full].

    kernel: "pointer", "tma" (Hopper or newer: see tma_available), or "auto": tma for batches
    above 64, where it is the faster; at 64 the two are level, and below that the search is bound
    by reading the vectors once, which the pointer kernel already does at close to full memory
    bandwidth (benchmarks/RESULTS.md, "The TMA kernel")."""
    B, D = q_BD.shape
    assert n_full % BLOCK == 0 and D % 64 == 0 and x_ND.is_contiguous()
    q_BD = q_BD.contiguous()
    n_blocks = n_full // BLOCK
    out = torch.empty((B, n_blocks), dtype=x_ND.dtype, device=x_ND.device)
    if kernel == "auto":
        kernel = "tma" if B > 64 and tma_available(x_ND) else "pointer"
    # Triton launches on the current device, not on the one the tensors live on: a shard on
    # cuda:3 must make cuda:3 current, or its kernel runs on cuda:0 over another GPU's memory.
    with torch.cuda.device(x_ND.device):
        if kernel == "tma":
            triton.set_allocator(_descriptor_scratch)  # descriptors made on the device need scratch space
            programs = torch.cuda.get_device_properties(x_ND.device).multi_processor_count
            grid = lambda meta: (min(programs, triton.cdiv(B, meta["BM"]) * triton.cdiv(n_full, meta["BN"])),)
            _blockmax_kernel_tma[grid](q_BD, x_ND, out, B, batch_bucket(B), n_full, n_blocks, D, SUB=BLOCK,
                                       NUM_PROGRAMS=programs)
        else:
            grid = lambda meta: (triton.cdiv(B, meta["BM"]) * triton.cdiv(n_full, meta["BN"]),)
            _blockmax_kernel[grid](q_BD, x_ND, out, B, batch_bucket(B), n_full, n_blocks, D, SUB=BLOCK)
    return out
