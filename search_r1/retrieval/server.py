"""HTTP retrieval server: the Search-R1 `/retrieve` API with cross-request batching.

Requests are validated on the event loop and queued; a worker thread owns the retriever (and its
GPU), so no part of it is ever entered from two threads at once. A request of more than `max_batch`
queries is queued as several jobs of at most `max_batch` each. The worker takes whatever queued
jobs fit into `max_batch` queries, waiting at most `max_wait_ms` for more, and answers them all
from one encode+search call. If that call fails, each job of the batch is retried alone, so one
bad request never fails the others. For retrievers with two stages (the dense ones) the worker is
pipelined by default (`pipeline`): one thread encodes a batch while a second looks up the batch
encoded before it, each stage owned by its thread. The queue is bounded (`max_pending` queries):
past it the server answers 503 with Retry-After instead of growing memory; an empty queue takes a
request of any allowed size whole. A request that says how long its client waits (`X-Timeout-S`)
is also refused with 503 when the queries ahead of it, at the rate the server answers while busy,
would outlast that wait: the queue holds what the server can answer in time, however fast it is.
That rate is timed at start-up on one batch of made-up queries (not for web engines, which charge
per query) and then follows the batches the last stage completes while work was waiting, so the
first burst after start is judged too. Work for a client that no longer waits is not done: a job
whose deadline passed, or that the last batches' duration says cannot finish before it, is dropped
before each stage (with the rest of its request), and the handler answers 504 at the deadline
itself. With `--worker_process` the retriever itself lives in a child
process (`worker_process.ProcessRetriever`) and the worker thread only passes batches to it.

Differences from the original server:
- `return_scores: false` works (each entry is the document alone, the shape ASearcher's and RLinf's
  clients read); the original failed on it.
- Each document is the whole corpus row, as in the original: extra fields such as `url` and
  `title` come back beside `id` and `contents`.
- `/access` with `--pages_path` (ASearcher's and RLinf's servers): `{"urls": [...]}` answers
  `{"result": [page row or null, ...]}`, one entry per URL in order. Unlike theirs, a URL asked again
  in the same request is read and sent once: its later entries are `{"url", "contents": "",
  "duplicate_of": i}`, i the index of its first entry. An answer over `max_access_response_bytes`
  is refused (413): a short request naming large pages must not make the server build gigabytes.
- Accepted as the original accepted them: `{"queries": []}` (→ `{"result": []}`), blank queries
  (what `<search> </search>` sends; BM25 finds nothing for them), requests of thousands of queries
  (up to `max_queries_per_request`), over-long queries (the encoder cuts them at its max length), and
  unknown body fields (ignored, each field name logged once as a warning: `return_score` is one).
- Refused with an answer that says why, all as `{"error": "..."}`: a body that is not JSON or not the
  request's shape (422), a query that is not valid Unicode such as a lone surrogate (400, before it
  reaches a batch), a `topk` out of range (400), more than `max_queries_per_request` queries, a query
  over `max_query_chars` characters or a body over `max_body_bytes` (413: split the request, do not
  retry it), a wrong API key (401), a POST body not sent as `Content-Type: application/json` (415:
  a web page may send `text/plain` across origins without asking, JSON it may not). These limits
  are far above what clients send; they stop abuse.
  Stricter than the original: `topk` must be a JSON integer of at least 1 and `return_scores` a JSON
  boolean (its lax pydantic model read "3" as 3 and "yes" as true, and it took topk 0 for the default).
- `/health` and `/metrics` exist.
"""
from __future__ import annotations

import asyncio
import difflib
import hmac
import json
import logging
import math
import os
import queue
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import StrEnum
from functools import partial

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.exceptions import HTTPException

from search_r1.retrieval.base import Retriever
from search_r1.retrieval.corpus import Pages, asearcher_url

log = logging.getLogger(__name__)
disable_created_metrics()  # keep /metrics to the series people graph


