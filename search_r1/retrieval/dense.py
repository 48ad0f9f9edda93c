"""Exact inner-product search in PyTorch, and the dense retriever built on it.

Vectors live on the GPUs they are given (fp16/bf16, split into one shard per GPU) or on the CPU
(fp32). Search never materialises the full B×N score matrix: it walks the vectors in chunks.

On GPU we use a block-max prefilter that stays exact: scores of each chunk are reduced to the
maximum of every block of `BLOCK` consecutive rows, the k best blocks are chosen, and only their
rows are re-scored. The k best rows always lie in the k blocks with the highest maxima (each of the
k best rows lifts its own block's maximum at least to its score), so the result equals a full
top-k while `topk` only ever runs over N/BLOCK numbers instead of N.

Vector files: our own compact format is a `.npy` fp16 matrix (memory-mapped, written by
`search-r1 index build`); a published FAISS flat file (`e5_Flat.index`, fp32) is read by parsing
its header and memory-mapping the vector block, so 65 GB never has to fit in RAM at once.
"""
from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
from pathlib import Path

import numpy as np
import torch

from search_r1.retrieval.base import Hit, Retriever
from search_r1.retrieval.corpus import Corpus

log = logging.getLogger(__name__)

BLOCK = 128
SCORE_BUDGET_BYTES = 1 << 30  # per-chunk score matrix on GPU


# ---------------------------------------------------------------------------------------------
# Vector files
# ---------------------------------------------------------------------------------------------

FLAT_FOURCC = {b"IxFI": "ip", b"IxF2": "l2"}


def read_faiss_flat(path: str | os.PathLike) -> np.ndarray:
    """Memory-map the vectors of a FAISS IndexFlatIP/L2 file without loading it.

    Layout: fourcc, d:int32, ntotal:int64, two unused int64, is_trained:uint8, metric:int32,
    [metric_arg:float32 if metric > 1], n_floats:uint64, then n_floats float32 values.
    """
    with open(path, "rb") as f:
        head = f.read(64)
    fourcc = head[:4]
    if fourcc not in FLAT_FOURCC:
        raise ValueError(f"{path} is not a FAISS flat index (header {fourcc!r}); "
                         "use --retriever_backend faiss for HNSW/IVF/PQ indexes")
    d, ntotal = struct.unpack_from("<iq", head, 4)
    metric = struct.unpack_from("<i", head, 4 + 4 + 8 + 16 + 1)[0]
    off = 4 + 4 + 8 + 16 + 1 + 4 + (4 if metric > 1 else 0)
    n_floats = struct.unpack_from("<Q", head, off)[0]
    if n_floats != d * ntotal:
        raise ValueError(f"{path}: header says {ntotal}×{d} vectors but holds {n_floats} floats")
    return np.memmap(path, dtype=np.float32, mode="r", offset=off + 8, shape=(ntotal, d))


def load_vectors(path: str | os.PathLike) -> np.ndarray:
    """(N, D) vectors from our `.npy` format or a FAISS flat file, memory-mapped."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"index file {path} does not exist")
    if path.is_dir():
        path = path / "embeddings.npy"
    if path.suffix == ".npy":
        meta = path.with_name("index_meta.json")
        if meta.exists() and not json.loads(meta.read_text()).get("complete", True):
            raise ValueError(f"{path} is only partly built; rerun `search-r1 index build` to resume")
        return np.load(path, mmap_mode="r")
    return read_faiss_flat(path)


# ---------------------------------------------------------------------------------------------
# Exact search
# ---------------------------------------------------------------------------------------------

class ExactIndex:
    """Exact top-k by inner product over vectors sharded across `devices`."""

    def __init__(self, vectors: np.ndarray | torch.Tensor, devices: list[str] | None = None,
                 dtype: str | None = None, load_rows: int = 1 << 20, fp8_prefilter: bool = False,
                 fp8_shortlist: int = 8):
        devices = devices or (["cuda"] if torch.cuda.is_available() else ["cpu"])
        on_gpu = devices[0].startswith("cuda")
        self.dtype = getattr(torch, dtype) if dtype else (torch.float16 if on_gpu else torch.float32)
        self.n, self.dim = vectors.shape
        bounds = np.linspace(0, self.n, len(devices) + 1).astype(np.int64)
        self.shards: list[tuple[int, torch.Tensor]] = []
        for dev, lo, hi in zip(devices, bounds[:-1], bounds[1:]):
            if torch.is_tensor(vectors) and vectors.device == torch.device(dev) and vectors.dtype == self.dtype:
                self.shards.append((int(lo), vectors[lo:hi]))  # already in place: no copy
                continue
            x = torch.empty((int(hi - lo), self.dim), dtype=self.dtype, device=dev)
            for a in range(lo, hi, load_rows):  # chunked copy: the file is never read whole
                b = min(a + load_rows, hi)
                part = vectors[a:b] if torch.is_tensor(vectors) else torch.from_numpy(np.array(vectors[a:b]))
                x[a - lo:b - lo] = part.to(dev, self.dtype)
            self.shards.append((int(lo), x))
        # Optional FP8 copy for scoring at twice the tensor-core rate; see _search_fp8.
        self.fp8 = [_to_fp8(x) for _, x in self.shards] if fp8_prefilter and on_gpu else None
        self.fp8_shortlist = fp8_shortlist
        if on_gpu and _fused_kernel_available(self.shards[0][1]):
            self._tune_fused_kernel()
        log.info("exact index: %s vectors × %d on %s (%s)", f"{self.n:,}", self.dim, devices, self.dtype)

    @torch.inference_mode()
    def _tune_fused_kernel(self):
        """Autotune the Triton kernel for each batch-size bucket now, not during the first requests."""
        from search_r1.retrieval.triton_blockmax import BUCKETS
        t = time.perf_counter()
        for b in BUCKETS:
            self.search(np.zeros((b, self.dim), dtype=np.float32), 1)
        log.info("tuned the fused search kernel in %.1f s", time.perf_counter() - t)

    @torch.inference_mode()
    def search(self, q_BD: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Scores (B, k) float32 and row ids (B, k) int64, best first."""
        k = min(k, self.n)
        results = []
        for j, (offset, x) in enumerate(self.shards):  # kernels of different GPUs run concurrently
            q = torch.from_numpy(np.asarray(q_BD, dtype=np.float32)).to(x.device, self.dtype)
            if self.fp8:
                s, i = _search_fp8(x, *self.fp8[j], q, min(k, len(x)), self.fp8_shortlist)
            elif x.is_cuda:
                s, i = _search_blockmax(x, q, min(k, len(x)))
            else:
                s, i = _search_chunked(x, q, min(k, len(x)))
            results.append((s, i + offset))
        scores = torch.cat([s.float().cpu() for s, _ in results], dim=1)
        ids = torch.cat([i.cpu() for _, i in results], dim=1)
        top_s, pos = scores.topk(k, dim=1)
        return top_s.numpy(), ids.gather(1, pos).numpy()


