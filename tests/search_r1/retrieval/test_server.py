"""The retrieval server as users run it: a real process (or a real uvicorn in a thread) on
127.0.0.1, the real MiniLM encoder and the exact index over a small corpus."""
import json
import os
import threading
from pathlib import Path
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import uvicorn

from search_r1.cli import main as cli_main
from search_r1.retrieval.base import Retriever
from search_r1.retrieval.factory import RetrieverArgs, build_retriever
from search_r1.retrieval.server import ServerConfig, create_app
from conftest import free_port


@pytest.fixture(autouse=True)
def keep_tokenizers_parallelism(monkeypatch):
    """`search-r1 serve` run in this process sets TOKENIZERS_PARALLELISM=true: undone after each test."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM", "false"))


def post(server, body, **kw):
    return httpx.post(server.url + "/retrieve", json=body, timeout=30, **kw)


@pytest.mark.e2e  # dense_server: a server process
def test_answer_layout_with_and_without_scores(dense_server):
    r = post(dense_server, {"queries": ["capital of Japan", "who painted the Mona Lisa"],
                            "topk": 2, "return_scores": True})
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == 2 and all(len(hits) == 2 for hits in result)
    assert result[0][0]["document"]["contents"].startswith('"Tokyo"')
    assert result[1][0]["document"]["contents"].startswith('"Leonardo da Vinci"')
    assert result[0][0]["score"] >= result[0][1]["score"]
    # return_scores false (the original server crashes here): documents only.
    r = post(dense_server, {"queries": ["capital of Japan"], "topk": 2, "return_scores": False})
    doc = r.json()["result"][0][0]
    assert set(doc) == {"id", "contents"} and doc["id"] == "5"
    # No topk: the server's default (3).
    assert len(post(dense_server, {"queries": ["capital of Japan"]}).json()["result"][0]) == 3


@pytest.mark.e2e  # dense_server: a server process
def test_concurrent_answers_equal_sequential(dense_server):
    queries = [f"{w} capital city" for w in ("French", "German", "Spanish", "Italian", "Peruvian",
                                              "Kenyan", "Japanese", "Canadian")] + \
              ["red planet", "largest river", "theory of relativity", "board game with 64 squares"]
    sequential = [post(dense_server, {"queries": [q], "topk": 3, "return_scores": True}).json()
                  for q in queries]
    with ThreadPoolExecutor(12) as pool:
        for _ in range(3):
            concurrent = list(pool.map(
                lambda q: post(dense_server, {"queries": [q], "topk": 3, "return_scores": True}).json(),
                queries))
            for a, b in zip(sequential, concurrent):
                assert [h["document"]["id"] for h in a["result"][0]] == \
                       [h["document"]["id"] for h in b["result"][0]]
                for ha, hb in zip(a["result"][0], b["result"][0]):
                    assert ha["score"] == pytest.approx(hb["score"], abs=1e-5)
    metrics = httpx.get(dense_server.url + "/metrics").text
    assert "retrieval_batch_queries_bucket" in metrics and "retrieval_request_seconds_count" in metrics


BAD_INPUTS = [
    (b"{not json", 422),
    (b"[[[" * 100_000, 422),  # nested deeper than the JSON parser recurses
    (b'["a list"]', 422),
    (json.dumps({"queries": "one string"}).encode(), 422),
    (json.dumps({"queries": [1, 2]}).encode(), 422),
    (json.dumps({"queries": ["ok"], "topk": "3"}).encode(), 422),
    (json.dumps({"queries": ["ok"], "topk": 2.5}).encode(), 422),
    (json.dumps({"queries": ["ok"], "return_scores": "yes"}).encode(), 422),
    (json.dumps({"topk": 3}).encode(), 422),
    (b'{"queries": ["ok", "\\ud800"]}', 400),  # a lone surrogate, as JSON escapes it
    (json.dumps({"queries": ["ok"], "topk": 0}).encode(), 400),
    (json.dumps({"queries": ["ok"], "topk": -1}).encode(), 400),
    (json.dumps({"queries": ["ok"], "topk": 21}).encode(), 400),
    (json.dumps({"queries": ["ok"] * 65}).encode(), 413),
    (json.dumps({"queries": ["x" * 100_001]}).encode(), 413),
]


@pytest.mark.parametrize("body,status", BAD_INPUTS,
                         ids=[f"{status}-{body[:24].decode()}" for body, status in BAD_INPUTS])
@pytest.mark.e2e  # dense_server: a server process
def test_bad_input_gets_clear_4xx_and_server_keeps_serving(dense_server, body, status):
    r = httpx.post(dense_server.url + "/retrieve", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and r.json()["error"]
    assert "retry-after" not in r.headers  # a 4xx is not worth retrying
    assert post(dense_server, {"queries": ["capital of Japan"], "topk": 1}).status_code == 200


@pytest.mark.e2e  # dense_server: a server process
def test_errors_from_the_framework_have_the_same_shape(dense_server):
    for r in (httpx.get(dense_server.url + "/retrieve"), httpx.post(dense_server.url + "/nowhere", json={}),
              httpx.post(dense_server.url + "/access", json={"urls": ["https://x"]})):
        assert r.status_code in (404, 405) and set(r.json()) == {"error"}, r.text
    assert "--pages_path" in r.json()["error"]  # a server started without pages says how to get them


@pytest.mark.e2e  # dense_server: a server process
def test_what_the_original_accepted_is_answered(dense_server, real_retriever):
    """Empty query lists, blank queries (`<search> </search>`) and over-long queries: 200."""
    r = post(dense_server, {"queries": [], "topk": 3, "return_scores": True})
    assert r.status_code == 200 and r.json() == {"result": []}
    long_query = "which city is the capital of Japan " * 60  # 2,100 characters
    r = post(dense_server, {"queries": ["", "   ", long_query, "capital of Japan"], "topk": 3,
                            "return_scores": True})
    assert r.status_code == 200, r.text
    blank, spaces, long, short = r.json()["result"]
    assert len(blank) == len(spaces) == 3  # a dense retriever ranks every passage, even for nothing
    assert long[0]["document"]["contents"].startswith('"Tokyo"')
    # The encoder cut the long query at its max length, as the original did.
    encoder = real_retriever.encoder
    assert encoder.tokenize([long_query])["input_ids"].shape[1] == encoder.max_length
    assert [len(hits) for hits in real_retriever.search(["", " "], 3)] == [3, 3]


def test_unknown_fields_are_accepted_and_logged_once_per_name(real_retriever, caplog):
    server = ThreadServer(create_app(real_retriever, ServerConfig()))
    try:
        with caplog.at_level("WARNING", logger="search_r1.retrieval.server"):
            for _ in range(3):
                r = post(server, {"queries": ["capital of Japan"], "topk": 1, "return_score": True,
                                  "mode": 2})
                assert r.status_code == 200
                assert set(r.json()["result"][0][0]) == {"id", "contents"}  # return_scores stays false
        warnings = [rec.getMessage() for rec in caplog.records if "unknown request field" in rec.getMessage()]
        assert len(warnings) == 2, warnings
        assert any("'return_score'" in w and "did you mean 'return_scores'" in w for w in warnings)
    finally:
        server.stop()


def test_large_request_is_split_into_batches_and_admitted_on_an_empty_queue(real_retriever):
    wrapped = Wrapped(real_retriever)
    cfg = ServerConfig(max_batch=16, max_pending=32, max_wait_ms=0, max_queries_per_request=200)
    server = ThreadServer(create_app(wrapped, cfg))
    wrapped.calls.clear()  # the start-up probe's
    try:
        queries = [f"capital of {c}" for c in ("Japan", "France", "Peru", "Kenya", "Canada")] * 20
        r = post(server, {"queries": queries, "topk": 1, "return_scores": True})
        assert r.status_code == 200, r.text
        assert [hits[0]["document"]["contents"].split("\n")[0] for hits in r.json()["result"]] == \
               ['"Tokyo"', '"Paris"', '"Lima"', '"Nairobi"', '"Ottawa"'] * 20
        assert max(wrapped.calls) <= 16 and sum(wrapped.calls) == 100
        too_many = post(server, {"queries": ["x"] * 201})
        assert too_many.status_code == 413 and "--max_queries_per_request" in too_many.json()["error"]
        assert "retry-after" not in too_many.headers
        assert httpx.get(server.url + "/health").json()["pending_queries"] == 0
    finally:
        server.stop()


def test_lone_surrogate_is_refused_before_it_reaches_a_batch(real_retriever):
    wrapped = Wrapped(real_retriever)
    server = ThreadServer(create_app(wrapped, ServerConfig()))
    wrapped.calls.clear()  # the start-up probe's
    try:
        r = httpx.post(server.url + "/retrieve", content=b'{"queries": ["ok", "bad \\udc80 one"]}',
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "queries[1]" in r.json()["error"] and "surrogate" in r.json()["error"]
        assert wrapped.calls == []
    finally:
        server.stop()


def test_startup_refuses_mismatched_or_missing_files(dense_index, tmp_path, capsys):
    from conftest import FACTS, write_corpus
    short = write_corpus(tmp_path / "short.jsonl", FACTS[:-3])
    args = ["serve", "--retriever_model", "all-MiniLM-L6-v2", "--index_path", str(dense_index),
            "--corpus_path", str(short)]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "37 rows" in err and "40 vectors" in err and "short" in err
    assert cli_main(["serve", "--index_path", str(tmp_path / "nope"),
                     "--corpus_path", str(short)]) == 2
    assert "nope does not exist" in capsys.readouterr().err


def test_encoder_cuda_graphs_asked_for_on_cpu_stop_the_start(dense_index, corpus_jsonl, capsys):
    args = ["serve", "--retriever_model", "all-MiniLM-L6-v2", "--index_path", str(dense_index),
            "--corpus_path", str(corpus_jsonl), "--devices", "cpu", "--encoder_cuda_graphs"]
    assert cli_main(args) == 2
    assert "cuda_graphs needs a CUDA device; the encoder is on cpu" in capsys.readouterr().err


def test_server_tokenises_in_parallel_whatever_the_environment_says(monkeypatch, caplog):
    from search_r1.retrieval.server import parallel_tokenizers
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    with caplog.at_level("INFO", logger="search_r1.retrieval.server"):
        parallel_tokenizers()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true" and "TOKENIZERS_PARALLELISM=false ignored" in caplog.text


class ThreadServer:
    """uvicorn in a thread, for tests that wrap the real retriever."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