@dataclass
class ServerConfig:
    topk: int = 3                   # default when a request gives none
    max_topk: int = 100
    # The original Search-R1 sends every search of a turn in one request (train batch × rollouts:
    # thousands on an 8-GPU run); the cap is far above that and only stops abuse.
    max_queries_per_request: int = 65536
    # Only against abuse as well: a dense encoder cuts a query at its max length, as the original did.
    max_query_chars: int = 100_000
    max_body_bytes: int = 256 << 20
    # The most bytes one /access answer may hold. Pages run to megabytes: without a cap, a request
    # of a few kilobytes naming them thousands of times makes the server build gigabytes.
    max_access_response_bytes: int = 32 << 20
    max_batch: int = 512            # queries per encode+search call
    max_wait_ms: float = 2.0        # how long the worker waits to fill a batch
    max_pending: int = 16384        # queries queued before the server sheds load
    api_key: str | None = None
    switch_interval_s: float = 0.0005  # GIL hand-over; see serve()
    # Two-stage retrievers: encode a batch while the last is searched. On by default: on a GPU it
    # serves more queries/s than one thread under many concurrent clients and as many under fewer,
    # and on CPU as many (benchmarks/RESULTS.md, "Whole server").
    pipeline: bool = True
    # A connection waiting longer than this for a request's headers (a new connection, or one kept
    # alive after a response) is closed, and a request body that takes longer to arrive is refused
    # (408): slow clients (slowloris) cannot hold connections or handlers forever.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0


class RetrieveRequest(BaseModel):
    # Unknown fields are kept aside (and logged), not refused: the original accepted them.
    model_config = ConfigDict(extra="allow")
    queries: list[StrictStr]
    topk: StrictInt | None = None
    return_scores: StrictBool = False


class AccessRequest(BaseModel):
    """ASearcher's `/access`: pages by URL."""
    model_config = ConfigDict(extra="allow")
    urls: list[StrictStr]


