"""Client for the `/retrieve` API, used by the rollout: sync and async, pooled, retried.

Connection errors, timeouts, 5xx and 429/503 are retried with exponential backoff and full
jitter (a server's Retry-After is honoured as a lower bound); 4xx answers are the caller's
fault and raise at once. After the last attempt a `RetrievalError` says what failed and where.
A server that stopped answering (frozen, overloaded past its queue) accepts connections but never
replies, so every attempt would wait the whole read timeout: after a timed-out attempt the client
asks `/health` with the short connect timeout, and gives up at once if that goes unanswered too.
Large batches are split into requests of at most `max_queries_per_request`.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

RETRY_STATUS = {429, 500, 502, 503, 504}


class RetrievalError(RuntimeError):
    pass


@dataclass
class RetrieverConfig:
    url: str = "http://127.0.0.1:8000/retrieve"
    topk: int = 3
    timeout_s: float = 30.0        # read timeout of one request (a batch of searches)
    connect_timeout_s: float = 5.0  # connecting, and the health probe after a timed-out request
    retries: int = 5               # attempts after the first
    backoff_s: float = 0.2         # first backoff; doubles each attempt
    max_backoff_s: float = 5.0
    max_queries_per_request: int = 512
    api_key: str | None = None


def _delay(cfg: RetrieverConfig, attempt: int, response: httpx.Response | None) -> float:
    delay = random.uniform(0, min(cfg.max_backoff_s, cfg.backoff_s * 2 ** attempt))
    if response is not None and (ra := response.headers.get("retry-after")):
        try:
            delay = max(delay, min(float(ra), cfg.max_backoff_s))
        except ValueError:
            pass
    return delay


def _parse(response: httpx.Response, n_queries: int) -> list[list[dict]]:
    result = response.json()["result"]
    if len(result) != n_queries:
        raise RetrievalError(f"server answered {len(result)} lists for {n_queries} queries")
    return result


def _headers(cfg: RetrieverConfig) -> dict:
    # X-Timeout-S: the server drops our queued queries unsearched once we no longer wait for them.
    headers = {"X-Timeout-S": f"{cfg.timeout_s:g}"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    return headers


def _timeout(cfg: RetrieverConfig) -> httpx.Timeout:
    return httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s)


def _health_url(cfg: RetrieverConfig) -> str:
    return cfg.url.rsplit("/", 1)[0] + "/health"


def _unresponsive(cfg: RetrieverConfig, error: Exception) -> RetrievalError:
    return RetrievalError(f"retrieval at {cfg.url} stopped answering: a request timed out after "
                          f"{cfg.timeout_s:g} s ({type(error).__name__}) and {_health_url(cfg)} did not answer "
                          f"within {cfg.connect_timeout_s:g} s; is the server alive (not stopped or frozen)?")


def _answer(cfg: RetrieverConfig, r: httpx.Response, n_queries: int) -> list[list[dict]] | None:
    """The hits of a 200; None for a status worth retrying (overload, restart); an error otherwise."""
    if r.status_code == 200:
        return _parse(r, n_queries)
    if r.status_code not in RETRY_STATUS:
        raise RetrievalError(f"retrieval at {cfg.url} refused the request: HTTP {r.status_code}: {r.text[:300]}")
    return None


def _error(cfg, attempts, last) -> RetrievalError:
    what = (f"HTTP {last.status_code}: {last.text[:200]}" if isinstance(last, httpx.Response)
            else f"{type(last).__name__}: {last}")
    return RetrievalError(f"retrieval at {cfg.url} failed after {attempts} attempts ({what}); "
                          "is the retrieval server running (`search-r1 serve`)?")


class RetrievalClient:
    """Blocking client; one pooled connection set per instance."""

    def __init__(self, cfg: RetrieverConfig | None = None, **overrides):
        self.cfg = cfg or RetrieverConfig(**overrides)
        headers = _headers(self.cfg)
        self.http = httpx.Client(timeout=_timeout(self.cfg), headers=headers,
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    def retrieve(self, queries: list[str], topk: int | None = None,
                 return_scores: bool = True) -> list[list[dict]]:
        step = self.cfg.max_queries_per_request
        out = []
        for lo in range(0, len(queries), step):
            out += self._post(queries[lo:lo + step], topk or self.cfg.topk, return_scores)
        return out

    def _post(self, queries, topk, return_scores):
        body = {"queries": queries, "topk": topk, "return_scores": return_scores}
        last = None
        for attempt in range(self.cfg.retries + 1):
            try:
                last = self.http.post(self.cfg.url, json=body)
                if (hits := _answer(self.cfg, last, len(queries))) is not None:
                    return hits
            except httpx.TransportError as e:
                last = e
                if isinstance(e, httpx.TimeoutException) and not self._answers():
                    raise _unresponsive(self.cfg, e) from None
            if attempt < self.cfg.retries:
                time.sleep(_delay(self.cfg, attempt, last if isinstance(last, httpx.Response) else None))
        raise _error(self.cfg, self.cfg.retries + 1, last)

    def _answers(self) -> bool:
        try:
            return self.http.get(_health_url(self.cfg), timeout=self.cfg.connect_timeout_s).status_code == 200
        except httpx.TransportError:
            return False

    def health(self) -> dict:
        return self.http.get(_health_url(self.cfg)).json()

    def close(self):
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncRetrievalClient:
    """The same client for asyncio code (the asynchronous rollout schedule)."""

    def __init__(self, cfg: RetrieverConfig | None = None, **overrides):
        self.cfg = cfg or RetrieverConfig(**overrides)
        headers = _headers(self.cfg)
        self.http = httpx.AsyncClient(timeout=_timeout(self.cfg), headers=headers,
                                      limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))

    async def retrieve(self, queries: list[str], topk: int | None = None,
                       return_scores: bool = True) -> list[list[dict]]:
        step = self.cfg.max_queries_per_request
        parts = await asyncio.gather(*[self._post(queries[lo:lo + step], topk or self.cfg.topk, return_scores)
                                       for lo in range(0, len(queries), step)])
        return [hits for part in parts for hits in part]

    async def _post(self, queries, topk, return_scores):
        body = {"queries": queries, "topk": topk, "return_scores": return_scores}
        last = None
        for attempt in range(self.cfg.retries + 1):
            try:
                last = await self.http.post(self.cfg.url, json=body)
                if (hits := _answer(self.cfg, last, len(queries))) is not None:
                    return hits
            except httpx.TransportError as e:
                last = e
                if isinstance(e, httpx.TimeoutException) and not await self._answers():
                    raise _unresponsive(self.cfg, e) from None
            if attempt < self.cfg.retries:
                await asyncio.sleep(_delay(self.cfg, attempt, last if isinstance(last, httpx.Response) else None))
        raise _error(self.cfg, self.cfg.retries + 1, last)

    async def _answers(self) -> bool:
        try:
            r = await self.http.get(_health_url(self.cfg), timeout=self.cfg.connect_timeout_s)
            return r.status_code == 200
        except httpx.TransportError:
            return False

    async def aclose(self):
        await self.http.aclose()