class Wrapped(Retriever):
    """The real dense retriever, slowed down or failing on a marked query, to drive the queue."""

    def __init__(self, inner, delay=0.0, poison="POISON"):
        self.inner, self.delay, self.poison, self.calls = inner, delay, poison, []

    def search(self, queries, topk):
        self.calls.append(len(queries))
        time.sleep(self.delay)
        if self.poison in queries:
            raise ValueError("cannot search this")
        return self.inner.search(queries, topk)


@pytest.fixture(scope="module")
def real_retriever(dense_index, corpus_jsonl):
    return build_retriever(RetrieverArgs(retriever_name="minilm", retriever_model="all-MiniLM-L6-v2",
                                         index_path=str(dense_index), corpus_path=str(corpus_jsonl)))


def test_cross_request_batching_and_one_bad_request(real_retriever):
    wrapped = Wrapped(real_retriever, delay=0.05)
    server = ThreadServer(create_app(wrapped, ServerConfig(max_wait_ms=50)))
    wrapped.calls.clear()  # the start-up probe's
    try:
        bodies = [{"queries": ["capital of Japan"]}, {"queries": ["POISON"]},
                  {"queries": ["red planet", "largest river"]}] * 3
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(server, b), bodies))
        for body, r in zip(bodies, answers):
            if body["queries"] == ["POISON"]:
                assert r.status_code == 500 and "search failed" in r.json()["error"]
            else:
                assert r.status_code == 200 and len(r.json()["result"]) == len(body["queries"])
        assert max(wrapped.calls) > 2  # queries of several requests went into one search call
    finally:
        server.stop()