class BadRequest(Exception):
    """A request the server refuses, with the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Job:
    queries: list[str]
    topk: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float
    deadline: float | None = None   # time.monotonic() after which the client no longer waits
    abandoned: bool = False         # the client went away or its request is answered 504 already
    # The request's jobs, this one included: once one is dropped the request answers 504, and
    # searching the others would be work nobody reads.
    request: list[Job] | None = None
    taken: bool = False             # a worker stage holds it (under the batcher lock)
    settled: bool = False           # its queries no longer count in `pending` (under the lock)

    def expired(self, within_s: float = 0.0) -> bool:
        """Whether its client no longer waits, or will not by the time `within_s` seconds of work
        on it are done."""
        return self.abandoned or (self.deadline is not None and time.monotonic() + within_s > self.deadline)


class Expired(Exception):
    """A job dropped unsearched: its client's deadline passed (or would before it is searched) or
    it went away."""


class Admission(StrEnum):
    """What `Batcher.submit` did with a request."""
    QUEUED = "queued"
    QUEUE_FULL = "queue_full"   # past --max_pending queued queries
    TOO_LATE = "too_late"       # the queue ahead would outlast the request's X-Timeout-S


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("retrieval_requests", "HTTP requests by answer status", ["status"], registry=r)
        self.queries = Counter("retrieval_queries", "queries answered", registry=r)
        self.errors = Counter("retrieval_errors", "requests that failed inside the retriever", registry=r)
        self.rejected = Counter("retrieval_rejected", "requests shed because the queue was full", registry=r)
        self.expired = Counter("retrieval_expired", "queries dropped unsearched: their client's deadline "
                               "(X-Timeout-S) passed or it disconnected", registry=r)
        self.batch_size = Histogram("retrieval_batch_queries", "queries per search call", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
        self.latency = Histogram("retrieval_request_seconds", "request latency", registry=r,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.search_time = Histogram("retrieval_search_seconds", "time of one search call", registry=r,
                                     buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        self.pending = Gauge("retrieval_pending_queries", "queries waiting in the queue", registry=r)
        self.upstream_errors = Gauge("retrieval_upstream_errors",
                                     "queries a web search engine did not answer (since start)", registry=r)


class Batcher:
    """The worker thread that owns the retriever, or the two that own its two stages."""

    # Made-up queries the start-up probe times (at most max_batch): enough for a batch's fixed
    # costs to be shared, few enough that a server on CPU starts without a long wait. The rate it
    # gives is a floor (smaller than the batches a busy server runs): the first bursts raise it.
    PROBE_QUERIES = 64
    # A stage's duration older than this many times itself (and at least STALE_MIN_S) is not
    # trusted to drop work: measurements come only from calls made, so an estimate that had grown
    # too long would otherwise drop every job after it, and nothing would correct it.
    STALE_FACTOR, STALE_MIN_S = 4.0, 1.0

    def __init__(self, retriever: Retriever, cfg: ServerConfig, metrics: Metrics):
        self.retriever, self.cfg, self.metrics = retriever, cfg, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.pending = 0  # queries queued or in flight; changed under the lock
        self.lock = threading.Lock()
        # Queries/s the last stage completes while work is waiting (moving average), under the lock.
        self.rate: float | None = None
        self._last_done: float | None = None  # when the last stage completed a batch, if work was left
        # Seconds one call of each stage takes ("search", or "encode" and "lookup"; moving averages),
        # and when one was last measured: what a job taken now still needs before it is answered.
        self.call_s: dict[str, float] = {}
        self._measured_at: float | None = None
        self.pipelined = cfg.pipeline and retriever.two_stage
        if self.pipelined:
            # One encoded batch waits at most: the encoder runs at most one batch ahead.
            self.encoded: queue.Queue[tuple[list[tuple[Job, object]], bool] | None] = queue.Queue(maxsize=1)
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

    def probe(self) -> None:
        """Times the retriever on one batch of made-up queries before serving, so that admission
        by expected wait judges the first burst after start too (it has no rate otherwise)."""
        n = min(self.cfg.max_batch, self.PROBE_QUERIES)
        queries = [f"start-up probe {i}: which river flows through the capital" for i in range(n)]
        topk = min(self.cfg.topk, self.cfg.max_topk)
        seconds: dict[str, float] = {}
        try:
            if self.pipelined:
                t = time.perf_counter()
                encoded = self.retriever.encode(queries)
                seconds["encode"] = time.perf_counter() - t
                t = time.perf_counter()
                self.retriever.lookup(encoded, topk)
                seconds["lookup"] = time.perf_counter() - t
            else:
                t = time.perf_counter()
                self.retriever.search(queries, topk)
                seconds["search"] = time.perf_counter() - t
        except Exception:
            log.exception("timing the retriever on %d made-up queries at start-up failed: requests "
                          "with X-Timeout-S are admitted until the server has measured its rate", n)
            return
        with self.lock:
            # As if the stages did not overlap: a floor, which the first busy batches raise.
            self.rate = n / max(sum(seconds.values()), 1e-9)
            self.call_s.update(seconds)
        log.info("start-up probe: %d queries in %.3f s (%.0f queries/s until measured under load)",
                 n, sum(seconds.values()), self.rate)

    def submit(self, jobs: list[Job], wait_s: float | None = None) -> Admission:
        """Queue the jobs of one request, all or none. `wait_s`: how long its client waits."""
        n = sum(len(j.queries) for j in jobs)
        with self.lock:
            # An empty queue takes any request whole: one larger than max_pending (allowed up to
            # max_queries_per_request) would otherwise be refused forever.
            if self.pending and self.pending + n > self.cfg.max_pending:
                return Admission.QUEUE_FULL
            # Work that would expire in the queue is refused now, while the client can still go elsewhere.
            if self.pending and wait_s is not None and self.rate and (self.pending + n) / self.rate > wait_s:
                return Admission.TOO_LATE
            self.pending += n
            self.metrics.pending.set(self.pending)
            for job in jobs:
                self.jobs.put(job)
        return Admission.QUEUED

    def abandon(self, jobs: list[Job]) -> None:
        """The handler gave up on these jobs (its client went away, or the request is answered
        already): those still queued leave `pending` now, and no stage works on any of them."""
        self._give_up(jobs)

    def _give_up(self, jobs: list[Job], settle_taken: list[Job] = ()) -> None:
        """Marks `jobs` abandoned; each one not settled yet that no stage has taken (or that is in
        `settle_taken`) is settled and leaves `pending`, counted as expired."""
        taken_ok = {id(job) for job in settle_taken}
        with self.lock:
            dropped = 0
            for job in jobs:
                job.abandoned = True
                if (id(job) in taken_ok or not job.taken) and not job.settled:
                    job.settled = True
                    dropped += len(job.queries)
            self.pending -= dropped
            if not self.pending:
                self._last_done = None
            self.metrics.pending.set(self.pending)
        self.metrics.expired.inc(dropped)

    def _next_batch(self) -> tuple[list[Job], bool] | None:
        """Jobs for one call of the first stage, and whether more work waited behind them (then the
        batch measures how fast the server answers, not how fast requests came)."""
        first = None
        while first is None:
            if (job := self.jobs.get()) is None:
                return None
            first = job if self._take(job) else None
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
            if self._take(job):
                batch.append(job)
                n += len(job.queries)
        return batch, n >= self.cfg.max_batch or not self.jobs.empty()

    def _take(self, job: Job) -> bool:
        """Whether the first stage works on `job`. Work nobody will wait for is not done: under
        overload the queue would otherwise be worked through for clients that gave up (or will have,
        by the time their answer is ready), while the ones still waiting time out."""
        within_s = self._still_needs_s("encode", "lookup") if self.pipelined else self._still_needs_s("search")
        with self.lock:
            if job.settled:  # its handler gave up on it while it was queued
                return False
            if not job.expired(within_s):
                job.taken = True
                return True
        self._drop([job])
        return False

    def _drop(self, jobs: list[Job]) -> None:
        """Answers the jobs 504 unsearched, and marks the other jobs of their requests abandoned:
        the request is answered 504 now, so nobody reads what they would find."""
        self._give_up([other for job in jobs for other in job.request or [job]], settle_taken=jobs)
        for job in jobs:
            self._resolve(job, exc=Expired())

    def _still_needs_s(self, *stages: str) -> float:
        """Seconds of work a job taken now still needs: the last calls of the stages ahead of it;
        0 when they were not measured lately (see STALE_FACTOR)."""
        with self.lock:
            needs = sum(self.call_s.get(stage, 0.0) for stage in stages)
            if self._measured_at is None or \
                    time.monotonic() - self._measured_at > max(self.STALE_MIN_S, self.STALE_FACTOR * needs):
                return 0.0
            return needs

    def _run(self):
        while (taken := self._next_batch()) is not None:
            batch, saturated = taken
            try:
                topk = max(j.topk for j in batch)
                search = partial(self._timed, "search", self.retriever.search, topk=topk)
                self._answer(batch, self._per_job([j.queries for j in batch], _concat, search))
            except Exception:  # a bug here must not kill the only worker
                log.exception("retrieval worker failed on a batch")
            finally:
                self._release(batch, last_stage=True, saturated=saturated)

    def _run_encode(self):
        while (taken := self._next_batch()) is not None:
            batch, saturated = taken
            try:
                encode = partial(self._timed, "encode", self.retriever.encode)
                encoded = self._per_job([j.queries for j in batch], _concat, encode)
                failed = [(j, e) for j, e in zip(batch, encoded) if isinstance(e, Exception)]
                self._answer([j for j, _ in failed], [e for _, e in failed])
                self._release([j for j, _ in failed], last_stage=False)
                if len(failed) < len(batch):
                    self.encoded.put(([(j, e) for j, e in zip(batch, encoded) if not isinstance(e, Exception)],
                                      saturated))
            except Exception:  # a bug here must not kill the worker
                log.exception("retrieval encoder failed on a batch")
                self._release(batch, last_stage=False)
        self.encoded.put(None)

    def _run_lookup(self):
        while (taken := self.encoded.get()) is not None:
            items, saturated = taken
            # Encoded while its client still waited; the lookup is skipped if it no longer does.
            within_s = self._still_needs_s("lookup")
            late = [j for j, _ in items if j.expired(within_s)]
            self._drop(late)
            items = [(j, e) for j, e in items if j not in late]
            if not items:
                continue
            batch = [j for j, _ in items]
            try:
                topk = max(j.topk for j in batch)
                lookup = partial(self._timed, "lookup", self.retriever.lookup, topk=topk)
                self._answer(batch, self._per_job([e for _, e in items], np.concatenate, lookup))
            except Exception:  # a bug here must not kill the worker
                log.exception("retrieval worker failed on a batch")
            finally:
                self._release(batch, last_stage=True, saturated=saturated)

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

    def _timed(self, stage: str, fn, batch, topk: int | None = None):
        t = time.perf_counter()
        results = fn(batch) if topk is None else fn(batch, topk)
        seconds = time.perf_counter() - t
        with self.lock:
            before = self.call_s.get(stage)
            self.call_s[stage] = seconds if before is None else 0.8 * before + 0.2 * seconds
            self._measured_at = time.monotonic()
        if stage != "encode":  # the histograms time the search (the lookup when pipelined)
            self.metrics.search_time.observe(seconds)
            self.metrics.batch_size.observe(len(batch))
        return results

    def _answer(self, batch: list[Job], results: list):
        for job, hits in zip(batch, results):
            if isinstance(hits, Exception):
                self._resolve(job, exc=RuntimeError("search failed; see the server log"))
            else:
                self._resolve(job, [h[:job.topk] for h in hits])

    def expected_wait_s(self) -> float | None:
        """Seconds the queued queries take at the measured rate (None before anything was measured)."""
        with self.lock:
            return self.pending / self.rate if self.rate else None

    def _release(self, batch: list[Job], last_stage: bool, saturated: bool = False):
        """The batch's jobs leave `pending`. The rate counts only batches the last stage completed
        while more work waited (`saturated`), over the time since its previous batch: an idle gap
        or a trickle of requests would make the server look slower than it is. Earlier stages and
        dropped jobs say nothing of it (the encoder releasing its failed jobs once restarted the clock
        mid-lookup, and the rate read many times faster than the server answered)."""
        now = time.monotonic()
        with self.lock:
            freed = 0
            for job in batch:
                if not job.settled:
                    job.settled = True
                    freed += len(job.queries)
            if last_stage:
                n = sum(len(j.queries) for j in batch)
                if saturated and n and self._last_done is not None and now > self._last_done:
                    sample = n / (now - self._last_done)
                    self.rate = sample if self.rate is None else 0.8 * self.rate + 0.2 * sample
                self._last_done = now
            self.pending -= freed
            if not self.pending:
                self._last_done = None
            self.metrics.pending.set(self.pending)

    @staticmethod
    def _resolve(job: Job, hits=None, exc: Exception | None = None):
        def done():
            if job.future.done():  # answered already, or its handler gave up and cancelled it
                return
            if exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(hits)
        job.loop.call_soon_threadsafe(done)


def _concat(parts: list[list]) -> list:
    return [x for part in parts for x in part]


def _validate(req: RetrieveRequest, cfg: ServerConfig) -> int:
    """The request's topk; raises BadRequest for what the server refuses."""
    topk = cfg.topk if req.topk is None else req.topk
    if not 1 <= topk <= cfg.max_topk:
        raise BadRequest(f"topk must be between 1 and {cfg.max_topk}, got {topk}")
    _check_texts(req.queries, "queries", cfg)
    return topk


