"""HTTP retrieval server: the Search-R1 `/retrieve` API with cross-request batching.

Requests are validated on the event loop and queued; a worker thread owns the retriever (and its
GPU), so no part of it is ever entered from two threads at once. The worker takes whatever queued
requests fit into `max_batch` queries, waiting at most `max_wait_ms` for more, and answers them all
from one encode+search call. If that call fails, each request of the batch is retried alone, so one
bad request never fails the others. For retrievers with two stages (the dense ones) the worker is
pipelined by default (`pipeline`): one thread encodes a batch while a second looks up the batch
encoded before it, each stage owned by its thread. The queue is bounded (`max_pending` queries):
past it the server answers 503 with Retry-After instead of growing memory. With `--worker_process`
the retriever itself lives in a child process (`worker_process.ProcessRetriever`) and the worker
thread only passes batches to it.

Differences from the original server: `return_scores: false` works (documents only), bad input
gets a 4xx that says what is wrong, and `/health` and `/metrics` exist.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from pydantic import BaseModel, StrictBool, StrictInt, StrictStr

from search_r1.retrieval.base import Retriever

log = logging.getLogger(__name__)
disable_created_metrics()  # keep /metrics to the series people graph


@dataclass
class ServerConfig:
    topk: int = 3                   # default when a request gives none
    max_topk: int = 100
    max_queries_per_request: int = 1024
    max_query_chars: int = 2048
    max_batch: int = 512            # queries per encode+search call
    max_wait_ms: float = 2.0        # how long the worker waits to fill a batch
    max_pending: int = 16384        # queries queued before the server sheds load
    api_key: str | None = None
    switch_interval_s: float = 0.0005  # GIL hand-over; see serve()
    # Two-stage retrievers: encode a batch while the last is searched. On an H100 over 21M passages
    # it served 1.10-1.19x the queries/s at 256 clients and the same as one thread at 64-128; on
    # two CPU cores the same as one thread (benchmarks/RESULTS.md, "Whole server").
    pipeline: bool = True


class RetrieveRequest(BaseModel):
    queries: list[StrictStr]
    topk: StrictInt | None = None
    return_scores: StrictBool = False


class BadRequest(Exception):
    pass


@dataclass
class Job:
    queries: list[str]
    topk: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("retrieval_requests", "HTTP /retrieve requests", ["status"], registry=r)
        self.queries = Counter("retrieval_queries", "queries answered", registry=r)
        self.errors = Counter("retrieval_errors", "requests that failed inside the retriever", registry=r)
        self.rejected = Counter("retrieval_rejected", "requests shed because the queue was full", registry=r)
        self.batch_size = Histogram("retrieval_batch_queries", "queries per search call", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
        self.latency = Histogram("retrieval_request_seconds", "request latency", registry=r,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.search_time = Histogram("retrieval_search_seconds", "time of one search call", registry=r,
                                     buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        self.pending = Gauge("retrieval_pending_queries", "queries waiting in the queue", registry=r)


class Batcher:
    """The worker thread that owns the retriever, or the two that own its two stages."""

    def __init__(self, retriever: Retriever, cfg: ServerConfig, metrics: Metrics):
        self.retriever, self.cfg, self.metrics = retriever, cfg, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.pending = 0  # queries queued or in flight; changed under the lock
        self.lock = threading.Lock()
        self.pipelined = cfg.pipeline and retriever.two_stage
        if self.pipelined:
            # One encoded batch waits at most: the encoder runs at most one batch ahead.
            self.encoded: queue.Queue[list[tuple[Job, object]] | None] = queue.Queue(maxsize=1)
            self.threads = [threading.Thread(target=self._run_encode, name="retrieval-encoder", daemon=True),
                            threading.Thread(target=self._run_lookup, name="retrieval-worker", daemon=True)]
        else:
            self.threads = [threading.Thread(target=self._run, name="retrieval-worker", daemon=True)]

    def start(self):
        for t in self.threads:
            t.start()

    def stop(self):
        self.jobs.put(None)  # the encoder passes it on to the lookup thread
        for t in self.threads:
            t.join(timeout=10)

    def alive(self) -> bool:
        return all(t.is_alive() for t in self.threads)

    def submit(self, job: Job) -> bool:
        with self.lock:
            if self.pending + len(job.queries) > self.cfg.max_pending:
                return False
            self.pending += len(job.queries)
            self.metrics.pending.set(self.pending)
        self.jobs.put(job)
        return True

    def _next_batch(self) -> list[Job] | None:
        first = self.jobs.get()
        if first is None:
            return None
        batch, n = [first], len(first.queries)
        deadline = time.monotonic() + self.cfg.max_wait_ms / 1000
        while n < self.cfg.max_batch:
            try:
                job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                self.jobs.put(None)  # keep the stop signal for the outer loop
                break
            batch.append(job)
            n += len(job.queries)
        return batch

    def _run(self):
        while (batch := self._next_batch()) is not None:
            try:
                topk = max(j.topk for j in batch)
                search = partial(self._timed, self.retriever.search, topk=topk)
                self._answer(batch, self._per_job([j.queries for j in batch], _concat, search))
            except Exception:  # a bug here must not kill the only worker
                log.exception("retrieval worker failed on a batch")
            finally:
                self._release(batch)

    def _run_encode(self):
        while (batch := self._next_batch()) is not None:
            try:
                encoded = self._per_job([j.queries for j in batch], _concat, self.retriever.encode)
                failed = [(j, e) for j, e in zip(batch, encoded) if isinstance(e, Exception)]
                self._answer([j for j, _ in failed], [e for _, e in failed])
                self._release([j for j, _ in failed])
                if len(failed) < len(batch):
                    self.encoded.put([(j, e) for j, e in zip(batch, encoded) if not isinstance(e, Exception)])
            except Exception:  # a bug here must not kill the worker
                log.exception("retrieval encoder failed on a batch")
                self._release(batch)
        self.encoded.put(None)

    def _run_lookup(self):
        while (items := self.encoded.get()) is not None:
            batch = [j for j, _ in items]
            try:
                topk = max(j.topk for j in batch)
                lookup = partial(self._timed, self.retriever.lookup, topk=topk)
                self._answer(batch, self._per_job([e for _, e in items], np.concatenate, lookup))
            except Exception:  # a bug here must not kill the worker
                log.exception("retrieval worker failed on a batch")
            finally:
                self._release(batch)

    def _per_job(self, parts: list, join, fn) -> list:
        """fn over the jobs' parts joined, cut back into one result per job. If that call fails, fn
        runs over each part alone and a job whose own call fails gets the exception as its result:
        one bad request never fails the others."""
        try:
            out, n = fn(join(parts)), sum(len(p) for p in parts)
            if len(out) != n:
                raise RuntimeError(f"retriever returned {len(out)} results for {n} queries")
        except Exception as e:
            if len(parts) == 1:
                log.exception("retrieval failed for a request of %d queries", len(parts[0]))
                return [e]
            return [self._per_job([p], join, fn)[0] for p in parts]
        ends = np.cumsum([len(p) for p in parts])
        return [out[end - len(p):end] for p, end in zip(parts, ends)]

    def _timed(self, fn, batch, topk):
        t = time.perf_counter()
        results = fn(batch, topk)
        self.metrics.search_time.observe(time.perf_counter() - t)
        self.metrics.batch_size.observe(len(batch))
        return results

    def _answer(self, batch: list[Job], results: list):
        for job, hits in zip(batch, results):
            if isinstance(hits, Exception):
                self._resolve(job, exc=RuntimeError("search failed; see the server log"))
            else:
                self._resolve(job, [h[:job.topk] for h in hits])

    def _release(self, batch: list[Job]):
        with self.lock:
            self.pending -= sum(len(j.queries) for j in batch)
            self.metrics.pending.set(self.pending)

    @staticmethod
    def _resolve(job: Job, hits=None, exc: Exception | None = None):
        def done():
            if job.future.done():  # the client went away
                return
            if exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(hits)
        job.loop.call_soon_threadsafe(done)


def _concat(parts: list[list]) -> list:
    return [x for part in parts for x in part]


def _validate(req: RetrieveRequest, cfg: ServerConfig) -> int:
    if not req.queries:
        raise BadRequest("`queries` must be a non-empty list of strings")
    if len(req.queries) > cfg.max_queries_per_request:
        raise BadRequest(f"{len(req.queries)} queries in one request; the limit is "
                         f"{cfg.max_queries_per_request} (split the request)")
    for i, q in enumerate(req.queries):
        if not q.strip():
            raise BadRequest(f"queries[{i}] is empty")
        if len(q) > cfg.max_query_chars:
            raise BadRequest(f"queries[{i}] has {len(q)} characters; the limit is {cfg.max_query_chars}")
    topk = cfg.topk if req.topk is None else req.topk
    if not 1 <= topk <= cfg.max_topk:
        raise BadRequest(f"topk must be between 1 and {cfg.max_topk}, got {topk}")
    return topk


def create_app(retriever: Retriever, cfg: ServerConfig | None = None, name: str = "retriever") -> FastAPI:
    cfg = cfg or ServerConfig()
    cfg.max_topk = min(cfg.max_topk, getattr(retriever, "max_topk", cfg.max_topk))
    metrics = Metrics()
    batcher = Batcher(retriever, cfg, metrics)

    @asynccontextmanager
    async def lifespan(app):
        retriever.warmup()  # first-call costs (CUDA kernels, tuning) before the first request
        batcher.start()
        yield
        batcher.stop()

    app = FastAPI(title="Search-R1 retrieval", lifespan=lifespan)
    app.state.batcher = batcher

    def error(status: int, message: str, **headers) -> JSONResponse:
        metrics.requests.labels(str(status)).inc()
        return JSONResponse({"error": message}, status_code=status, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}"
                             for e in exc.errors())
        return error(422, f"invalid request: {problems}. Expected "
                          '{"queries": [str, ...], "topk": int, "return_scores": bool}')

    @app.post("/retrieve")
    async def retrieve(req: RetrieveRequest, request: Request):
        t0 = time.perf_counter()
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return error(401, "missing or wrong bearer token (Authorization: Bearer <api key>)")
        try:
            topk = _validate(req, cfg)
        except BadRequest as e:
            return error(400, str(e))
        loop = asyncio.get_running_loop()
        job = Job(req.queries, topk, loop.create_future(), loop, time.monotonic())
        if not batcher.submit(job):
            metrics.rejected.inc()
            return error(503, "server busy: too many queued queries, retry later", **{"Retry-After": "1"})
        try:
            hits = await job.future
        except Exception as e:
            metrics.errors.inc()
            return error(500, str(e))
        body = json.dumps({"result": [[h.to_api(req.return_scores) for h in hs] for hs in hits]},
                          ensure_ascii=False)
        metrics.requests.labels("200").inc()
        metrics.queries.inc(len(req.queries))
        metrics.latency.observe(time.perf_counter() - t0)
        # A ready-made body: FastAPI's generic encoder walks every nested dict in Python and was
        # the server's bottleneck under load.
        return Response(body, media_type="application/json")

    @app.get("/health")
    async def health():
        return {"status": "ok", "retriever": name, "pending_queries": batcher.pending,
                "worker_alive": batcher.alive(), "pipelined": batcher.pipelined, "stats": retriever.stats()}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    return app


def parallel_tokenizers() -> None:
    """Let the Rust tokenizer use every core in this process (and the worker process it starts).

    A shell or training setup often exports TOKENIZERS_PARALLELISM=false (it silences a warning
    about forking); in a server that never forks it only slows encoding: 512 queries took 17 ms
    to tokenise instead of 3 ms on a 16-core node (benchmarks/RESULTS.md, "The query encoder")."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "true").lower() not in ("1", "true", "yes", "on"):
        log.info("TOKENIZERS_PARALLELISM=%s ignored: the server tokenises queries in parallel",
                 os.environ["TOKENIZERS_PARALLELISM"])
    os.environ["TOKENIZERS_PARALLELISM"] = "true"


def serve(retriever: Retriever, cfg: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          name: str = "retriever"):
    import uvicorn

    app = create_app(retriever, cfg, name)
    # The event loop (HTTP, JSON) and the worker (kernel launches) share the GIL. Under load the
    # worker waited up to the default 5 ms switch interval for each hand-over, which made
    # encoding several times slower; a shorter interval lets it in sooner.
    sys.setswitchinterval(cfg.switch_interval_s)
    log.info("serving %s on http://%s:%d/retrieve", name, host, port)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