class TwoStage(Retriever):
    """The real dense retriever's two halves, timed, slowed down, and failing on marked queries:
    POISON in `encode`, BADLOOKUP in `lookup` (its encoding is marked with NaN)."""

    two_stage = True

    def __init__(self, inner, delay=0.0, memo=False):
        self.inner, self.delay = inner, delay
        # memo: each query's real encoding is kept, so that a stage takes its delay and little more
        # however busy the machine's cores are with other work.
        self.memo: dict[str, np.ndarray] | None = {} if memo else None
        self.forget()

    def forget(self):
        self.intervals = {"encode": [], "lookup": []}  # (start, end, queries) of every call

    def search(self, queries, topk):
        return self.lookup(self.encode(queries), topk)

    def encode(self, queries):
        t = time.perf_counter()
        try:
            time.sleep(self.delay)
            if "POISON" in queries:
                raise ValueError("cannot encode this")
            if self.memo is not None:
                if new := [q for q in dict.fromkeys(queries) if q not in self.memo]:
                    self.memo.update(zip(new, self.inner.encode(new)))
                return np.stack([self.memo[q] for q in queries])
            q_BD = self.inner.encode(queries)
            q_BD[[q == "BADLOOKUP" for q in queries]] = float("nan")
            return q_BD
        finally:
            self.intervals["encode"].append((t, time.perf_counter(), len(queries)))

    def lookup(self, q_BD, topk):
        t = time.perf_counter()
        try:
            time.sleep(self.delay)
            if np.isnan(q_BD).any():
                raise ValueError("cannot look this up")
            return self.inner.lookup(q_BD, topk)
        finally:
            self.intervals["lookup"].append((t, time.perf_counter(), len(q_BD)))


def test_pipelined_worker_batches_and_a_bad_request_in_either_stage(real_retriever):
    two = TwoStage(real_retriever, delay=0.05)
    server = ThreadServer(create_app(two, ServerConfig(max_wait_ms=50, pipeline=True)))
    two.forget()  # the start-up probe's calls
    try:
        assert httpx.get(server.url + "/health").json()["pipelined"] is True
        bodies = [{"queries": ["capital of Japan"]}, {"queries": ["POISON"]}, {"queries": ["BADLOOKUP"]},
                  {"queries": ["red planet", "largest river"]}] * 3
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(server, b), bodies))
        for body, r in zip(bodies, answers):
            if body["queries"][0] in ("POISON", "BADLOOKUP"):
                assert r.status_code == 500 and "search failed" in r.json()["error"]
            else:
                assert r.status_code == 200 and len(r.json()["result"]) == len(body["queries"])
        assert answers[0].json()["result"][0][0]["contents"].startswith('"Tokyo"')
        assert max(n for _, _, n in two.intervals["lookup"]) > 2  # several requests in one lookup
        health = httpx.get(server.url + "/health").json()
        assert health["worker_alive"] and health["pending_queries"] == 0
    finally:
        server.stop()


