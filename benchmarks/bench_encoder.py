"""The query encoder alone: milliseconds per batch, eager vs replayed from CUDA graphs.

The retrieval server spends most of its time encoding (benchmarks/RESULTS.md, "Whole server"):
≈ 30 ms for a batch of ≈ 190 short queries with a BERT-base (e5-base-shaped) encoder, far above
what the GPU needs for ≈ 4k tokens. This times `Encoder.encode_queries` as the server calls it —
tokenising, copying to the GPU, the forward pass, pooling, copying back — for several batch sizes,
and the same with `cuda_graphs=True`, plus the tokeniser alone: the encoder's own path (the Rust
tokenizer's `encode_batch`) and the transformers call it replaces. TOKENIZERS_PARALLELISM=false
makes the Rust tokenizer single-threaded; rows record the setting. Each row also gives the smallest
cosine between the two encoders' vectors of the same queries (1.0 = equal). The model has random
weights of the e5-base shape with MiniLM's (BERT) tokenizer; weights do not change the cost.

    python benchmarks/bench_encoder.py --batches 1,8,64,190,512       # a GPU
    python benchmarks/bench_encoder.py --quick                         # CPU smoke run (CI): eager only
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the package, then the benchmarks' shared modules

from result_rows import emit_row  # noqa: E402
from synthetic_retrieval import make_encoder_dir, random_query  # noqa: E402  (bench_server.py's queries and encoder)


def timed(fn, repeats: int, sync: bool) -> float:
    """Median milliseconds of one call."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64,190,512", help="queries per call, comma-separated")
    p.add_argument("--words", default="4,12", help="words per query: min,max (bench_server.py's queries)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--tokenizer", default="all-MiniLM-L6-v2", help="any BERT-vocabulary tokenizer")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--workdir", default="outputs/bench_encoder")
    p.add_argument("--quick", action="store_true", help="tiny CPU run (CI)")
    p.add_argument("--out", help="append results as JSON lines")
    a = p.parse_args(argv)
    from search_r1.retrieval.encoders import Encoder, EncoderSpec
    from search_r1.retrieval.models import resolve_model

    if a.quick:
        a.batches, a.dim, a.layers, a.repeats = "1,8", 64, 2, 3
    gpu = torch.cuda.is_available() and not a.quick
    device = "cuda" if gpu else "cpu"
    enc_dir = make_encoder_dir(os.path.join(a.workdir, f"bert_{a.dim}x{a.layers}"), resolve_model(a.tokenizer),
                               a.dim, a.layers)
    spec, lo_hi = EncoderSpec.for_model("e5"), tuple(map(int, a.words.split(",")))
    batches = [int(b) for b in a.batches.split(",")]
    encoders = {"eager": Encoder(enc_dir, device=device, spec=spec, batch_size=max(batches))}
    if gpu:
        encoders["cuda_graphs"] = Encoder(enc_dir, device=device, spec=spec, batch_size=max(batches),
                                          cuda_graphs=True)
    rng = random.Random(0)
    name = torch.cuda.get_device_name() if gpu else "cpu"
    for b in batches:
        texts = [random_query(rng, *lo_hi) for _ in range(b)]
        eager = encoders["eager"]
        prefixed = [spec.query_prefix + t for t in texts]
        tokenize_ms = timed(lambda: eager.tokenize(prefixed), a.repeats, sync=False)
        padded_length = eager.tokenize(prefixed)["input_ids"].shape[1]
        call_ms = timed(lambda: eager.tokenizer(prefixed, padding=True, truncation=True, max_length=eager.max_length,
                                                return_tensors="pt"), a.repeats, sync=False)
        ref = eager.encode_queries(texts)
        for mode, enc in encoders.items():
            t = time.perf_counter()
            vectors = enc.encode_queries(texts)  # first call: warm-up (and capture, for graphs)
            first_s = time.perf_counter() - t
            ms = timed(lambda: enc.encode_queries(texts), a.repeats, sync=gpu)
            row = {"bench": "encoder", "device": name, "dim": a.dim, "layers": a.layers, "batch": b,
                   "padded_length": padded_length, "mode": mode, "ms_per_call": round(ms, 3),
                   "queries_per_s": round(b / ms * 1e3, 1), "tokenize_ms": round(tokenize_ms, 3),
                   "tokenize_transformers_call_ms": round(call_ms, 3),
                   "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM", "unset"),
                   "first_call_s": round(first_s, 3),
                   "min_cosine_to_eager": round(float(np.min(np.sum(vectors * ref, axis=1))), 5)}
            if mode == "cuda_graphs":
                row["graphs"] = len(enc.graphs.graphs)
                row["capture_failed"] = enc.graphs.failed
            emit_row(row, a.out)


if __name__ == "__main__":
    main()