def _client_wait_s(request: Request) -> float | None:
    """A client may say how long it waits (`X-Timeout-S: seconds`, as our client does): queued work
    past that is dropped instead of searched."""
    value = request.headers.get("x-timeout-s")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise BadRequest(f"X-Timeout-S: {value!r}: give the seconds the client waits, a positive number")
    return seconds


async def _wait_unless_abandoned(request: Request, jobs: list[Job], batcher: Batcher,
                                 deadline: float | None, poll_s: float = 0.5) -> list | None:
    """The jobs' results (an exception where one failed), or None once the client disconnected.
    A failed or dropped job, or the request's deadline, answers at once (the last as an `Expired`
    part): the client no longer waits or the request cannot succeed, so the jobs left are abandoned
    (those still queued are never searched)."""
    futures = [j.future for j in jobs]
    try:
        while True:
            timeout = poll_s if deadline is None else min(poll_s, max(0.0, deadline - time.monotonic()))
            done, pending = await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
            if not pending:
                return [f.exception() or f.result() for f in futures]
            if failed := [f.exception() for f in done if f.exception() is not None]:
                return failed
            if deadline is not None and time.monotonic() >= deadline:
                return [Expired()]
            if await request.is_disconnected():
                return None
    finally:
        if any(not f.done() for f in futures):
            batcher.abandon(jobs)
            for f in futures:
                f.cancel()  # the worker's answer, if one still comes, goes nowhere