def test_pipelined_worker_encodes_while_it_looks_up(real_retriever):
    """One query per batch, each stage 0.2 s: the encoder must be at work on a later batch while
    an earlier one is looked up (one thread doing both would never overlap them)."""
    two = TwoStage(real_retriever, delay=0.2)
    server = ThreadServer(create_app(two, ServerConfig(max_batch=1, max_wait_ms=0, pipeline=True)))
    try:
        with ThreadPoolExecutor(4) as pool:
            codes = [r.status_code for r in pool.map(lambda q: post(server, {"queries": [q]}),
                                                      ["capital of Japan", "red planet", "largest river", "chess"])]
        assert codes == [200] * 4
        overlaps = [(e, l) for e in two.intervals["encode"] for l in two.intervals["lookup"]
                    if e[0] < l[1] and l[0] < e[1]]
        assert overlaps, two.intervals
    finally:
        server.stop()


def test_no_pipeline_keeps_one_worker_thread(real_retriever):
    two = TwoStage(real_retriever, delay=0.1)
    server = ThreadServer(create_app(two, ServerConfig(max_batch=1, max_wait_ms=0, pipeline=False)))
    try:
        assert httpx.get(server.url + "/health").json()["pipelined"] is False
        with ThreadPoolExecutor(3) as pool:
            codes = [r.status_code for r in pool.map(lambda q: post(server, {"queries": [q]}),
                                                      ["capital of Japan", "red planet", "chess"])]
        assert codes == [200] * 3
        calls = sorted(two.intervals["encode"] + two.intervals["lookup"])
        assert all(a[1] <= b[0] for a, b in zip(calls, calls[1:]))  # one call at a time
    finally:
        server.stop()


def test_back_pressure_sheds_load_with_retry_after(real_retriever):
    server = ThreadServer(create_app(Wrapped(real_retriever, delay=0.3),
                                     ServerConfig(max_pending=4, max_batch=2, max_wait_ms=0)))
    try:
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda _: post(server, {"queries": ["a", "b"]}), range(10)))
        codes = [r.status_code for r in answers]
        assert 200 in codes and 503 in codes, codes
        shed = next(r for r in answers if r.status_code == 503)
        assert shed.headers["retry-after"] == "1"
        assert post(server, {"queries": ["capital of Japan"]}).status_code == 200  # recovers
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "ok" and health["pending_queries"] == 0
    finally:
        server.stop()


