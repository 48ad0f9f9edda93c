"""Exact dense search over synthetic N×D vectors: queries/s and latency per batch size.

Methods, all on the same vectors and queries:
  matmul    the score matmul alone, no top-k: the ceiling for exact fp16 search
  chunked   chunked matmul + top-k per chunk + merge (the plain approach)
  blockmax  exact: block maxima (matmul, then a max over each 128-row block), top-k blocks,
            exact re-score of their rows
  fused     the same with the block maxima from one fused Triton kernel (ExactIndex's GPU default)
  kernel    the fused kernel alone (no top-k, no re-score), to see what the rest costs
  fused_tma, kernel_tma   the same with the TMA kernel (Hopper or newer)
  fp8       FP8 block maxima + exact fp16 re-score of a shortlist (approximate; recall shown)

Each figure is also given as a fraction of the device's limits: dense fp16 tensor-core FLOP/s
and the HBM bandwidth needed to read the vectors once per batch.

    python benchmarks/bench_dense_search.py --n 21015324            # GPU
    python benchmarks/bench_dense_search.py --quick                 # CPU smoke run (CI)
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from search_r1.retrieval import dense
from synthetic_retrieval import make_vectors  # also the vectors of bench_server.py

# Dense (no sparsity) peaks from the vendor data sheets, SXM parts.
PEAKS = {"H100": {"fp16_tflops": 989.0, "hbm_tbps": 3.35}, "H200": {"fp16_tflops": 989.0, "hbm_tbps": 4.8}}


def device_peaks():
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAKS.items() if k in name), None)


def make_queries(x, b, seed=1):
    """Half near-duplicates of corpus rows (a clear best hit), half pure noise (a hard case)."""
    g = torch.Generator(device=x.device).manual_seed(seed)
    rows = torch.randint(0, len(x), (b // 2,), generator=g, device=x.device)
    near = x[rows].float() + 0.05 * torch.randn((b // 2, x.shape[1]), generator=g, device=x.device)
    noise = torch.randn((b - b // 2, x.shape[1]), generator=g, device=x.device)
    return torch.nn.functional.normalize(torch.cat([near, noise]), dim=1).to(x.dtype)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps, warmup=2):
    for _ in range(warmup):
        out = fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync()
    return (time.perf_counter() - t) / reps, out


def matmul_only(x, q):
    n_full = len(x) // dense.BLOCK * dense.BLOCK
    rows = max(dense.BLOCK, (dense.SCORE_BUDGET_BYTES // (2 * len(q))) // dense.BLOCK * dense.BLOCK)
    for lo in range(0, n_full, rows):
        s = q @ x[lo:min(lo + rows, n_full)].T
    return s


def fused_kernel_only(x, q, kernel):
    from search_r1.retrieval.triton_blockmax import block_maxima
    return block_maxima(q, x, len(x) // dense.BLOCK * dense.BLOCK, kernel)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=21_015_324)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batches", default="1,16,64,256,512,1024")
    p.add_argument("--methods", default="matmul,chunked,blockmax,fused,fp8")
    p.add_argument("--fp8-shortlist", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="tiny CPU run (CI)")
    p.add_argument("--out", help="write results as JSON lines")
    a = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not a.quick
    if a.quick:
        a.n, a.dim, a.batches, a.methods = 20_000, 64, "1,16", "matmul,chunked,blockmax"
    device, dtype = ("cuda", torch.float16) if gpu else ("cpu", torch.float32)
    peaks = device_peaks() if gpu else None
    x = make_vectors(a.n, a.dim, device, dtype)
    x8 = dense._to_fp8(x) if gpu and "fp8" in a.methods else None
    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"device {name}; {a.n:,} × {a.dim} {dtype}; top-{a.k}")
    rows = []
    for b in map(int, a.batches.split(",")):
        q = make_queries(x, b)
        _, exact = timed(lambda: dense._search_blockmax(x, q, a.k, fused=False), 1, warmup=0)
        exact_ids = exact[1].cpu()
        for method in a.methods.split(","):
            fn = {"matmul": lambda: matmul_only(x, q),
                  "chunked": lambda: dense._search_chunked(x, q, a.k, chunk=1 << 20 if gpu else 1 << 14),
                  "blockmax": lambda: dense._search_blockmax(x, q, a.k, fused=False),
                  "fused": lambda: dense._search_blockmax(x, q, a.k, fused=True, kernel="pointer"),
                  "kernel": lambda: fused_kernel_only(x, q, "pointer"),
                  "fused_tma": lambda: dense._search_blockmax(x, q, a.k, fused=True, kernel="tma"),
                  "kernel_tma": lambda: fused_kernel_only(x, q, "tma"),
                  "fp8": lambda: dense._search_fp8(x, *x8, q, a.k, a.fp8_shortlist)}[method]
            reps = 3 if gpu and b >= 256 else 5
            sec, out = timed(fn, reps)
            row = {"device": name, "n": a.n, "dim": a.dim, "k": a.k, "batch": b, "method": method,
                   "ms": round(sec * 1e3, 3), "qps": round(b / sec, 1)}
            if method not in ("matmul", "kernel", "kernel_tma"):
                got = out[1].cpu()
                row["recall"] = round(sum(len(set(g.tolist()) & set(e.tolist()))
                                          for g, e in zip(got, exact_ids)) / exact_ids.numel(), 4)
            if peaks:
                flops = 2 * b * a.n * a.dim / sec
                row["tflops"] = round(flops / 1e12, 1)
                row["frac_tensor_peak"] = round(flops / 1e12 / peaks["fp16_tflops"], 3)
                row["frac_hbm_read"] = round(a.n * a.dim * 2 / sec / 1e12 / peaks["hbm_tbps"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    main()
