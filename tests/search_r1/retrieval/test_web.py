"""WebSearchRetriever against a fake upstream server.

The real search engines (SerpAPI, Google, Brave, Bing) are out of reach in tests and must never be
contacted, so `FakeEngines` stands in for all four: a local HTTP server on 127.0.0.1 that answers
in each engine's JSON layout, records every request and can fail, stall or throttle on demand.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from search_r1.retrieval.web import KEY_ENV, WebEngine, WebSearchRetriever

KEYS = {"SERPAPI_API_KEY": "serp-SECRET-1234", "GOOGLE_API_KEY": "goog-SECRET-5678",
        "GOOGLE_CSE_ID": "cse-id-0001", "BRAVE_API_KEY": "brave-SECRET-9012",
        "BING_API_KEY": "bing-SECRET-3456"}
PATHS = {WebEngine.SERPAPI: "/search.json", WebEngine.GOOGLE: "/customsearch/v1",
         WebEngine.BRAVE: "/res/v1/web/search", WebEngine.BING: "/v7.0/search"}


def fake_results(query: str, n: int) -> list[dict]:
    return [{"title": f"{query} page {i}", "snippet": f"About {query}, part {i}.",
             "url": f"https://example.org/{query.replace(' ', '-')}/{i}"} for i in range(n)]


def answer_body(path: str, query: str, n: int) -> dict:
    """The results in the JSON layout of the engine that serves `path`."""
    rs = fake_results(query, n)
    if path == PATHS[WebEngine.SERPAPI]:
        return {"search_metadata": {"status": "Success"}, "organic_results": [
            {"position": i + 1, "title": r["title"], "link": r["url"], "snippet": r["snippet"]}
            for i, r in enumerate(rs)]}
    if path == PATHS[WebEngine.GOOGLE]:
        return {"kind": "customsearch#search", "items": [
            {"kind": "customsearch#result", "title": r["title"], "link": r["url"],
             "snippet": r["snippet"]} for r in rs]}
    if path == PATHS[WebEngine.BRAVE]:
        # Brave highlights query terms with <strong>; the retriever must strip it.
        return {"type": "search", "web": {"type": "search", "results": [
            {"title": r["title"], "url": r["url"],
             "description": r["snippet"].replace(query, f"<strong>{query}</strong>")}
            for r in rs]}}
    if path == PATHS[WebEngine.BING]:
        return {"_type": "SearchResponse", "webPages": {"value": [
            {"name": r["title"], "url": r["url"], "snippet": r["snippet"]} for r in rs]}}
    raise AssertionError(path)


class FakeEngines:
    """Local stand-in for the four search APIs.

    `plan[query]` is a list of actions used up one per request for that query ("ok" once it
    runs out): an int status code to fail with, ("429", retry_after) to throttle, or
    ("sleep", seconds) to stall before answering.
    """

    def __init__(self):
        self.requests: list[dict] = []
        self.plan: dict[str, list] = {}
        self.delay = 0.0
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                url = urlsplit(self.path)
                params = {k: v[0] for k, v in parse_qs(url.query).items()}
                query = params.get("q", "")
                with fake.lock:
                    fake.requests.append({"path": url.path, "params": params,
                                          "headers": dict(self.headers)})
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    steps = fake.plan.get(query)
                    action = steps.pop(0) if steps else "ok"
                time.sleep(fake.delay)
                if isinstance(action, tuple) and action[0] == "sleep":
                    time.sleep(action[1])
                # Leave the count before answering: once the answer is out the client may send
                # its next request before this thread runs again.
                with fake.lock:
                    fake.in_flight -= 1
                if isinstance(action, int):
                    return self.reply(action, {"error": "boom"})
                if isinstance(action, tuple) and action[0] == "429":
                    return self.reply(429, {"error": "slow down"}, {"Retry-After": action[1]})
                n = int(params.get("num") or params.get("count") or 10)
                self.reply(200, answer_body(url.path, query, n))

            def reply(self, status, body, headers=None):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False  # don't wait for a stalled handler at shutdown
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def url(self, engine: WebEngine) -> str:
        return f"http://127.0.0.1:{self.port}{PATHS[engine]}"

    def count(self, query: str | None = None) -> int:
        return sum(1 for r in self.requests if query is None or r["params"].get("q") == query)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake(monkeypatch):
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        # Requests to 127.0.0.1 must not go to a proxy.
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    server = FakeEngines()
    yield server
    server.close()


@pytest.fixture
def make(fake):
    made = []

    def make_retriever(engine=WebEngine.BRAVE, **kw):
        kw = {"base_url": fake.url(engine), "timeout": 2.0, "retries": 2, "backoff": 0.01, **kw}
        r = WebSearchRetriever(engine, **kw)
        made.append(r)
        return r

    yield make_retriever
    for r in made:
        r.close()


@pytest.mark.parametrize("engine", list(WebEngine))
def test_each_engine_parses_results_in_order_and_sends_its_key(make, fake, engine):
    r = make(engine)
    hits = r.search(["capital of france", "tallest mountain"], topk=3)

    assert [len(h) for h in hits] == [3, 3]
    for query, query_hits in zip(["capital of france", "tallest mountain"], hits):
        expected = fake_results(query, 3)
        assert [h.passage.id for h in query_hits] == [e["url"] for e in expected]
        assert [h.passage.title for h in query_hits] == [e["title"] for e in expected]
        assert [h.passage.contents for h in query_hits] == \
            [f'"{e["title"]}"\n{e["snippet"]}' for e in expected]  # Brave's <strong> is gone
        assert [h.score for h in query_hits] == [1.0, 0.5, pytest.approx(1 / 3)]

    sent = fake.requests[0]
    params, headers = sent["params"], {k.lower(): v for k, v in sent["headers"].items()}
    assert sent["path"] == PATHS[engine]
    if engine == WebEngine.SERPAPI:
        assert params["api_key"] == KEYS["SERPAPI_API_KEY"] and params["num"] == "3"
        assert params["engine"] == "google"
    elif engine == WebEngine.GOOGLE:
        assert params["key"] == KEYS["GOOGLE_API_KEY"] and params["cx"] == KEYS["GOOGLE_CSE_ID"]
        assert params["num"] == "3"
    elif engine == WebEngine.BRAVE:
        assert headers["x-subscription-token"] == KEYS["BRAVE_API_KEY"] and params["count"] == "3"
    elif engine == WebEngine.BING:
        assert headers["ocp-apim-subscription-key"] == KEYS["BING_API_KEY"]
        assert params["count"] == "3"
    if engine in (WebEngine.BRAVE, WebEngine.BING):  # header engines keep the key out of the URL
        assert KEYS[KEY_ENV[engine][0]] not in json.dumps(params)
    assert r.errors == 0


def test_max_topk_is_the_engines_per_request_limit(make):
    assert {e: make(e).max_topk for e in WebEngine} == {
        WebEngine.SERPAPI: 100, WebEngine.GOOGLE: 10, WebEngine.BRAVE: 20, WebEngine.BING: 50}
    with pytest.raises(ValueError, match="1..10"):
        make(WebEngine.GOOGLE).search(["q"], topk=11)


def test_duplicate_queries_in_a_batch_are_fetched_once(make, fake):
    hits = make().search(["same", "other", "same"], topk=2)
    assert fake.count("same") == 1 and hits[0] == hits[2] and hits[0] is not hits[2]


def test_cache_avoids_the_network_and_survives_a_new_instance(make, fake, tmp_path):
    first = make(cache_dir=tmp_path).search(["a", "b"], topk=2)
    assert fake.count() == 2

    assert make(cache_dir=tmp_path).search(["a", "b"], topk=2) == first
    assert make(cache_dir=tmp_path).search(["b"], topk=2) == first[1:]
    assert fake.count() == 2
    make(cache_dir=tmp_path).search(["a"], topk=3)  # another topk is another entry
    assert fake.count() == 3


def test_corrupt_cache_entry_is_refetched_and_rewritten(make, fake, tmp_path):
    expected = make(cache_dir=tmp_path).search(["a"], topk=2)
    [entry] = tmp_path.rglob("*.json")
    entry.write_text('{"engine": "brave", "hits": [tru')

    assert make(cache_dir=tmp_path).search(["a"], topk=2) == expected
    assert fake.count() == 2
    assert json.loads(entry.read_text())["hits"][0]["id"] == expected[0][0].passage.id
    assert not list(tmp_path.rglob("*.tmp"))


def test_retries_on_500_and_429_then_succeeds(make, fake):
    fake.plan["flaky"] = [500, ("429", "0"), 503]
    r = make(retries=3)
    hits = r.search(["flaky"], topk=2)
    assert [h.passage.title for h in hits[0]] == ["flaky page 0", "flaky page 1"]
    assert fake.count("flaky") == 4 and r.errors == 0


def test_retry_after_is_honoured_up_to_the_cap(make, fake):
    fake.plan["throttled"] = [("429", "3600")]
    r = make(retries=1, max_backoff=0.3)
    start = time.monotonic()
    assert len(r.search(["throttled"], topk=1)[0]) == 1
    assert 0.3 <= time.monotonic() - start < 2.0


def test_exhausted_retries_empty_that_query_only(make, fake, caplog):
    fake.plan["broken"] = [500] * 10
    r = make(retries=2)
    with caplog.at_level(logging.WARNING, logger="search_r1.retrieval.web"):
        hits = r.search(["fine one", "broken", "fine two"], topk=2)
    assert hits[1] == [] and len(hits[0]) == len(hits[2]) == 2
    assert fake.count("broken") == 3 and r.errors == 1
    assert "broken" in caplog.text and "HTTP 500" in caplog.text


def test_client_errors_are_not_retried(make, fake):
    fake.plan["bad key"] = [401]
    r = make(retries=3)
    assert r.search(["bad key"], topk=1) == [[]]
    assert fake.count("bad key") == 1 and r.errors == 1


def test_timeout_is_enforced(make, fake):
    fake.plan["stalls"] = [("sleep", 3.0)]
    r = make(timeout=0.3, retries=0)
    start = time.monotonic()
    hits = r.search(["stalls", "quick"], topk=1)
    assert time.monotonic() - start < 2.0
    assert hits[0] == [] and len(hits[1]) == 1 and r.errors == 1


def test_concurrency_limit_is_respected(make, fake):
    fake.delay = 0.1  # long enough for requests to overlap if the retriever lets them
    hits = make(max_concurrency=3).search([f"q{i}" for i in range(12)], topk=1)
    assert all(len(h) == 1 for h in hits)
    assert fake.max_in_flight == 3  # in parallel, but never more than 3 at once


@pytest.mark.parametrize("engine", [WebEngine.SERPAPI, WebEngine.GOOGLE, WebEngine.BRAVE])
def test_api_key_never_reaches_logs_or_cache(make, fake, tmp_path, caplog, engine):
    key = KEYS[KEY_ENV[engine][0]]
    fake.plan["fails"] = [500] * 10
    # Libraries imported earlier in the session (vLLM's logging set-up) may have disabled
    # existing loggers; this test needs httpx's records to prove they are redacted.
    for name in ("httpx", "httpcore", "search_r1.retrieval.web"):
        logging.getLogger(name).disabled = False
        logging.getLogger(name).propagate = True
        caplog.set_level(logging.DEBUG, logger=name)  # some libraries raise httpx's level
    caplog.set_level(logging.DEBUG)
    r = make(engine, cache_dir=tmp_path, retries=1)
    r.search(["works", "fails"], topk=2)
    make(engine, base_url="http://127.0.0.1:1/nothing-listens-here", retries=0).search(["x"], 1)

    assert any(rec.name == "httpx" for rec in caplog.records)  # request URLs were logged…
    assert all(key not in rec.getMessage() for rec in caplog.records)  # …with the key blanked
    assert key not in caplog.text
    cached = [p.read_text() for p in tmp_path.rglob("*") if p.is_file()]
    assert cached and all(key not in text for text in cached)


def test_google_search_engine_id_never_reaches_logs(make, fake, monkeypatch, caplog):
    """httpx logs each request URL at INFO; Google's carries the search engine id (`cx`) beside
    the key, and only the key was blanked."""
    cse_id = "017576662512468239146:omuauf_lfve"  # the layout of real ids: `:` is sent as %3A
    monkeypatch.setenv("GOOGLE_CSE_ID", cse_id)
    fake.plan["fails"] = [500] * 10
    for name in ("httpx", "httpcore", "search_r1.retrieval.web"):
        logging.getLogger(name).disabled = False
        logging.getLogger(name).propagate = True
        caplog.set_level(logging.DEBUG, logger=name)
    caplog.set_level(logging.DEBUG)
    make(WebEngine.GOOGLE, retries=1).search(["works", "fails"], topk=2)

    assert fake.requests[0]["params"]["cx"] == cse_id  # sent…
    assert any(rec.name == "httpx" and "cx=" in rec.getMessage() for rec in caplog.records)
    for secret in (cse_id, quote(cse_id, safe=""), KEYS["GOOGLE_API_KEY"]):
        assert secret not in caplog.text  # …and never logged


@pytest.mark.parametrize("engine", list(WebEngine))
def test_missing_key_names_the_variable(monkeypatch, engine):
    for name in KEY_ENV[engine]:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=KEY_ENV[engine][-1]):
        WebSearchRetriever(engine)


def test_google_needs_the_search_engine_id_too(monkeypatch):
    monkeypatch.setenv("GOOGLE_API_KEY", KEYS["GOOGLE_API_KEY"])
    monkeypatch.delenv("GOOGLE_CSE_ID", raising=False)
    with pytest.raises(ValueError, match="GOOGLE_CSE_ID") as err:
        WebSearchRetriever("google")
    assert KEYS["GOOGLE_API_KEY"] not in str(err.value)


def test_unknown_engine_lists_the_choices():
    with pytest.raises(ValueError, match="serpapi, google, brave, bing"):
        WebSearchRetriever("altavista")


def test_an_engine_that_refuses_every_call_makes_the_server_unhealthy(make, fake):
    """A bad key answers each query with an error that the server can only pass on as no hits: the
    errors are counted, and /health turns 503 with the cause while the engine fails every call."""
    from fastapi.testclient import TestClient

    from search_r1.retrieval.server import create_app
    for q in ("q1", "q2", "q3", "q4"):
        fake.plan[q] = [401]
    r = make(retries=0)
    with TestClient(create_app(r, name="brave")) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/retrieve", json={"queries": ["q1", "q2", "q3"], "topk": 1}).json()["result"] == [[], [], []]
        health = client.get("/health")
        assert health.status_code == 503 and "HTTP 401" in str(health.json()["problems"])
        assert health.json()["stats"]["upstream_errors"] == 3
        assert "retrieval_upstream_errors 3.0" in client.get("/metrics").text
        client.post("/retrieve", json={"queries": ["works now"], "topk": 1})  # the engine answers again
        assert client.get("/health").status_code == 200