def test_api_key(real_retriever):
    server = ThreadServer(create_app(real_retriever, ServerConfig(api_key="s3cret")))
    try:
        assert post(server, {"queries": ["x"]}).status_code == 401
        assert post(server, {"queries": ["x"]}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert post(server, {"queries": ["x"]}, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        # with a key, only /health answers without it: metrics need it, the API docs are off
        assert httpx.get(server.url + "/metrics").status_code == 401
        assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert httpx.get(server.url + path).status_code == 404
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


@pytest.mark.e2e  # more server processes
def test_retrieval_launch_script(dense_index, corpus_jsonl, tmp_path):
    """The launcher with the original's flags, pointed at the test corpus by environment."""
    import os
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[3]
    port = free_port()
    env = {**os.environ, "INDEX_PATH": str(dense_index), "CORPUS_PATH": str(corpus_jsonl),
           "RETRIEVER_NAME": "minilm", "RETRIEVER_MODEL": "all-MiniLM-L6-v2"}
    proc = subprocess.Popen(["bash", str(root / "retrieval_launch.sh"), "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": ["capital of Japan"]})
                break
            except httpx.TransportError:
                assert proc.poll() is None, "launcher exited"
                time.sleep(0.3)
        assert r.status_code == 200 and len(r.json()["result"][0]) == 3
    finally:
        proc.terminate()
        proc.wait(10)


def worker_pids(pid: int) -> list[int]:
    """Child processes of `pid` (Linux /proc), less multiprocessing's resource tracker."""
    from pathlib import Path
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    return [c for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.e2e  # more server processes
def test_worker_process_answers_like_the_worker_thread(dense_server, dense_index, corpus_jsonl, tmp_path):
    """`--worker_process`: the same answers as the server with the retriever in its thread; a worker
    process that dies is replaced (the request that saw it die may fail, the next ones are answered)."""
    import os
    import signal

    from conftest import ServerProcess
    server = ServerProcess(["--retriever_name", "minilm", "--retriever_model", "all-MiniLM-L6-v2",
                            "--index_path", str(dense_index), "--corpus_path", str(corpus_jsonl),
                            "--worker_process"], tmp_path / "worker_process.log")
    try:
        body = {"queries": ["capital of Japan", "red planet", "board game with 64 squares"], "topk": 3,
                "return_scores": True}
        ours, theirs = post(server, body).json()["result"], post(dense_server, body).json()["result"]
        assert [[h["document"]["id"] for h in hits] for hits in ours] == \
               [[h["document"]["id"] for h in hits] for hits in theirs]
        assert ours[0][0]["score"] == pytest.approx(theirs[0][0]["score"], abs=1e-5)
        assert httpx.get(server.url + "/health").json()["stats"]  # the child's counters come back

        children = worker_pids(server.proc.pid)
        assert len(children) == 1, "one worker process"
        os.kill(children[0], signal.SIGKILL)
        time.sleep(0.5)
        statuses = [post(server, {"queries": ["capital of Japan"], "topk": 1}).status_code for _ in range(2)]
        assert statuses[-1] == 200 and set(statuses) <= {200, 500}
        assert post(server, body).json()["result"] == ours
        replaced = worker_pids(server.proc.pid)
        assert len(replaced) == 1 and replaced != children
    finally:
        server.stop()


@pytest.mark.e2e  # more server processes
def test_serve_pipelined_by_default_answers_like_one_worker_thread(dense_server, dense_index, corpus_jsonl,
                                                                     tmp_path):
    """`search-r1 serve` pipelines a dense retriever by default; under concurrent load it answers as
    `--no-pipeline` (one worker thread) does."""
    from conftest import ServerProcess
    health = httpx.get(dense_server.url + "/health").json()
    assert health["pipelined"] is True and health["worker_alive"]
    one_thread = ServerProcess(["--retriever_name", "minilm", "--retriever_model", "all-MiniLM-L6-v2",
                                "--index_path", str(dense_index), "--corpus_path", str(corpus_jsonl),
                                "--no-pipeline"], tmp_path / "no_pipeline.log")
    try:
        assert httpx.get(one_thread.url + "/health").json()["pipelined"] is False
        queries = ["capital of Japan", "red planet", "largest river", "board game with 64 squares",
                   "theory of relativity", "French capital city"] * 3
        with ThreadPoolExecutor(len(queries)) as pool:
            ours = list(pool.map(lambda q: post(dense_server, {"queries": [q], "return_scores": True}).json(),
                                 queries))
        for q, answer in zip(queries, ours):
            theirs = post(one_thread, {"queries": [q], "return_scores": True}).json()
            assert [h["document"]["id"] for h in answer["result"][0]] == \
                   [h["document"]["id"] for h in theirs["result"][0]]
            assert answer["result"][0][0]["score"] == pytest.approx(theirs["result"][0][0]["score"], abs=1e-5)
    finally:
        one_thread.stop()


@pytest.mark.e2e  # more server processes
def test_worker_process_start_up_errors_reach_the_command_line(dense_index, tmp_path, capsys):
    from conftest import FACTS, write_corpus
    short = write_corpus(tmp_path / "short.jsonl", FACTS[:-3])
    assert cli_main(["serve", "--retriever_model", "all-MiniLM-L6-v2", "--index_path", str(dense_index),
                     "--corpus_path", str(short), "--worker_process"]) == 2
    err = capsys.readouterr().err
    assert "37 rows" in err and "40 vectors" in err


def test_work_nobody_waits_for_is_not_searched(real_retriever):
    """Goodput under overload: queued requests whose X-Timeout-S passed, or would before they are
    searched (or whose client went away), are dropped unsearched and answered 504, instead of being
    worked through after their clients gave up while the clients still waiting time out."""
    slow = Wrapped(real_retriever)
    server = ThreadServer(create_app(slow, ServerConfig(max_batch=1, max_wait_ms=0)))
    # Slow only after the start-up probe: admission, which judges by the probe's rate, lets the
    # requests in, and it is the queue that must drop those whose clients gave up.
    slow.delay = 0.4
    slow.calls.clear()
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: post(server, {"queries": [f"capital {i}"]},
                                                   headers={"X-Timeout-S": "1"}), range(8)))
        codes = sorted(r.status_code for r in answers)
        assert codes.count(200) >= 1 and codes.count(504) >= 5, codes
        assert len(slow.calls) <= 3, slow.calls  # not one search per request
        assert "X-Timeout-S" in next(r for r in answers if r.status_code == 504).json()["error"]
        metrics = httpx.get(server.url + "/metrics").text
        assert "retrieval_expired_total" in metrics
        assert post(server, {"queries": ["x"]}, headers={"X-Timeout-S": "soon"}).status_code == 400
        assert post(server, {"queries": ["capital of Japan"]}).status_code == 200  # no header: no deadline
    finally:
        server.stop()


@pytest.mark.e2e  # a server under load, in real time
def test_work_that_would_expire_in_the_queue_is_refused_at_once(real_retriever):
    """Admission by expected wait: once the server has measured how fast it answers, a request whose
    X-Timeout-S the queue ahead of it would outlast gets 503 with Retry-After at once, instead of
    queueing until 504; requests without the header queue as before."""
    slow = Wrapped(real_retriever, delay=0.25)
    server = ThreadServer(create_app(slow, ServerConfig(max_batch=1, max_wait_ms=0)))
    slow.calls.clear()  # the start-up probe's
    try:
        with ThreadPoolExecutor(6) as pool:  # measure the rate: a few searches back to back
            assert all(r.status_code == 200 for r in pool.map(
                lambda i: post(server, {"queries": [f"capital {i}"]}), range(6)))
        with ThreadPoolExecutor(8) as pool:
            started = time.monotonic()
            answers = list(pool.map(lambda i: (post(server, {"queries": [f"river {i}"]},
                                                     headers={"X-Timeout-S": "0.6"}), time.monotonic() - started),
                                    range(8)))
        codes = [(r.status_code, round(t, 2)) for r, t in answers]
        refused = [r for r, _ in answers if r.status_code == 503]  # only admission answers 503 here
        assert refused and "outlast" in refused[0].json()["error"], codes
        assert int(refused[0].headers["Retry-After"]) >= 1
        assert any(r.status_code == 200 for r, _ in answers), codes  # the first always gets in
        assert len(slow.calls) <= 6 + len(answers) - len(refused), codes  # the refused were never searched
    finally:
        server.stop()


@pytest.mark.e2e  # a server under load, in real time
def test_slow_clients_cannot_hold_connections(real_retriever):
    """Slowloris: connections that drip their headers are closed after header_timeout_s, a body that
    does not arrive in body_timeout_s gets 408, and the server answers others meanwhile."""
    import socket

    from search_r1.retrieval.server import uvicorn_config
    cfg = ServerConfig(header_timeout_s=1.0, body_timeout_s=1.0)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(create_app(real_retriever, cfg), cfg, "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        drips = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for s in drips:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            s.settimeout(0.1)
        started, closed = time.monotonic(), set()
        while len(closed) < len(drips) and time.monotonic() - started < 5:
            for i, s in enumerate(drips):
                if i in closed:
                    continue
                try:
                    s.sendall(b"X-Slow: 1\r\n")  # a header line now and then, never the end
                    if s.recv(1) == b"":
                        closed.add(i)
                except socket.timeout:
                    pass
                except OSError:  # reset by the server
                    closed.add(i)
            assert httpx.get(url + "/health", timeout=5).status_code == 200  # others are served
        assert len(closed) == len(drips) and time.monotonic() - started < 4
        # a body announced but never sent: 408 once body_timeout_s has passed
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"queries\"")
        s.settimeout(5)
        assert b" 408 " in s.recv(200).split(b"\r\n")[0] + b" "
        s.close()
        # a normal client keeps its connection between requests
        with httpx.Client() as client:
            assert client.post(url + "/retrieve", json={"queries": ["capital of Japan"]}).status_code == 200
            assert client.post(url + "/retrieve", json={"queries": ["capital of Kenya"]}).status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)


