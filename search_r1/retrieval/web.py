"""Web search engines as a `Retriever`: SerpAPI, Google Programmable Search, Brave and Bing.

Each result becomes a Passage whose id is the result URL and whose contents follow the wiki-18
layout (`"title"\\nsnippet`), so the agent shows web hits exactly like corpus passages. Engines
publish no comparable relevance score, only an order, so a hit's score is 1/(rank+1): 1.0, 0.5,
0.33, … — monotone in the engine's rank and the same scale for every engine.

One request per query, so `topk` is limited to the engine's per-request maximum (`max_topk`):
SerpAPI 100 (`num`), Google Programmable Search 10 (`num`), Brave 20 (`count`), Bing 50 (`count`).
Microsoft retired the public Bing Search API in 2025; `base_url` can point at a compatible endpoint.

API keys come from environment variables, or from the caller (`credentials`: `search-r1 serve`
passes the original launchers' `--serp_api_key`, `--api_key` and `--cse_id` this way), which win
over the environment. They are never logged, cached or put into error messages: Google and SerpAPI
take the key in the query string, and httpx logs every request URL at INFO, so a filter on the
`httpx` logger blanks every credential there (Google's search engine id too: with the key it is
what spends the account's quota).

A query that still fails after its retries yields an empty hit list (counted in `errors`, logged
as a warning) instead of failing the batch: one flaky request should not stop a training step.
"""
from __future__ import annotations

import email.utils
import hashlib
import html
import json
import logging
import os
import random
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path
from urllib.parse import quote, quote_plus

import httpx

from search_r1.retrieval.base import Hit, Retriever
from search_r1.retrieval.corpus import Passage

log = logging.getLogger(__name__)


class WebEngine(StrEnum):
    SERPAPI = "serpapi"
    GOOGLE = "google"
    BRAVE = "brave"
    BING = "bing"


DEFAULT_URLS = {
    WebEngine.SERPAPI: "https://serpapi.com/search.json",
    WebEngine.GOOGLE: "https://www.googleapis.com/customsearch/v1",
    WebEngine.BRAVE: "https://api.search.brave.com/res/v1/web/search",
    WebEngine.BING: "https://api.bing.microsoft.com/v7.0/search",
}
MAX_TOPK = {WebEngine.SERPAPI: 100, WebEngine.GOOGLE: 10, WebEngine.BRAVE: 20, WebEngine.BING: 50}
# Every variable an engine needs is a credential, kept out of logs, errors and the cache: the first
# holds the key; GOOGLE_CSE_ID names the account's search engine.
KEY_ENV = {
    WebEngine.SERPAPI: ("SERPAPI_API_KEY",),
    WebEngine.GOOGLE: ("GOOGLE_API_KEY", "GOOGLE_CSE_ID"),
    WebEngine.BRAVE: ("BRAVE_API_KEY",),
    WebEngine.BING: ("BING_API_KEY",),
}
# Where `search-r1 serve` also takes each one: the flags of the original launchers
# (retrieval_launch_serpapi.sh, retrieval_launch_google.sh).
KEY_FLAGS = {"SERPAPI_API_KEY": "--serp_api_key", "GOOGLE_API_KEY": "--api_key with --cse_id",
             "GOOGLE_CSE_ID": "--cse_id"}