def _search_chunked(x_ND: torch.Tensor, q_BD: torch.Tensor, k: int, chunk: int = 1 << 16):
    """Running top-k over chunks (CPU path; also the reference the GPU path is tested against)."""
    best_s = torch.full((len(q_BD), 0), -math.inf, dtype=x_ND.dtype, device=x_ND.device)
    best_i = torch.zeros((len(q_BD), 0), dtype=torch.int64, device=x_ND.device)
    for lo in range(0, len(x_ND), chunk):
        s_BC = q_BD @ x_ND[lo:lo + chunk].T
        s, i = s_BC.topk(min(k, s_BC.shape[1]), dim=1)
        best_s, pos = torch.cat([best_s, s], 1).topk(min(k, best_s.shape[1] + s.shape[1]), dim=1)
        best_i = torch.cat([best_i, i + lo], 1).gather(1, pos)
    return best_s, best_i


def _fused_kernel_available(x_ND: torch.Tensor) -> bool:
    if not x_ND.is_cuda or x_ND.shape[1] % 64 or x_ND.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _search_blockmax(x_ND: torch.Tensor, q_BD: torch.Tensor, k: int, fused: bool | None = None,
                     kernel: str = "auto"):
    n_full = (len(x_ND) // BLOCK) * BLOCK
    if n_full < k * BLOCK:  # tiny shard: the prefilter would not save anything
        return _search_chunked(x_ND, q_BD, k)
    if fused is None:
        fused = _fused_kernel_available(x_ND)
    if fused:  # scores never leave registers; see triton_blockmax.py
        from search_r1.retrieval.triton_blockmax import block_maxima
        blockmax_BM = block_maxima(q_BD, x_ND, n_full, kernel)
    else:
        blockmax_BM = _block_maxima(lambda lo, hi: q_BD @ x_ND[lo:hi].T, len(q_BD), n_full, x_ND)
    return _rescore_blocks(x_ND, q_BD, blockmax_BM.topk(k, dim=1).indices, k, n_full)


def _block_maxima(score_fn, B: int, n_full: int, x_ND: torch.Tensor) -> torch.Tensor:
    rows_per_chunk = max(BLOCK, (SCORE_BUDGET_BYTES // (2 * B)) // BLOCK * BLOCK)
    blockmax_BM = torch.empty((B, n_full // BLOCK), dtype=x_ND.dtype, device=x_ND.device)
    for lo in range(0, n_full, rows_per_chunk):
        hi = min(lo + rows_per_chunk, n_full)
        blockmax_BM[:, lo // BLOCK:hi // BLOCK] = score_fn(lo, hi)[:B].view(B, -1, BLOCK).amax(dim=2)
    return blockmax_BM


def _rescore_blocks(x_ND, q_BD, top_blocks_BK, k, n_full):
    """Exact scores of every row of the chosen blocks (and of the rows after the last block)."""
    B = len(q_BD)
    rows_BR = (top_blocks_BK[:, :, None] * BLOCK
               + torch.arange(BLOCK, device=x_ND.device)).reshape(B, -1)
    if n_full < len(x_ND):  # rows after the last whole block are always candidates
        tail = torch.arange(n_full, len(x_ND), device=x_ND.device).expand(B, -1)
        rows_BR = torch.cat([rows_BR, tail], dim=1)
    cand_BRD = x_ND[rows_BR]
    s_BR = torch.bmm(cand_BRD, q_BD[:, :, None]).squeeze(2)
    s, pos = s_BR.topk(k, dim=1)
    return s, rows_BR.gather(1, pos)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _to_fp8(x_ND: torch.Tensor, rows: int = 1 << 20):
    scale = (x_ND.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    x8 = torch.empty(x_ND.shape, dtype=torch.float8_e4m3fn, device=x_ND.device)
    for lo in range(0, len(x_ND), rows):
        x8[lo:lo + rows] = (x_ND[lo:lo + rows].float() / scale).to(torch.float8_e4m3fn)
    return x8, scale


def _search_fp8(x_ND, x8_ND, x_scale, q_BD, k: int, shortlist: int):
    """Approximate block maxima from FP8 scores, then exact fp16 re-scoring of the best
    `k * shortlist` blocks. Not exact: FP8 rounding can demote a true top-k block below the
    shortlist; the benchmark reports its recall against the exact path."""
    n_full = (len(x_ND) // BLOCK) * BLOCK
    n_blocks = min(k * shortlist, n_full // BLOCK)
    if n_blocks < k:
        return _search_chunked(x_ND, q_BD, k)
    B = len(q_BD)
    q_scale = (q_BD.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    q8 = torch.zeros(((B + 15) // 16 * 16, q_BD.shape[1]), dtype=torch.float8_e4m3fn, device=q_BD.device)
    q8[:B] = (q_BD.float() / q_scale).to(torch.float8_e4m3fn)  # _scaled_mm wants rows % 16 == 0
    blockmax_BM = _block_maxima(
        lambda lo, hi: torch._scaled_mm(q8, x8_ND[lo:hi].T, scale_a=q_scale, scale_b=x_scale,
                                        out_dtype=torch.bfloat16), B, n_full, x_ND)
    return _rescore_blocks(x_ND, q_BD, blockmax_BM.topk(n_blocks, dim=1).indices, k, n_full)


# ---------------------------------------------------------------------------------------------
# Retriever
# ---------------------------------------------------------------------------------------------

class DenseRetriever(Retriever):
    """Encoder + vector index + corpus; the index's row i is the corpus's row i."""

    two_stage = True  # encode (the encoder) | lookup (index + corpus)

    def __init__(self, encoder, index, corpus: Corpus, index_path: str = "?"):
        if index.n != len(corpus):
            raise ValueError(
                f"corpus {corpus.path} has {len(corpus):,} rows but index {index_path} has "
                f"{index.n:,} vectors: they must come from the same corpus file "
                "(rebuild with `search-r1 index build`)")
        if index.dim != encoder.dim:
            raise ValueError(f"index {index_path} holds {index.dim}-d vectors but the encoder "
                             f"makes {encoder.dim}-d ones: pass the encoder the index was built with")
        self.encoder, self.index, self.corpus = encoder, index, corpus
        self.seconds = {"encode": 0.0, "search": 0.0, "fetch": 0.0}
        self.calls = 0

    def stats(self) -> dict:
        return {"calls": self.calls, "seconds": {k: round(v, 3) for k, v in self.seconds.items()}}

    def warmup(self) -> None:
        # Every (batch, length) graph now: a capture while serving would stall, and in the
        # pipelined server it would run beside the other thread's searches.
        self.encoder.warmup(longest=self.encoder.max_length)
        for b in (1, 8, 64, 512):
            self.search(["warm-up query"] * b, 3)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        return self.lookup(self.encode(queries), topk)

    def encode(self, queries: list[str]) -> np.ndarray:
        t0 = time.perf_counter()
        q_BD = self.encoder.encode_queries(queries)
        self.seconds["encode"] += time.perf_counter() - t0
        return q_BD

    def lookup(self, q_BD: np.ndarray, topk: int) -> list[list[Hit]]:
        t1 = time.perf_counter()
        scores_BK, ids_BK = self.index.search(q_BD, topk)
        t2 = time.perf_counter()
        valid_BK = ids_BK >= 0  # FAISS marks missing results with -1
        passages = iter(self.corpus.get_many(ids_BK[valid_BK].tolist()))
        hits = [[Hit(next(passages), float(scores_BK[b, j]))
                 for j in range(ids_BK.shape[1]) if valid_BK[b, j]]
                for b in range(len(q_BD))]
        self.calls += 1
        self.seconds["search"] += t2 - t1
        self.seconds["fetch"] += time.perf_counter() - t2
        return hits