# -- admission by expected wait, and work for clients that no longer wait ----------------------------

def post_with_timeout(server, queries, timeout_s):
    """A client like ours: it sends its read timeout as X-Timeout-S and stops waiting after it."""
    return httpx.post(server.url + "/retrieve", json={"queries": queries}, timeout=timeout_s,
                      headers={"X-Timeout-S": f"{timeout_s:g}"})


def wait_for_pending(server, n, limit_s=10):
    deadline = time.monotonic() + limit_s
    while httpx.get(server.url + "/health").json()["pending_queries"] < n:
        assert time.monotonic() < deadline, "the load never queued"
        time.sleep(0.01)


@pytest.mark.e2e  # a server under load, in real time
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "one-thread"])
def test_a_request_behind_a_queue_it_cannot_outwait_is_refused_at_once_from_the_first_burst(
        real_retriever, pipeline):
    """The first burst after start: without a rate measured at start-up the server had nothing to
    judge it by, and pipelined its measured rate was many times too fast, so the request queued
    until its X-Timeout-S passed (504) instead of being refused at once (503)."""
    two = TwoStage(real_retriever, delay=0.1)  # each batch of 2 takes ≥ 0.1 s per stage
    server = ThreadServer(create_app(two, ServerConfig(max_batch=2, max_wait_ms=0, pipeline=pipeline)))
    try:
        with ThreadPoolExecutor(10) as pool:
            load = [pool.submit(post, server, {"queries": [f"capital {i}", f"river {i}"]}) for i in range(10)]
            wait_for_pending(server, 12)  # ≥ 0.6 s of work queued
            started = time.monotonic()
            r = post_with_timeout(server, ["capital of Japan"], 0.5)
            answered_s = time.monotonic() - started
            assert [f.result().status_code for f in load] == [200] * 10
        assert r.status_code == 503 and answered_s < 0.3, (r.status_code, r.text, answered_s)
        assert "X-Timeout-S of 0.5 s" in r.json()["error"] and "--max_pending" not in r.json()["error"]
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        server.stop()