class WebSearchRetriever(Retriever):
    """Fetches a batch of queries from a web search engine, at most `max_concurrency` at a time.

    timeout: seconds allowed for connecting and for each read of one request (httpx semantics).
    retries: extra attempts after connect errors, timeouts, HTTP 5xx and 429; the wait doubles
        from `backoff` seconds with random jitter, or follows the server's Retry-After, never
        longer than `max_backoff`.
    cache_dir: if set, answers are kept there as JSON files keyed by sha256(engine, query, topk)
        and reused across runs; failed queries are not cached.
    credentials: keys by their environment variable's name (`KEY_ENV`); a value given here wins
        over the environment.
    serp_engine: the engine SerpAPI queries for us (its `engine` parameter, the original's
        `--serp_engine`); SerpAPI only.
    """

    def __init__(self, engine: WebEngine | str = WebEngine.SERPAPI, *, base_url: str | None = None,
                 timeout: float = 10.0, retries: int = 3, backoff: float = 0.5,
                 max_backoff: float = 30.0, max_concurrency: int = 8,
                 cache_dir: str | os.PathLike | None = None,
                 credentials: dict[str, str] | None = None, serp_engine: str = "google"):
        try:
            self.engine = WebEngine(engine)
        except ValueError:
            raise ValueError(f"unknown web search engine {engine!r}; "
                             f"choose one of {', '.join(WebEngine)}") from None
        if max_concurrency < 1 or retries < 0 or timeout <= 0:
            raise ValueError("WebSearchRetriever needs max_concurrency >= 1, retries >= 0 and "
                             f"timeout > 0 (got {max_concurrency}, {retries}, {timeout})")
        if serp_engine != "google" and self.engine != WebEngine.SERPAPI:
            raise ValueError(f"serp_engine={serp_engine!r} is SerpAPI's; {self.engine} takes none")
        self.serp_engine = serp_engine
        self._credentials = _read_credentials(self.engine, credentials or {})
        self._secrets = set(self._credentials.values())
        _HTTPX_REDACTION.secrets.update(self._secrets)

        self.url = base_url or DEFAULT_URLS[self.engine]
        if httpx.URL(self.url).scheme not in ("http", "https"):
            raise ValueError(f"base_url {self.url!r} must be an http:// or https:// URL")
        self.max_topk = MAX_TOPK[self.engine]
        self.probe_at_startup = False  # every query is billed
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.errors = 0  # queries that got no answer, since construction
        self.answered = 0  # queries the engine answered (cache hits not counted)
        self.failing_in_a_row = 0
        self.last_error: str | None = None
        self._errors_lock = threading.Lock()
        self._cache = _DiskCache(Path(cache_dir)) if cache_dir is not None else None
        # Answers of another SerpAPI engine are other answers; Google's keep the plain key, so caches
        # written before the option existed stay valid.
        self._cache_name = str(self.engine) if serp_engine == "google" else f"{self.engine}/{serp_engine}"
        self._client = httpx.Client(timeout=timeout,
                                    limits=httpx.Limits(max_connections=max_concurrency))
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="web-search")
        log.info("web search: %s at %s, key from %s, cache %s", self.engine, self.url,
                 KEY_ENV[self.engine][0], cache_dir or "off")

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if not 1 <= topk <= self.max_topk:
            raise ValueError(f"topk={topk} is outside 1..{self.max_topk}, the most results "
                             f"{self.engine} returns for one request; ask for fewer")
        # Rollouts of one prompt often ask the same thing: fetch each distinct query once.
        unique = list(dict.fromkeys(queries))
        answers = dict(zip(unique, self._pool.map(lambda q: self._search_one(q, topk), unique)))
        return [list(answers[q]) for q in queries]

    def stats(self) -> dict:
        return {"upstream_errors": self.errors, "upstream_answered": self.answered}

    # An engine that refuses the key answers every query with an error, which the server can only
    # pass on as empty hits: after this many failures in a row, /health says the server is unhealthy.
    UNHEALTHY_AFTER = 3

    def health_problem(self) -> str | None:
        if self.failing_in_a_row >= self.UNHEALTHY_AFTER or (self.errors and not self.answered):
            return (f"the last {self.failing_in_a_row} calls to {self.engine} failed "
                    f"(last: {self.last_error})")
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    def _search_one(self, query: str, topk: int) -> list[Hit]:
        if self._cache is not None:
            hits = self._cache.get(self._cache_name, query, topk)
            if hits is not None:
                return hits
        try:
            hits = self._fetch(query, topk)
        except _QueryFailed as e:
            with self._errors_lock:
                self.errors += 1
                self.failing_in_a_row += 1
                self.last_error = self._redact(str(e))
            log.warning("web search (%s) gave no answer for %r: %s", self.engine, query[:100],
                        self._redact(str(e)))
            return []
        with self._errors_lock:
            self.answered += 1
            self.failing_in_a_row = 0
        if self._cache is not None:
            self._cache.put(self._cache_name, query, topk, hits)
        return hits

    def _fetch(self, query: str, topk: int) -> list[Hit]:
        params, headers = _request(self.engine, query, topk, self._credentials, self.serp_engine)
        for attempt in range(self.retries + 1):
            retry_after = None
            try:
                resp = self._client.get(self.url, params=params, headers=headers)
            except httpx.RequestError as e:  # connect errors, timeouts, dropped connections
                problem = f"{type(e).__name__}: {e}"
            else:
                if resp.is_success:
                    try:
                        results = _parse(self.engine, resp.json())
                    except (ValueError, TypeError, AttributeError) as e:
                        raise _QueryFailed(f"unexpected answer layout ({type(e).__name__})")
                    return [Hit(Passage(url, f'"{title}"\n{snippet}'), 1.0 / (rank + 1))
                            for rank, (title, snippet, url) in enumerate(results[:topk])]
                problem = f"HTTP {resp.status_code}"
                if resp.status_code < 500 and resp.status_code != 429:
                    # A bad key or endpoint does not get better by asking again.
                    raise _QueryFailed(f"{problem}; check {' and '.join(KEY_ENV[self.engine])} "
                                       f"and the endpoint {self.url}")
                retry_after = _retry_after_seconds(resp.headers.get("Retry-After"))
            if attempt < self.retries:
                time.sleep(self._delay(attempt, retry_after))
        raise _QueryFailed(f"{problem} after {self.retries + 1} attempts")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff)
        # Jitter spreads out the retries of queries that failed together in one batch.
        return min(self.backoff * 2 ** attempt, self.max_backoff) * random.uniform(0.5, 1.0)

    def _redact(self, text: str) -> str:
        return _redact(text, self._secrets)


class _QueryFailed(Exception):
    pass


