"""The request queue and the worker threads that own the retriever.

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
process (`search_r1.retrieval.worker_process.ProcessRetriever`) and the worker thread only passes batches to it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from functools import partial

import numpy as np

from search_r1.retrieval.base import Retriever
from search_r1.retrieval.server.config import ServerConfig
from search_r1.retrieval.server.metrics import Metrics

log = logging.getLogger(__name__)


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