@pytest.mark.e2e  # a server under load, in real time
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "one-thread"])
def test_the_rate_admission_judges_by_is_the_rate_queries_are_answered(real_retriever, pipeline):
    """Pipelined, the encoder's release of a batch restarted the clock the lookup thread measured
    its batches by, and the rate read many times faster than the server answered."""
    two = TwoStage(real_retriever, delay=0.1)
    server = ThreadServer(create_app(two, ServerConfig(max_batch=2, max_wait_ms=0, pipeline=pipeline)))
    two.forget()  # the start-up probe's calls
    try:
        with ThreadPoolExecutor(16) as pool:
            codes = [r.status_code for r in pool.map(
                lambda i: post(server, {"queries": [f"capital {i}", f"river {i}"]}), range(16))]
        assert codes == [200] * 16
        # What the server answered, batch after batch, while busy: from its first answer to its last.
        lookups = sorted(two.intervals["lookup"], key=lambda call: call[1])
        served = sum(n for _, _, n in lookups[1:]) / (lookups[-1][1] - lookups[0][1])
        measured = httpx.get(server.url + "/health").json()["queries_per_s"]
        assert served / 2 < measured < 2 * served, (measured, served)
    finally:
        server.stop()


@pytest.mark.e2e  # a server under load, in real time
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "one-thread"])
def test_a_timeout_storm_spends_the_work_on_clients_still_waiting(real_retriever, pipeline):
    """Clients that give up after X-Timeout-S and ask again at once, more than the server can
    answer in time: the queries it searches are (nearly) all ones whose answer is still read,
    instead of a multiple of them."""
    two = TwoStage(real_retriever, delay=0.1, memo=True)
    server = ThreadServer(create_app(two, ServerConfig(max_batch=2, max_wait_ms=0, pipeline=pipeline)))
    two.forget()  # the start-up probe's calls
    answered = []
    queries = [f"storm query {i}" for i in range(4)]
    two.encode(queries)  # into the memo

    def client(i):
        end = time.monotonic() + 4
        while time.monotonic() < end:
            try:
                r = post_with_timeout(server, queries, 1.0)
            except httpx.TimeoutException:  # gave up as the server answered 504
                answered.append("gave up")
                continue
            answered.append(r.status_code)
            if r.status_code == 503:
                time.sleep(0.05)

    try:
        with ThreadPoolExecutor(10) as pool:  # 40 queries asked at once, ≤ 20 answered a second
            list(pool.map(client, range(10)))
        searched = sum(n for _, _, n in two.intervals["lookup"])
        read = answered.count(200) * len(queries)
        assert read >= 5 * len(queries), answered
        assert searched <= 1.25 * read + 4, (searched, read, {c: answered.count(c) for c in set(answered)})
    finally:
        server.stop()


@pytest.mark.e2e  # a server under load, in real time
def test_each_busy_answer_says_which_limit_refused_it(real_retriever):
    """A full queue and a wait the queue would outlast are different troubles (raise --max_pending,
    or wait longer / go elsewhere): one text served both."""
    slow = Wrapped(real_retriever, delay=1.0)
    server = ThreadServer(create_app(slow, ServerConfig(max_pending=5, max_batch=2, max_wait_ms=0)))
    try:
        with ThreadPoolExecutor(8) as pool:
            load = [pool.submit(post, server, {"queries": ["a", "b"]}) for _ in range(2)]
            wait_for_pending(server, 4)
            full = post(server, {"queries": ["c", "d"]})  # 4 + 2 > 5
            late = post_with_timeout(server, ["e"], 0.2)  # 4 + 1 fit, but take ≥ 2 s
            [f.result() for f in load]
        assert full.status_code == late.status_code == 503
        assert "--max_pending" in full.json()["error"] and "X-Timeout-S" not in full.json()["error"]
        assert "X-Timeout-S of 0.2 s" in late.json()["error"] and "--max_pending" not in late.json()["error"]
    finally:
        server.stop()


# -- /access --------------------------------------------------------------------------------------

BIG_PAGE = "A long page. " * 20_000  # 260,000 characters


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    from search_r1.retrieval.corpus import Pages
    path = tmp_path_factory.mktemp("pages") / "pages.jsonl"
    with open(path, "w") as f:
        for i in range(6):
            f.write(json.dumps({"url": f"https://big.example/{i}", "contents": BIG_PAGE}) + "\n")
        f.write(json.dumps({"url": "https://en.wikipedia.org/w/index.php?title=Seine",
                            "contents": "The Seine is a river in France."}) + "\n")
    return Pages(path)


def test_access_sends_a_repeated_page_once(real_retriever, pages):
    """A 3 KB request naming one large page 64 times was answered with 64 copies of it: requests
    could make the server build (and hold, and send) answers thousands of times their size."""
    server = ThreadServer(create_app(real_retriever, ServerConfig(max_batch=4), pages=pages))
    try:
        big, seine = "https://big.example/0", "https://en.wikipedia.org/w/index.php/Seine"
        urls = [big] * 64 + [seine, "https://nowhere.example", big, seine]
        r = httpx.post(server.url + "/access", json={"urls": urls}, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.content) < len(BIG_PAGE) + 10_000  # the page once
        result = r.json()["result"]
        assert len(result) == len(urls)  # still one entry per URL, in order
        assert result[0] == {"url": big, "contents": BIG_PAGE}
        assert result[1] == result[63] == result[66] == {"url": big, "contents": "", "duplicate_of": 0}
        seine_url = "https://en.wikipedia.org/w/index.php?title=Seine"  # the index.php/ form is looked up
        assert result[64] == {"url": seine_url, "contents": "The Seine is a river in France."}
        assert result[65] is None
        assert result[67] == {"url": seine_url, "contents": "", "duplicate_of": 64}
    finally:
        server.stop()


