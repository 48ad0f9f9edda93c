"""Search tool calls of one rollout step: a request per call against calls batched into one request.

    python benchmarks/bench_tool_calls.py [--calls 160] [--repeats 5] [--windows-ms 0,2] [--out rows.jsonl]

Starts a BM25 retrieval server over the bundled corpus on 127.0.0.1 and sends `--calls` concurrent
search tool calls (one query each, bundled questions) through `verl.tools.base.ToolRunner`, as the
tool-calling loop does with the calls that end in one engine step. For each `batch_window_ms`
(0: a request per call) it reports the median seconds for all calls, the HTTP requests the server
received and the search calls it ran (its own batching joins concurrent requests too). Runs on CPU; the figures are in benchmarks/RESULTS.md, "Search tool calls".
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]


def counter(url: str, name: str) -> float:
    """A Prometheus counter of the server's /metrics, summed over its labels."""
    import httpx
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=160, help="concurrent calls, one query each")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--windows-ms", default="0,2", help="batch_window_ms values to compare")
    p.add_argument("--out", help="append JSON rows here")
    a = p.parse_args(argv)

    from conftest import ServerProcess
    from result_rows import emit_row
    from search_r1.agent.search_tool import SearchTool
    from search_r1.data.bundled import bundled_paths, read_jsonl
    from search_r1.retrieval.build import build_bm25_index
    from verl.tools.base import ToolRunner

    corpus = bundled_paths()["corpus"]
    questions = [q["question"] for q in read_jsonl(bundled_paths()["train"])]
    with tempfile.TemporaryDirectory() as tmp:
        index = build_bm25_index(str(corpus), str(Path(tmp) / "bm25"), progress=False)
        server = ServerProcess(["--retriever_name", "bm25", "--index_path", str(index), "--corpus_path", str(corpus)],
                               Path(tmp) / "server.log")
        try:
            for window in [float(w) for w in a.windows_ms.split(",")]:
                tool = SearchTool({"retrieval_service_url": server.url + "/retrieve", "batch_window_ms": window,
                                   "num_workers": a.calls, "rate_limit": a.calls})
                runner = ToolRunner({"search": tool})
                calls = [("search", {"query_list": [questions[i % len(questions)]]}) for i in range(a.calls)]
                runner.call_many(calls[:8])   # connections and the server warm
                before = (counter(server.url, "retrieval_requests_total"),
                          counter(server.url, "retrieval_batch_queries_count"))
                times = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    results = runner.call_many(calls)
                    times.append(time.perf_counter() - t0)
                    assert all(r.status == "ok" for r in results), [r.text for r in results if r.status != "ok"][:1]
                requests = (counter(server.url, "retrieval_requests_total") - before[0]) / a.repeats
                searches = (counter(server.url, "retrieval_batch_queries_count") - before[1]) / a.repeats
                runner.close()
                emit_row({"bench": "tool_calls", "calls": a.calls, "batch_window_ms": window,
                          "median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
                          "http_requests": requests, "server_search_calls": searches}, a.out)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
