"""`create_app`: the FastAPI application and its routes, `POST /retrieve` and `/access`, `GET /health`
and `/metrics`. A handler checks its request (`checks`), queues it (`batcher`) and waits for the
answer, or for its client's deadline or disconnection."""
from __future__ import annotations

import asyncio
import json
import math
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException

from search_r1.retrieval.base import Retriever
from search_r1.retrieval.corpus import Pages, asearcher_url
from search_r1.retrieval.server.batcher import Admission, Batcher, Expired, Job
from search_r1.retrieval.server.checks import (ACCESS_SHAPE, RETRIEVE_SHAPE, AccessRequest, BadRequest,
                                               RetrieveRequest, UnknownFields, authorized, check_texts,
                                               client_wait_s, parse_request, read_json, validate_retrieve)
from search_r1.retrieval.server.config import ServerConfig
from search_r1.retrieval.server.metrics import Metrics


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
        if not authorized(request, cfg.api_key):  # before the body is read
            return error(401, "missing or wrong bearer token (Authorization: Bearer <api key>)")
        try:
            req = parse_request(RetrieveRequest, await read_json(request, cfg.max_body_bytes, cfg.body_timeout_s),
                                RETRIEVE_SHAPE)
            unknown_fields.check("/retrieve", req)
            topk = validate_retrieve(req, cfg)
        except BadRequest as e:
            return error(e.status, str(e))
        if not req.queries:
            return answer({"result": []})
        try:
            wait_s = client_wait_s(request)
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
        if not authorized(request, cfg.api_key):
            return error(401, "missing or wrong bearer token (Authorization: Bearer <api key>)")
        if pages is None:
            return error(404, "this server has no pages: start it with --pages_path PAGES.jsonl "
                              '(rows {"url": ..., "contents": ...}) to serve /access')
        try:
            req = parse_request(AccessRequest, await read_json(request, cfg.max_body_bytes, cfg.body_timeout_s),
                                ACCESS_SHAPE)
            unknown_fields.check("/access", req)
            check_texts(req.urls, "urls", cfg)
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
        if not authorized(request, cfg.api_key):
            return error(401, "missing or wrong bearer token (Authorization: Bearer <api key>)")
        metrics.upstream_errors.set(retriever.stats().get("upstream_errors", 0))
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    return app


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