def test_access_refuses_an_answer_over_its_budget(real_retriever, pages):
    cfg = ServerConfig(max_access_response_bytes=1 << 20, max_batch=4)
    server = ThreadServer(create_app(real_retriever, cfg, pages=pages))
    try:
        distinct = [f"https://big.example/{i}" for i in range(6)]  # 6 pages: 1.5 MB
        r = httpx.post(server.url + "/access", json={"urls": distinct}, timeout=30)
        assert r.status_code == 413 and "--max_access_response_bytes" in r.json()["error"], r.text
        assert "retry-after" not in r.headers
        r = httpx.post(server.url + "/access", json={"urls": distinct[:3] + distinct[:3] * 100}, timeout=30)
        assert r.status_code == 200 and len(r.json()["result"]) == 303  # a repeated page counts once
    finally:
        server.stop()


# -- authentication and what a browser may send ---------------------------------------------------

def test_the_bearer_scheme_is_case_insensitive(real_retriever):
    server = ThreadServer(create_app(real_retriever, ServerConfig(api_key="s3cret", max_batch=4)))
    try:
        for header in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret"):
            r = post(server, {"queries": ["x"]}, headers={"Authorization": header})
            assert r.status_code == 200, (header, r.text)
        for header in ("Basic s3cret", "Bearer s3cre", "bearers3cret", "s3cret"):
            assert post(server, {"queries": ["x"]}, headers={"Authorization": header}).status_code == 401
    finally:
        server.stop()


def test_a_body_not_sent_as_json_is_refused(real_retriever, pages):
    """Without a key, a web page open in a browser on the same machine could POST searches as
    `text/plain` (which needs no CORS preflight) and the server answered them."""
    server = ThreadServer(create_app(real_retriever, ServerConfig(max_batch=4), pages=pages))
    try:
        for path, body in (("/retrieve", {"queries": ["capital of Japan"]}), ("/access", {"urls": ["x"]})):
            data = json.dumps(body).encode()
            for headers in ({"Content-Type": "text/plain;charset=UTF-8"},
                            {"Content-Type": "application/x-www-form-urlencoded"}, {}):
                r = httpx.post(server.url + path, content=data, headers=headers)
                assert r.status_code == 415 and "application/json" in r.json()["error"], (path, headers, r.text)
            for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
                r = httpx.post(server.url + path, content=data, headers={"Content-Type": content_type})
                assert r.status_code == 200, (path, content_type, r.text)
            assert httpx.post(server.url + path, json=body).status_code == 200  # what clients send
    finally:
        server.stop()


@pytest.mark.e2e  # a server process
def test_the_api_key_can_come_from_a_file_and_on_the_command_line_is_warned_about(corpus_jsonl, tmp_path,
                                                                                  caplog):
    """`--api-key KEY` shows the key to every user of the machine (`ps`); `--api-key-file` does not."""
    from conftest import ServerProcess
    from search_r1.cli import build_parser, server_api_key
    from search_r1.retrieval.build import build_bm25_index

    key_file = tmp_path / "key"
    key_file.write_text("file-s3cret\n")
    key_file.chmod(0o600)
    index = build_bm25_index(str(corpus_jsonl), str(tmp_path / "bm25"), progress=False)
    server = ServerProcess(["--retriever_name", "bm25", "--index_path", str(index), "--corpus_path",
                            str(corpus_jsonl), "--api_key_file", str(key_file)], tmp_path / "server.log")
    try:
        assert "file-s3cret" not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
        assert post(server, {"queries": ["capital"]}).status_code == 401
        key = {"Authorization": "Bearer file-s3cret"}
        assert post(server, {"queries": ["capital"]}, headers=key).status_code == 200
    finally:
        server.stop()

    def key_of(*flags):
        return server_api_key(build_parser().parse_args(["serve", *flags]))
    with caplog.at_level("WARNING", logger="search_r1.cli"):
        assert key_of("--api-key", "flag-s3cret") == "flag-s3cret"  # still works…
    assert "--api-key-file" in caplog.text and "SEARCH_R1_API_KEY" in caplog.text  # …with a warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="search_r1.cli"):
        assert key_of("--api-key-file", str(key_file)) == "file-s3cret" and not caplog.text
    with pytest.raises(ValueError, match="--api-key-file"):
        key_of("--api-key", "a", "--api-key-file", str(key_file))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        key_of("--api-key-file", str(tmp_path / "empty"))