def _check_texts(texts: list[str], field: str, cfg: ServerConfig) -> None:
    if len(texts) > cfg.max_queries_per_request:
        raise BadRequest(f"{len(texts):,} {field} in one request; this server takes at most "
                         f"{cfg.max_queries_per_request:,} (--max_queries_per_request): split the request",
                         413)
    for i, text in enumerate(texts):
        if len(text) > cfg.max_query_chars:
            raise BadRequest(f"{field}[{i}] has {len(text):,} characters; this server takes at most "
                             f"{cfg.max_query_chars:,} (--max_query_chars)", 413)
    # JSON may carry a lone surrogate ("\ud800"), which no tokenizer can take: refused here, or it
    # would fail the whole batch it lands in.
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        i = next(i for i, text in enumerate(texts) if not _encodable(text))
        raise BadRequest(f"{field}[{i}] is not valid Unicode (it holds a lone surrogate such as "
                         "\\ud800)") from None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _read_json(request: Request, max_bytes: int, timeout_s: float = 60.0):
    """The request body parsed as JSON, read no further than `max_bytes` and for no longer than
    `timeout_s` (408 after it). Only a body sent as JSON is read (415 otherwise): a web page can make
    a browser POST `text/plain` (or untyped) bodies to any address without asking, so a server on
    127.0.0.1 without a key would answer any site its user visits; `application/json` needs the
    server's consent first (a CORS preflight, which this server never grants)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise BadRequest(f"the body is sent as {media_type or 'no content type'!r}; send it as JSON with "
                         "`Content-Type: application/json` (requests.post(url, json=...), "
                         "curl -H 'Content-Type: application/json')", 415)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(f"the body has {int(declared):,} bytes; this server takes at most {max_bytes:,} "
                         "(--max_body_bytes): split the request", 413)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise BadRequest(f"the body is over {max_bytes:,} bytes (--max_body_bytes): split the "
                                     "request", 413)
    except TimeoutError:
        raise BadRequest(f"the body did not arrive within {timeout_s:g} s", 408) from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        raise BadRequest(f"the body is not JSON ({e.__class__.__name__}: {e})", 422) from None


def _parse(model: type[BaseModel], data, expected: str) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
                             for err in e.errors()[:5])
        more = f" (and {e.error_count() - 5} more)" if e.error_count() > 5 else ""
        raise BadRequest(f"invalid request: {problems}{more}. Expected {expected}", 422) from None


class UnknownFields:
    """Logs each unknown request field once per endpoint (at most `limit` names, so a client that
    invents names fills neither the log nor memory)."""

    def __init__(self, limit: int = 100):
        self.seen: set[tuple[str, str]] = set()
        self.limit = limit

    def check(self, endpoint: str, req: BaseModel) -> None:
        for name in req.model_extra or ():
            if (endpoint, name) in self.seen or len(self.seen) >= self.limit:
                continue
            self.seen.add((endpoint, name))
            close = difflib.get_close_matches(name, type(req).model_fields, n=1)
            log.warning("%s: ignoring the unknown request field %r%s; logged once per field name",
                        endpoint, name, f" (did you mean {close[0]!r}?)" if close else "")


def _access_body(pages: Pages, urls: list[str], max_bytes: int) -> bytes:
    """The /access answer as JSON: one entry per URL, in order. A URL asked again is read and sent
    once; its later entries point at the first (`duplicate_of`) with empty contents, so that a
    client reading `page["contents"]` still works. Refused (413) as soon as the answer would pass
    `max_bytes`, before the remaining pages are read."""
    first: dict[str, int] = {}
    parts: list[bytes] = []
    size = 0
    for i, url in enumerate(urls):
        key = asearcher_url(url)
        if key in first:
            j = first[key]
            page = None if parts[j] == b"null" else {"url": key, "contents": "", "duplicate_of": j}
        else:
            first[key] = i
            page = pages.get(url)
        parts.append(json.dumps(page, ensure_ascii=False).encode())
        size += len(parts[-1]) + 2
        if size > max_bytes:
            raise BadRequest(f"the pages asked for come to more than {max_bytes:,} bytes, the most one "
                             "/access answer holds (--max_access_response_bytes): ask for fewer URLs per "
                             "request", 413)
    return b'{"result": [' + b", ".join(parts) + b"]}"


RETRIEVE_SHAPE = '{"queries": [str, ...], "topk": int, "return_scores": bool}'
ACCESS_SHAPE = '{"urls": [str, ...]}'


def create_app(retriever: Retriever, cfg: ServerConfig | None = None, name: str = "retriever",
               pages: Pages | None = None) -> FastAPI:
    cfg = cfg or ServerConfig()
    cfg.max_topk = min(cfg.max_topk, getattr(retriever, "max_topk", cfg.max_topk))
    metrics = Metrics()
    batcher = Batcher(retriever, cfg, metrics)
    unknown_fields = UnknownFields()

    @asynccontextmanager
    async def lifespan(app):
        retriever.warmup()  # first-call costs (CUDA kernels, tuning) before the first request
        if retriever.probe_at_startup:
            batcher.probe()
        batcher.start()
        yield
        batcher.stop()

    # With a key, nothing but /health answers without it: the generated API docs are off.
    docs = {} if not cfg.api_key else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Search-R1 retrieval", lifespan=lifespan, **docs)
    app.state.batcher = batcher

    def error(status: int, message: str, **headers) -> JSONResponse:
        metrics.requests.labels(str(status)).inc()
        return JSONResponse({"error": message}, status_code=status, headers=headers or None)

    def answer(payload: dict) -> Response:
        metrics.requests.labels("200").inc()
        # A ready-made body: FastAPI's generic encoder walks every nested dict in Python and was
        # the server's bottleneck under load.
        return Response(json.dumps(payload, ensure_ascii=False), media_type="application/json")

    def authorized(request: Request) -> bool:
        if not cfg.api_key:
            return True
        # The scheme is case-insensitive (RFC 7235): `bearer KEY` is as good as `Bearer KEY`.
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        # compare_digest: the time taken does not tell how much of a guessed token was right
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), cfg.api_key.encode())

    def busy(admission: Admission, n: int, wait_s: float | None) -> JSONResponse:
        """503 for a request the queue did not take, saying which limit refused it."""
        pending, wait = batcher.pending, batcher.expected_wait_s()
        retry_after = {"Retry-After": str(max(1, math.ceil(wait or 1)))}
        if admission == Admission.QUEUE_FULL:
            return error(503, f"server busy: {pending:,} queries are queued and {n:,} more would pass "
                              f"its limit of {cfg.max_pending:,} (--max_pending); retry after "
                              "Retry-After seconds", **retry_after)
        return error(503, f"server busy: the {pending:,} queries queued would outlast this request's "
                          f"X-Timeout-S of {wait_s:g} s (about {wait or 0:.1f} s at the "
                          f"{batcher.rate or 0:,.0f} queries/s this server answers); retry after Retry-After "
                          "seconds, or elsewhere", **retry_after)

    # Every error answers {"error": ...}, Starlette's own (unknown path, wrong method) included.
    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail), **(exc.headers or {}))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):
        return error(500, "internal server error; see the server log")

    @app.post("/retrieve")
    async def retrieve(request: Request):
        t0, arrived = time.perf_counter(), time.monotonic()
        if not authorized(request):  # before the body is read
            return error(401, "missing or wrong bearer token (Authorization: Bearer <api key>)")
        try:
            req = _parse(RetrieveRequest, await _read_json(request, cfg.max_body_bytes, cfg.body_timeout_s),
                         RETRIEVE_SHAPE)
            unknown_fields.check("/retrieve", req)
            topk = _validate(req, cfg)
        except BadRequest as e:
            return error(e.status, str(e))
        if not req.queries:
            return answer({"result": []})
        try:
            wait_s = _client_wait_s(request)
        except BadRequest as e:
            return error(e.status, str(e))
        # The client's clock started when it sent the request, before its body was read.
        deadline = None if wait_s is None else arrived + wait_s
        loop = asyncio.get_running_loop()
        jobs = [Job(req.queries[lo:lo + cfg.max_batch], topk, loop.create_future(), loop, time.monotonic(), deadline)
                for lo in range(0, len(req.queries), cfg.max_batch)]
        for job in jobs:
            job.request = jobs
        admission = batcher.submit(jobs, None if deadline is None else deadline - time.monotonic())
        if admission != Admission.QUEUED:
            metrics.rejected.inc()
            return busy(admission, len(req.queries), wait_s)
        parts = await _wait_unless_abandoned(request, jobs, batcher, deadline)
        if parts is None:  # the client went away; its queued jobs are dropped unsearched
            return error(499, "client disconnected")
        if any(isinstance(p, Expired) for p in parts):
            return error(504, "the request's X-Timeout-S passed, or would have, before all its queries "
                              "were searched")
        failed = next((p for p in parts if isinstance(p, BaseException)), None)
        if failed is not None:
            metrics.errors.inc()
            return error(500, str(failed))
        response = answer({"result": [[h.to_api(req.return_scores) for h in hits]
                                      for part in parts for hits in part]})
        metrics.queries.inc(len(req.queries))
        metrics.latency.observe(time.perf_counter() - t0)
        return response

    @app.post("/access")
    async def access(request: Request):
        if not authorized(request):
            return error(401, "missing or wrong bearer token (Authorization: Bearer <api key>)")
        if pages is None:
            return error(404, "this server has no pages: start it with --pages_path PAGES.jsonl "
                              '(rows {"url": ..., "contents": ...}) to serve /access')
        try:
            req = _parse(AccessRequest, await _read_json(request, cfg.max_body_bytes, cfg.body_timeout_s),
                         ACCESS_SHAPE)
            unknown_fields.check("/access", req)
            _check_texts(req.urls, "urls", cfg)
        except BadRequest as e:
            return error(e.status, str(e))
        # Off the event loop: a page not in the OS cache is read from disk, and a large answer
        # takes a while to encode (/health must answer meanwhile).
        try:
            body = await asyncio.to_thread(_access_body, pages, req.urls, cfg.max_access_response_bytes)
        except BadRequest as e:
            return error(e.status, str(e))
        metrics.requests.labels("200").inc()
        return Response(body, media_type="application/json")

    @app.get("/health")
    async def health():
        problems = ([] if batcher.alive() else ["the retrieval worker thread died; restart the server"])
        if problem := retriever.health_problem():
            problems.append(problem)
        body = {"status": "unhealthy" if problems else "ok", "retriever": name, "pending_queries": batcher.pending,
                "worker_alive": batcher.alive(), "pipelined": batcher.pipelined,
                "queries_per_s": round(batcher.rate, 1) if batcher.rate else None, "stats": retriever.stats(),
                "pages": len(pages) if pages is not None else 0}
        if problems:  # 503: load balancers and the trainer's start-up check read the status
            return JSONResponse({**body, "problems": problems}, status_code=503)
        return body

    @app.get("/metrics")
    async def prometheus(request: Request):
        if not authorized(request):
            return error(401, "missing or wrong bearer token (Authorization: Bearer <api key>)")
        metrics.upstream_errors.set(retriever.stats().get("upstream_errors", 0))
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    return app


def parallel_tokenizers() -> None:
    """Let the Rust tokenizer use every core in this process (and the worker process it starts).

    A shell or training setup often exports TOKENIZERS_PARALLELISM=false (it silences a warning
    about forking); in a server that never forks it only slows tokenising, a large part of
    encoding a batch (benchmarks/RESULTS.md, "The query encoder")."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "true").lower() not in ("1", "true", "yes", "on"):
        log.info("TOKENIZERS_PARALLELISM=%s ignored: the server tokenises queries in parallel",
                 os.environ["TOKENIZERS_PARALLELISM"])
    os.environ["TOKENIZERS_PARALLELISM"] = "true"


