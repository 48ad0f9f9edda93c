"""Retrieval on CPU only: exact search, HNSW recall, BM25 and the dense retriever end to end.

For users who run the retrieval server without a GPU. One JSON line per measurement:
  exact      ExactIndex (PyTorch fp32: chunked matmul + top-k) and faiss.IndexFlatIP on synthetic
             N×768 unit vectors: queries/s and ms per batch. FAISS scans query by query unless
             batch × dim ≥ distance_compute_blas_threshold (128,000 in faiss 1.15, i.e. batches
             under 167 at 768-d), so it is also timed with the threshold at 0 (BLAS at any batch)
  hnsw       FAISS HNSW32 and HNSW64 (the published index is HNSW64), built with `build_faiss`:
             build time, then recall@k against exact search and queries/s at batch 64 for each
             efSearch; on synthetic vectors (queries: half noisy copies of corpus rows, half random
             directions, the hard case) and on MiniLM embeddings of the bundled corpus with the
             bundled test questions as queries
  embed      MiniLM passages/s (what building a dense index on CPU costs)
  bm25       build time and queries/s on the bundled corpus, and answer recall@k of BM25 and of
             exact dense MiniLM search on the bundled test questions (a hit: some retrieved passage
             is one of the question's `passage_ids`), so users see which retriever suits the task
  retriever  DenseRetriever (MiniLM + ExactIndex + Corpus) end to end: queries/s per batch, with
             torch on every core and on one (small batches pay OpenMP's cost of waking threads,
             which is large where other processes hold the cores)

Torch and FAISS use every core (os.cpu_count()) unless a line says otherwise; BM25 searches
single-threaded, as the server does.

    python benchmarks/bench_cpu_indexes.py --out cpu.jsonl
    python benchmarks/bench_cpu_indexes.py --quick            # tiny run (CI), < 30 s
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from search_r1.data.bundled import bundled_paths, read_jsonl
from search_r1.retrieval.bm25 import BM25Retriever, build_bm25
from search_r1.retrieval.corpus import Corpus, convert_jsonl
from search_r1.retrieval.dense import DenseRetriever, ExactIndex
from search_r1.retrieval.encoders import Encoder
from search_r1.retrieval.faiss_index import FaissIndex, _faiss, build_faiss
from search_r1.retrieval.models import resolve_model

BENCHES = ("exact", "hnsw", "bm25", "retriever")
MODEL = "all-MiniLM-L6-v2"
QUICK_QUESTIONS = 16     # --quick: test questions used, and a corpus cut down to ~120 rows
QUICK_CORPUS_HEAD = 100  # (the first rows, i.e. countries, plus the passages those questions need)


class Emitter:
    """Prints each measurement as one JSON line and appends it to --out.

    Each line carries the 1-minute load average: on a shared machine other processes take cores
    from the benchmark, and the figures are only comparable at similar load.
    """

    def __init__(self, out: str | None):
        self.device = f"cpu ({os.cpu_count()} cores)"
        self.out = out

    def __call__(self, bench: str, **fields) -> None:
        line = json.dumps({"device": self.device, "bench": bench, **fields,
                           "load_avg_1m": round(os.getloadavg()[0], 2)})
        print(line, flush=True)
        if self.out:
            with open(self.out, "a") as f:
                f.write(line + "\n")


# Timings are medians of single calls: on a shared machine a call that other processes slowed
# down then moves the figure less than it would move a mean.

def timed(fn, min_seconds: float, min_reps: int = 3) -> float:
    """Median seconds per call after one warm-up call; repeats until both minimums are met."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def timed_batches(fn, items: list, batch: int) -> tuple[float, int]:
    """Runs fn over consecutive batches of `items` (after one warm-up batch), so every item is
    seen once (the query text matters to BM25 and the encoder): (median seconds, batches)."""
    n_batches = max(1, len(items) // batch)
    items = (items * (1 + batch // max(1, len(items))))[:n_batches * batch]
    fn(items[:batch])
    times = []
    for lo in range(0, len(items), batch):
        t = time.perf_counter()
        fn(items[lo:lo + batch])
        times.append(time.perf_counter() - t)
    return float(np.median(times)), n_batches


def unit_vectors(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def synthetic_queries(x: np.ndarray, n: int, seed: int, noise: float = 0.5) -> np.ndarray:
    """Half noisy copies of corpus rows (noise of norm ≈ `noise`: a clear nearest neighbour),
    half random directions (no structure to exploit: the hard case for a graph index)."""
    rng = np.random.default_rng(seed)
    d = x.shape[1]
    near = x[rng.integers(0, len(x), n // 2)]
    near = near + (noise / np.sqrt(d)) * rng.standard_normal(near.shape, dtype=np.float32)
    q = np.concatenate([near, rng.standard_normal((n - n // 2, d), dtype=np.float32)])
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def recall_at_k(got_BK: np.ndarray, exact_BK: np.ndarray) -> float:
    """Share of the exact top-k ids that the approximate search also returned."""
    found = sum(len(set(g.tolist()) & set(e.tolist())) for g, e in zip(got_BK, exact_BK))
    return round(found / exact_BK.size, 4)


def bench_exact(emit: Emitter, n: int, d: int, k: int, batches: list[int], min_seconds: float):
    faiss = _faiss()
    x = unit_vectors(n, d, seed=0)
    index = ExactIndex(x, devices=["cpu"])  # fp32 on CPU
    flat = faiss.IndexFlatIP(d)
    flat.add(x)
    del x

    def flat_blas(q):
        default = faiss.cvar.distance_compute_blas_threshold
        faiss.cvar.distance_compute_blas_threshold = 0
        try:
            return flat.search(q, k)
        finally:
            faiss.cvar.distance_compute_blas_threshold = default

    for b in batches:
        q = unit_vectors(b, d, seed=1 + b)
        for method, fn in (("ExactIndex", lambda: index.search(q, k)),
                           ("faiss.IndexFlatIP", lambda: flat.search(q, k)),
                           ("faiss.IndexFlatIP, BLAS at any batch", lambda: flat_blas(q))):
            sec = timed(fn, min_seconds)
            emit("exact", method=method, n=n, dim=d, k=k, batch=b, dtype="float32",
                 ms_per_batch=round(sec * 1e3, 3), qps=round(b / sec, 1))


def bench_hnsw(emit: Emitter, source: str, x: np.ndarray, q: np.ndarray, k: int,
               factories: list[str], efs: list[int], batch: int, near_rows: int | None = None):
    """Build each HNSW index (FAISS's default efConstruction), then recall@k and recall@1
    against exact search and queries/s per efSearch.

    `near_rows`: the first that many queries are noisy copies of corpus rows; recall is then
    also given for them and for the rest separately.
    """
    _, exact = ExactIndex(x, devices=["cpu"]).search(q, k)
    batch = min(batch, len(q))
    for factory in factories:
        start = time.perf_counter()
        index = build_faiss(x, factory)
        build_s = time.perf_counter() - start
        emit("hnsw_build", source=source, index=factory, n=len(x), dim=x.shape[1],
             build_s=round(build_s, 3), rows_per_s=round(len(x) / build_s, 1))
        for ef in efs:
            searcher = FaissIndex(index, search_params={"efSearch": ef})
            searcher.search(q[:batch], k)  # warm-up
            ids, times = [], []
            for lo in range(0, len(q), batch):  # recall over every query, time over whole batches
                t = time.perf_counter()
                ids.append(searcher.search(q[lo:lo + batch], k)[1])
                if lo + batch <= len(q):
                    times.append(time.perf_counter() - t)
            sec = float(np.median(times))
            ids = np.concatenate(ids)
            row = dict(source=source, index=factory, n=len(x), dim=x.shape[1], k=k, ef_search=ef,
                       batch=batch, queries=len(ids), recall=recall_at_k(ids, exact),
                       recall_at_1=recall_at_k(ids[:, :1], exact[:, :1]),
                       qps=round(batch / sec, 1), ms_per_batch=round(sec * 1e3, 3))
            if near_rows:
                # For a noisy copy the exact top-1 is the row it was copied from; the other k-1
                # are as arbitrary as for a random query.
                row["recall_near_copies"] = recall_at_k(ids[:near_rows], exact[:near_rows])
                row["recall_at_1_near_copies"] = recall_at_k(ids[:near_rows, :1], exact[:near_rows, :1])
                row["recall_random"] = recall_at_k(ids[near_rows:], exact[near_rows:])
            emit("hnsw", **row)


def answer_recall(retriever, questions: list[dict], k: int, batch: int = 64) -> dict:
    """Share of questions where some top-k passage is one of `passage_ids`, overall and by hops."""
    hits_by_hops: dict[int, list[bool]] = {}
    for lo in range(0, len(questions), batch):
        part = questions[lo:lo + batch]
        for q, hits in zip(part, retriever.search([q["question"] for q in part], k)):
            found = any(h.passage.id in q["passage_ids"] for h in hits)
            hits_by_hops.setdefault(q["hops"], []).append(found)
    every = [h for hits in hits_by_hops.values() for h in hits]
    out = {"answer_recall": round(sum(every) / len(every), 4)}
    for hops, hits in sorted(hits_by_hops.items()):
        out[f"answer_recall_{hops}hop"] = round(sum(hits) / len(hits), 4)
    return out


def load_bundled(workdir: Path, quick: bool) -> tuple[Corpus, list[dict]]:
    """The bundled corpus as an Arrow file in `workdir`, and the test questions."""
    paths = bundled_paths()
    questions = read_jsonl(paths["test"])
    jsonl = paths["corpus"]
    if quick:
        questions = questions[:QUICK_QUESTIONS]
        needed = {pid for q in questions for pid in q["passage_ids"]}
        rows = [r for i, r in enumerate(read_jsonl(jsonl)) if i < QUICK_CORPUS_HEAD or r["id"] in needed]
        jsonl = workdir / "corpus.jsonl"
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Converted into workdir, not next to the bundled file inside the package.
    return Corpus(convert_jsonl(jsonl, workdir / "corpus.arrow", progress=False)), questions


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--benches", default=",".join(BENCHES), help=f"any of {','.join(BENCHES)}")
    p.add_argument("--n-exact", type=int, default=200_000)
    p.add_argument("--n-hnsw", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--hnsw-dim", type=int, default=768)
    p.add_argument("--hnsw-queries", type=int, default=1024)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--factories", default="HNSW32,HNSW64")
    p.add_argument("--ef-search", default="16,64,256")
    p.add_argument("--min-seconds", type=float, default=1.0, help="timing per exact-search figure")
    p.add_argument("--quick", action="store_true", help="tiny run (CI)")
    p.add_argument("--out", help="append results as JSON lines")
    a = p.parse_args(argv)
    if a.quick:
        a.n_exact, a.n_hnsw, a.hnsw_dim, a.hnsw_queries, a.min_seconds = 5_000, 5_000, 64, 128, 0.1
    benches = a.benches.split(",")
    unknown = set(benches) - set(BENCHES)
    if unknown:
        p.error(f"unknown --benches {sorted(unknown)}; choose from {','.join(BENCHES)}")
    batches = [int(b) for b in a.batches.split(",")]
    factories = a.factories.split(",")
    efs = [int(e) for e in a.ef_search.split(",")]

    torch.set_num_threads(os.cpu_count())
    _faiss().omp_set_num_threads(os.cpu_count())
    emit = Emitter(a.out)

    if "exact" in benches:
        bench_exact(emit, a.n_exact, a.dim, a.k, batches, a.min_seconds)
    if "hnsw" in benches:
        x = unit_vectors(a.n_hnsw, a.hnsw_dim, seed=2)
        q = synthetic_queries(x, a.hnsw_queries, seed=3)
        bench_hnsw(emit, "synthetic", x, q, a.k, factories, efs, batch=64,
                   near_rows=a.hnsw_queries // 2)
        del x
    if not {"hnsw", "bm25", "retriever"} & set(benches):
        return

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        corpus, questions = load_bundled(workdir, a.quick)
        texts = [q["question"] for q in questions]
        sizes = dict(corpus_rows=len(corpus), questions=len(questions))
        encoder = Encoder(resolve_model(MODEL), device="cpu")
        passages = [c for _, batch in corpus.iter_batches(4096) for c in batch]
        start = time.perf_counter()
        vectors = encoder.encode_passages(passages)
        embed_s = time.perf_counter() - start
        emit("embed", model=MODEL, dim=encoder.dim, rows=len(passages), seconds=round(embed_s, 2),
             passages_per_s=round(len(passages) / embed_s, 1))
        dense = DenseRetriever(encoder, ExactIndex(vectors, devices=["cpu"]), corpus)

        if "hnsw" in benches:
            bench_hnsw(emit, f"bundled corpus, {MODEL}", vectors, encoder.encode_queries(texts),
                       a.k, factories, efs, batch=64)

        if "bm25" in benches:
            start = time.perf_counter()
            build_bm25(corpus, workdir / "bm25", progress=False)
            build_s = time.perf_counter() - start
            bm25 = BM25Retriever(workdir / "bm25", corpus)
            emit("bm25_build", **sizes, build_s=round(build_s, 3))
            for b in (1, 64):
                sec, n_batches = timed_batches(lambda part: bm25.search(part, a.k), texts, b)
                emit("bm25", **sizes, k=a.k, batch=b, batches=n_batches, threads=bm25.threads,
                     ms_per_batch=round(sec * 1e3, 3), qps=round(b / sec, 1))
            for name, retriever in (("bm25", bm25), (f"dense exact {MODEL}", dense)):
                emit("answer_recall", retriever=name, **sizes, k=a.k,
                     **answer_recall(retriever, questions, a.k))

        if "retriever" in benches:
            for threads in sorted({os.cpu_count(), 1}, reverse=True):
                torch.set_num_threads(threads)
                for b in batches:
                    sec, n_batches = timed_batches(lambda part: dense.search(part, a.k), texts, b)
                    emit("retriever", retriever=f"DenseRetriever {MODEL} + ExactIndex fp32", **sizes,
                         k=a.k, batch=b, batches=n_batches, torch_threads=threads,
                         ms_per_batch=round(sec * 1e3, 3), qps=round(b / sec, 1))
            torch.set_num_threads(os.cpu_count())


if __name__ == "__main__":
    main()