def _read_credentials(engine: WebEngine, given: dict[str, str]) -> dict[str, str]:
    names = KEY_ENV[engine]
    found = {n: given.get(n) or os.environ.get(n) for n in names}
    missing = [n for n in names if not found[n]]
    if missing:
        flags = [f"{KEY_FLAGS[n]} for {n}" for n in missing if n in KEY_FLAGS]
        # ValueError: a start-up problem the user fixes, which `search-r1 serve` reports in one line
        raise ValueError(f"web search engine '{engine}' needs the environment variable"
                         f"{'s' if len(missing) > 1 else ''} {' and '.join(missing)}; "
                         "export it before starting the retrieval server"
                         + (f" (or give `search-r1 serve` {', '.join(flags)})" if flags else ""))
    return found


def _request(engine: WebEngine, query: str, topk: int, credentials: dict[str, str],
             serp_engine: str = "google") -> tuple[dict, dict]:
    """Query-string parameters and headers of one search request."""
    if engine == WebEngine.SERPAPI:
        return {"engine": serp_engine, "q": query, "num": topk,
                "api_key": credentials["SERPAPI_API_KEY"]}, {}
    elif engine == WebEngine.GOOGLE:
        return {"key": credentials["GOOGLE_API_KEY"], "cx": credentials["GOOGLE_CSE_ID"],
                "q": query, "num": topk}, {}
    elif engine == WebEngine.BRAVE:
        return {"q": query, "count": topk}, {"X-Subscription-Token": credentials["BRAVE_API_KEY"],
                                             "Accept": "application/json"}
    elif engine == WebEngine.BING:
        return ({"q": query, "count": topk, "responseFilter": "Webpages"},
                {"Ocp-Apim-Subscription-Key": credentials["BING_API_KEY"]})
    raise AssertionError(engine)


def _parse(engine: WebEngine, body: dict) -> list[tuple[str, str, str]]:
    """(title, snippet, url) of each web result, best first; a query without results gives []."""
    if engine == WebEngine.SERPAPI:
        # No results is a 200 with an "error" message and no "organic_results".
        items = [(r.get("title"), r.get("snippet"), r.get("link"))
                 for r in body.get("organic_results") or []]
    elif engine == WebEngine.GOOGLE:
        items = [(r.get("title"), r.get("snippet"), r.get("link")) for r in body.get("items") or []]
    elif engine == WebEngine.BRAVE:
        # Brave marks the query terms in titles and descriptions with <strong>.
        items = [(_strip_tags(r.get("title")), _strip_tags(r.get("description")), r.get("url"))
                 for r in (body.get("web") or {}).get("results") or []]
    elif engine == WebEngine.BING:
        items = [(r.get("name"), r.get("snippet"), r.get("url"))
                 for r in (body.get("webPages") or {}).get("value") or []]
    else:
        raise AssertionError(engine)
    # The title must stay on the first line of the contents.
    return [(" ".join((title or "").split()), snippet or "", url)
            for title, snippet, url in items if url]


def _strip_tags(text: str | None) -> str:
    return html.unescape(re.sub(r"<[^>]*>", "", text or ""))


def _retry_after_seconds(value: str | None) -> float | None:
    """Retry-After is either a number of seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def _redact(text: str, secrets: set[str]) -> str:
    for secret in secrets:
        for form in {secret, quote(secret, safe=""), quote_plus(secret)}:
            text = text.replace(form, "***")
    return text


class _RedactSecrets(logging.Filter):
    """Blanks credentials in the request URLs that httpx logs at INFO."""

    def __init__(self):
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = _redact(message, set(self.secrets))
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


_HTTPX_REDACTION = _RedactSecrets()
logging.getLogger("httpx").addFilter(_HTTPX_REDACTION)


class _DiskCache:
    """One JSON file per (engine, query, topk); written to a temporary file, then renamed."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, engine: str, query: str, topk: int) -> Path:
        digest = hashlib.sha256(json.dumps([str(engine), query, topk]).encode()).hexdigest()
        return self.root / digest[:2] / f"{digest}.json"  # subfolders keep directories small

    def get(self, engine: str, query: str, topk: int) -> list[Hit] | None:
        path = self._path(engine, query, topk)
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            if [entry["engine"], entry["query"], entry["topk"]] != [str(engine), query, topk]:
                raise ValueError("entry is for another query")
            return [Hit(Passage(h["id"], h["contents"]), float(h["score"])) for h in entry["hits"]]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable web search cache entry %s (%s); fetching it again",
                        path, e)
            return None

    def put(self, engine: str, query: str, topk: int, hits: list[Hit]) -> None:
        path = self._path(engine, query, topk)
        entry = {"engine": str(engine), "query": query, "topk": topk,
                 "hits": [{"id": h.passage.id, "contents": h.passage.contents, "score": h.score}
                          for h in hits]}
        tmp = None
        try:
            path.parent.mkdir(exist_ok=True)
            with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent,
                                             suffix=".tmp", delete=False) as f:
                tmp = f.name
                json.dump(entry, f)
            os.replace(tmp, path)  # readers see the old entry or the new one, never half of one
        except OSError as e:
            # A full disk should cost the cache, not the search.
            log.warning("could not write web search cache entry %s: %s", path, e)
            if tmp:
                Path(tmp).unlink(missing_ok=True)