def serve(retriever: Retriever, cfg: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          name: str = "retriever", pages: Pages | None = None, save_address_to: str | None = None):
    """`save_address_to`: a directory where the address file of ASearcher's and RLinf's clients is
    written once the server is healthy (search_r1.retrieval.address_file)."""
    from search_r1.retrieval.address_file import make_server

    app = create_app(retriever, cfg, name, pages)
    # The event loop (HTTP, JSON) and the worker (kernel launches) share the GIL. Under load the
    # worker waited up to the default 5 ms switch interval for each hand-over, which slowed
    # encoding down; a shorter interval lets it in sooner (benchmarks/RESULTS.md, "Whole server").
    sys.setswitchinterval(cfg.switch_interval_s)
    log.info("serving %s on http://%s:%d/retrieve", name, host, port)
    make_server(uvicorn_config(app, cfg, host, port), save_address_to, host).run()


def uvicorn_config(app, cfg: ServerConfig, host: str, port: int):
    """The server's uvicorn settings: quiet logs, and connections that wait too long for headers closed."""
    import uvicorn
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          http=_with_header_deadline(cfg.header_timeout_s))


def _with_header_deadline(seconds: float):
    """uvicorn's HTTP protocol (httptools if installed, else h11) that closes a connection still
    waiting for a request's headers `seconds` after it opened or after its last response. uvicorn
    itself waits for headers forever; its keep-alive timeout starts only after a response."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class HeaderDeadline(Base):
        _timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc):
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _arm(self):
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(seconds, self._check)

        def _check(self):
            # A request whose headers arrived has a cycle still answering: leave it to the handler
            # (its body has a deadline of its own). Otherwise the headers are late: close.
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
