"""FAISS indexes (any `index_factory` string) with inner-product metric.

Used for approximate indexes (HNSW, IVF, PQ), including the published `e5_HNSW64.index`. For an
exact flat index the PyTorch `ExactIndex` is faster on GPU and needs no faiss-gpu build.
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def _faiss():
    try:
        import faiss
    except ImportError:
        raise ImportError("FAISS is not installed: `pip install faiss-cpu` "
                          "(or a faiss-gpu build on GPU nodes)") from None
    return faiss


class FaissIndex:
    def __init__(self, index, use_gpu: bool = False, search_params: dict | None = None):
        faiss = _faiss()
        if use_gpu:
            if not hasattr(faiss, "index_cpu_to_all_gpus") or faiss.get_num_gpus() == 0:
                raise RuntimeError("--faiss_gpu was given but this faiss build has no GPU support; "
                                   "install faiss-gpu or use the exact PyTorch index")
            co = faiss.GpuMultipleClonerOptions()
            co.useFloat16, co.shard = True, True
            index = faiss.index_cpu_to_all_gpus(index, co=co)
        self.index = index
        self.n, self.dim = index.ntotal, index.d
        for name, value in (search_params or {}).items():
            faiss.ParameterSpace().set_index_parameter(index, name, value)

    @classmethod
    def load(cls, path: str, use_gpu: bool = False, search_params: dict | None = None):
        faiss = _faiss()
        log.info("reading FAISS index %s", path)
        return cls(faiss.read_index(str(path)), use_gpu, search_params)

    def search(self, q_BD: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, self.n)
        scores, ids = self.index.search(np.ascontiguousarray(q_BD, dtype=np.float32), k)
        # Approximate indexes may return fewer than k results, marked by id -1; the retriever
        # drops those rows.
        return scores, ids


def build_faiss(vectors: np.ndarray, factory: str, train_rows: int = 1_000_000, seed: int = 0,
                add_rows: int = 1 << 18):
    """Train (on a random sample) and fill an index described by a FAISS factory string."""
    faiss = _faiss()
    n, d = vectors.shape
    index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        rng = np.random.default_rng(seed)
        sample = np.sort(rng.choice(n, size=min(n, train_rows), replace=False))
        index.train(np.ascontiguousarray(vectors[sample], dtype=np.float32))
    for lo in range(0, n, add_rows):
        index.add(np.ascontiguousarray(vectors[lo:lo + add_rows], dtype=np.float32))
    return index
