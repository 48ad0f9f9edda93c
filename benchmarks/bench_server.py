"""The whole retrieval server under load: queries/s and p50/p99 latency vs concurrent clients.

The server runs as its own process exactly as `search-r1 serve` runs it (FastAPI, uvicorn, the
batching worker, the encoder, the exact index, the memory-mapped corpus), over synthetic data:
N random unit vectors, a corpus of N short passages, and a BERT-base-shaped encoder with random
weights and a real tokenizer (the e5-base-v2 shape; weights do not change the cost). Clients run
in several processes so the load generator is not the bottleneck.

    python benchmarks/bench_server.py --n 21015324 --clients 1,16,64 --queries-per-request 8
    python benchmarks/bench_server.py --quick      # CPU smoke run (CI)

`--instant` swaps the encoder and index for a retriever that answers at once from the corpus:
what the HTTP side and the batching sustain alone. Every row carries the server process's CPU
time per request (all its threads; Linux).

`--serve` only runs the server (on `--port`, until stopped), e.g. as the retriever of a GRPO
benchmark in the paper's setting; `--devices cuda:0,…,cuda:7` shards the vectors over those GPUs
(21M × 768 fp16 is 32 GB: ≈ 4 GB each on 8), the encoder runs on the first.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time

import httpx
import numpy as np

from search_r1.retrieval.base import Hit, Retriever
from synthetic_retrieval import make_encoder_dir, make_vectors, random_query


def build_synthetic(n: int, dim: int, out_dir: str, tokenizer: str, encoder_layers: int):
    """Corpus (Arrow) and encoder dir (random BERT of the e5-base shape)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from search_r1.retrieval.corpus import SCHEMA

    os.makedirs(out_dir, exist_ok=True)
    corpus = os.path.join(out_dir, "corpus.arrow")
    if not os.path.exists(corpus):
        with pa.OSFile(corpus, "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as w:
            for lo in range(0, n, 1 << 20):
                ids = pa.array(np.arange(lo, min(n, lo + (1 << 20))).astype(str))
                contents = pc.binary_join_element_wise('"Passage ', ids,
                                                       '"\nSynthetic text of passage number ', ids, "")
                w.write_batch(pa.record_batch([ids, contents.cast(pa.large_string())], schema=SCHEMA))
    return corpus, make_encoder_dir(os.path.join(out_dir, "encoder-e5-shape"), tokenizer, dim, encoder_layers)


def devices_of(a) -> list[str]:
    """The devices of the vectors; the encoder runs on the first."""
    import torch
    return a.devices.split(",") if a.devices else ["cuda" if torch.cuda.is_available() and not a.quick else "cpu"]


def encoder_cuda_graphs(a) -> bool:
    """As `search-r1 serve` decides: on where the encoder runs on a GPU, unless the flag says."""
    return devices_of(a)[0].startswith("cuda") if a.encoder_cuda_graphs is None else a.encoder_cuda_graphs


def synthetic_retriever(a):
    """The dense retriever over the synthetic data (built in the server's process or, with
    --worker-process, in its worker process)."""
    import torch

    from search_r1.retrieval.corpus import Corpus
    from search_r1.retrieval.dense import DenseRetriever, ExactIndex
    from search_r1.retrieval.encoders import Encoder, EncoderSpec

    corpus, enc_dir = build_synthetic(a.n, a.dim, a.workdir, a.tokenizer, a.encoder_layers)
    devices = devices_of(a)
    dtype = torch.float16 if devices[0].startswith("cuda") else torch.float32
    # One device: made in place. Several: drawn on the first, held in host memory, then each shard
    # copied to its GPU.
    x = make_vectors(a.n, a.dim, devices[0], dtype, store=None if len(devices) == 1 else "cpu")
    index = ExactIndex(x, devices)
    del x
    encoder = Encoder(enc_dir, device=devices[0], spec=EncoderSpec.for_model("e5"), batch_size=512,
                      cuda_graphs=encoder_cuda_graphs(a))
    return DenseRetriever(encoder, index, Corpus(corpus), "synthetic")


class InstantRetriever(Retriever):
    """Hits at once, from the synthetic corpus (no encoder, no index): the server's own cost."""

    def __init__(self, corpus_path: str):
        from search_r1.retrieval.corpus import Corpus
        self.corpus = Corpus(corpus_path)

    def search(self, queries, topk):
        ids = [(sum(map(ord, q)) * 31 + j) % len(self.corpus) for q in queries for j in range(topk)]
        passages = iter(self.corpus.get_many(ids))
        return [[Hit(next(passages), 1.0 - j / topk) for j in range(topk)] for _ in queries]


def serve_synthetic(a):
    from search_r1.retrieval.server import ServerConfig, parallel_tokenizers, serve

    parallel_tokenizers()  # as `search-r1 serve`

    if a.instant:
        retriever = InstantRetriever(build_synthetic(a.n, a.dim, a.workdir, a.tokenizer, a.encoder_layers)[0])
    elif a.worker_process:
        from functools import partial

        from search_r1.retrieval.worker_process import ProcessRetriever
        retriever = ProcessRetriever(partial(synthetic_retriever, a))
    else:
        retriever = synthetic_retriever(a)
    serve(retriever, ServerConfig(max_batch=a.max_batch, max_wait_ms=a.max_wait_ms,
                                  max_pending=1 << 20, pipeline=a.pipeline), port=a.port, name="synthetic-e5")


def client_process(url, n_clients, q_per_req, duration, seed, results):
    async def one(i, lat):
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(timeout=60) as http:
            end = time.perf_counter() + duration
            while time.perf_counter() < end:
                qs = [random_query(rng, 4, 12) for _ in range(q_per_req)]
                t = time.perf_counter()
                r = await http.post(url, json={"queries": qs, "topk": 3, "return_scores": True})
                r.raise_for_status()
                lat.append(time.perf_counter() - t)

    async def run():
        lat = []
        await asyncio.gather(*[one(i, lat) for i in range(n_clients)])
        return lat

    results.put(asyncio.run(run()))


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, all its threads (Linux /proc); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(url, clients, q_per_req, duration, procs):
    procs = min(procs, clients)
    results = mp.get_context("spawn").Queue()
    per = [clients // procs + (i < clients % procs) for i in range(procs)]
    ps = [mp.get_context("spawn").Process(target=client_process,
                                          args=(url, c, q_per_req, duration, i, results))
          for i, c in enumerate(per)]
    t = time.perf_counter()
    for p in ps:
        p.start()
    lat = [x for _ in ps for x in results.get()]
    wall = time.perf_counter() - t
    for p in ps:
        p.join()
    lat_ms = np.array(lat) * 1e3
    return {"clients": clients, "queries_per_request": q_per_req, "requests": len(lat),
            "qps": round(len(lat) * q_per_req / duration, 1),
            "p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
            "p99_ms": round(float(np.percentile(lat_ms, 99)), 2), "wall_s": round(wall, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=21_015_324)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--encoder-layers", type=int, default=12)
    p.add_argument("--tokenizer", default="all-MiniLM-L6-v2", help="any BERT-vocabulary tokenizer")
    p.add_argument("--clients", default="1,16,64")
    p.add_argument("--queries-per-request", type=int, default=8)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--client-procs", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--workdir", default="outputs/bench_server")
    p.add_argument("--quick", action="store_true", help="tiny CPU run (CI)")
    p.add_argument("--out", help="append results as JSON lines")
    p.add_argument("--devices", help="comma-separated devices to shard the vectors over (default: one GPU, "
                   "or the CPU); the encoder runs on the first")
    p.add_argument("--serve", action="store_true", help="only run the server, until stopped (no clients)")
    p.add_argument("--encoder-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="the query encoder from CUDA graphs (default, as `search-r1 serve`: on a GPU)")
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=True,
                   help="encode a batch while the last is searched (default, as `search-r1 serve`; "
                        "--no-pipeline: one thread does both)")
    p.add_argument("--instant", action="store_true",
                   help="a retriever that answers at once from the corpus: the HTTP side and batching alone")
    p.add_argument("--worker-process", action="store_true",
                   help="the retriever in a process of its own (`search-r1 serve --worker_process`)")
    a = p.parse_args(argv)
    from search_r1.retrieval.models import resolve_model
    a.tokenizer = resolve_model(a.tokenizer)
    if a.quick:
        a.n, a.dim, a.encoder_layers, a.clients, a.duration, a.client_procs = 5000, 64, 2, "1,4", 2.0, 2
    if a.serve:
        return serve_synthetic(a)
    args = [sys.executable, __file__, "--serve"] + [x for x in (argv or sys.argv[1:]) if x != "--serve"]
    args += ["--tokenizer", a.tokenizer]
    server = subprocess.Popen(args, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.getcwd(), os.environ.get("PYTHONPATH", "")])})
    url = f"http://127.0.0.1:{a.port}"
    try:
        t = time.perf_counter()
        while True:
            if server.poll() is not None:
                raise SystemExit("server exited during start-up")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        print(f"server ready in {time.perf_counter() - t:.1f} s", flush=True)
        rows = []
        for c in map(int, a.clients.split(",")):
            cpu0 = cpu_seconds(server.pid)
            row = {"n": a.n, "worker_process": a.worker_process, "encoder_cuda_graphs": encoder_cuda_graphs(a),
                   "pipeline": a.pipeline and not (a.worker_process or a.instant), "instant": a.instant,
                   **load(url + "/retrieve", c, a.queries_per_request, a.duration, a.client_procs)}
            if cpu0 is not None:
                row["server_cpu_ms_per_request"] = round((cpu_seconds(server.pid) - cpu0) / row["requests"] * 1e3, 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
        print("worker phases:", httpx.get(url + "/health").json().get("stats"))
        metrics = httpx.get(url + "/metrics").text
        print("\n".join(l for l in metrics.splitlines() if l.startswith("retrieval_batch_queries_sum")
                        or l.startswith("retrieval_batch_queries_count")))
        if a.out:
            with open(a.out, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
