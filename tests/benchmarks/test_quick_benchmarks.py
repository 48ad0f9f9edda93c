"""Every benchmark script runs in its --quick mode, so none can rot unnoticed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, vllm_skip_reason

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["bench_dense_search.py", "bench_corpus.py", "bench_server.py", "bench_cpu_indexes.py",
           "bench_grpo_step.py", "bench_actor_update.py", "bench_rollout.py", "bench_encoder.py",
           "bench_lora_rounding.py"]


def _rounding(num_s: float, den_s: float) -> float:
    """How far num_s / den_s may lie from a row's ratio when the row rounds the seconds to the
    millisecond and the ratio to three places (quick runs last a fraction of a second)."""
    return 0.0005 + num_s / den_s * (0.0005 / num_s + 0.0005 / den_s) + 1e-9


@pytest.mark.parametrize("script", SCRIPTS)
def test_quick(script, tmp_path, bundled_bm25_server, request):
    if not (ROOT / "benchmarks" / script).exists():
        pytest.fail(f"benchmarks/{script} is missing")
    out = tmp_path / "out.jsonl"
    args = [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out)]
    if script in ("bench_corpus.py", "bench_server.py", "bench_grpo_step.py", "bench_actor_update.py",
                  "bench_rollout.py", "bench_encoder.py"):
        args += ["--workdir", str(tmp_path / "work")]
    if script == "bench_lora_rounding.py":   # the session's SmolLM2, converted once
        args += ["--model", request.getfixturevalue("smollm2_dir")]
    if script == "bench_server.py":
        args += ["--devices", "cpu,cpu"]  # the vectors sharded in two, as over several GPUs
    if script == "bench_grpo_step.py":
        args += ["--mini-batches", "2"]   # the original's recipe: two optimizer steps a training step
    if script == "bench_rollout.py":  # vLLM's engine core in a process of its own, its steps recorded
        # (against the session's BM25 server: encoding the corpus for the script's own MiniLM index
        # is most of its start)
        args += ["--retriever-url", f"{bundled_bm25_server.url}/retrieve",
                 "--engine-core", "separate", "--baseline-repeats", "2", "--core-stats",
                 "--timeline", str(tmp_path / "timeline.jsonl")]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows, "no results written"
    if script == "bench_dense_search.py":  # --quick: batches 1 and 16, three methods, the searches exact
        assert sorted((row["batch"], row["method"]) for row in rows) == sorted(
            (batch, method) for batch in (1, 16) for method in ("matmul", "chunked", "blockmax"))
        assert all(row["ms"] > 0 and row["qps"] > 0 for row in rows)
        assert all(row["recall"] == 1.0 for row in rows if row["method"] != "matmul")
    if script == "bench_corpus.py":  # one row: the 20,000-row corpus converted, opened and read
        (row,) = rows
        assert row["rows"] == 20_000 and row["convert_s"] >= 0 and row["open_s"] >= 0
        assert row["fetch_1536_rows_ms"] > 0
    if script == "bench_server.py":  # --quick: 1 then 4 clients, every one answered
        assert [row["clients"] for row in rows] == [1, 4]
        assert all(row["n"] == 5000 and row["requests"] > 0 and row["qps"] > 0
                   and 0 < row["p50_ms"] <= row["p99_ms"] for row in rows)
    if script == "bench_cpu_indexes.py":  # every bench of the run, with figures that make sense
        assert {row["bench"] for row in rows} == {"exact", "hnsw_build", "hnsw", "embed", "bm25_build", "bm25",
                                                  "answer_recall", "retriever"}
        assert len([row for row in rows if row["bench"] == "exact"]) == 3 * 3  # methods × batches
        assert all(row["qps"] > 0 for row in rows if "qps" in row)
        hnsw = [row for row in rows if row["bench"] == "hnsw"]
        assert all(0 <= row["recall"] <= 1 for row in hnsw)
        widest = max(row["ef_search"] for row in hnsw)
        assert all(row["recall"] >= 0.95 for row in hnsw if row["ef_search"] == widest)
        recall = {row["retriever"]: row["answer_recall"] for row in rows if row["bench"] == "answer_recall"}
        assert len(recall) == 2 and all(r > 0.5 for r in recall.values()), recall  # BM25 and dense
    if script == "bench_grpo_step.py":  # --quick steers the random policy into searching (a logit bias)
        assert all(row["agent/searches"] > 0 and row["response/observation_tokens"] > 0 for row in rows)
        assert [row["step"] for row in rows] == [1]
        assert all(row["shape"] == "tiny" and len(row["tag_bias"]) == 2 for row in rows)  # both search tags
        assert all(row["phases_s"][phase] > 0 for row in rows
                   for phase in ("rollout", "ref_log_probs", "update_actor", "weight_sync", "step"))
        # actor.old_log_probs=auto: the first mini-batch's forward gives its old log-probs, the update
        # computes the second one's, and the separate pass is skipped
        assert all(row["mini_batches"] == 2 and "old_log_probs" not in row["phases_s"] for row in rows)
        assert all(row["throughput/generated_tokens_per_s"] > 0 and row["throughput/train_tokens_per_s"] > 0
                   and row["grad_norm"] > 0 for row in rows)
    if script == "bench_actor_update.py":  # --quick: both attentions, the same update
        assert [row["attn"] for row in rows] == ["varlen", "sdpa"]
        assert all("error" not in row and row["tokens_per_update"] > 0 and row["update_tokens_per_s"] > 0
                   and row["logprob_tokens_per_s"] > 0 and row["grad_norm"] > 0 for row in rows)
        assert rows[0]["grad_norm"] == pytest.approx(rows[1]["grad_norm"], rel=1e-3)
    if script == "bench_rollout.py":  # each agent row with its baselines over the same tokens; HF always runs
        check_rollout_rows(rows, tmp_path / "timeline.jsonl")
    if script == "bench_encoder.py":  # on CPU the eager encoder only, compared with itself
        assert all(row["mode"] == "eager" and row["min_cosine_to_eager"] > 0.9999 for row in rows)
        assert [row["batch"] for row in rows] == [1, 8]
        assert all(row["queries_per_s"] > 0 and row["padded_length"] > 0 for row in rows)
        assert all(row["dim"] == 64 and row["layers"] == 2 for row in rows)  # --quick's small random encoder
    if script == "bench_lora_rounding.py":  # --quick: t = 1 and 1000 optimizer steps of lr 1e-5, SmolLM2
        early, late = rows
        assert (early["t"], late["t"]) == (1, 1000)
        # the adapter reaches the engine whole; the merged push rounds a first step's update away and
        # keeps nearly all of a thousand steps' (a push that cast before adding would keep none)
        assert all(row["update_kept_adapter"] > 0.99 and row["kl_trainer_adapter"] < 1e-6 for row in rows)
        assert early["update_kept_merged"] < 0.05 and late["update_kept_merged"] > 0.9
        assert late["kl_trainer_merged"] < 0.1 * late["kl_trainer_base"]


def check_rollout_rows(rows, timeline_path):
    """bench_rollout.py --quick --engine-core separate --baseline-repeats 2 --core-stats --timeline: each
    agent row with its baselines over the same tokens (HF always runs). vLLM's engine core runs in a
    process of its own and every schedule steps it through the inter-process client; the baselines
    run twice each and the rows give the faster one (median_run's rule for an even count, unit-tested
    in test_rollout_stats.py); the replay writes the agent's tokens, turn by
    turn, with the same prefix-cache use; the core's timeline comes back from its process, with
    vLLM's statistics of every core step."""
    assert all(row["model_tokens"] > 0 and row["tokens_per_s"] > 0 and row["wall_s"] > 0 for row in rows)
    engines = {"hf"} if vllm_skip_reason() else {"hf", "vllm"}
    assert {row["engine"] for row in rows} == engines
    agents = [row for row in rows if row["mode"] == "agent"]
    assert {(row["engine"], row["schedule"]) for row in agents} >= {("hf", "sync"), ("hf", "async")}
    assert sum(row["retrieval_calls"] for row in agents) > 0  # the tag bias makes the agent search
    for agent in agents:
        same = [row for row in rows if row["mode"] != "agent"
                and all(row[k] == agent[k] for k in ("engine", "trajectories", "schedule"))]
        assert {row["mode"] for row in same} >= {"plain", "plain_with_obs"}
        assert all(row["model_tokens"] == agent["model_tokens"] for row in same)
        assert agent["ratio_to_plain"] > 0 and agent["ratio_to_plain_with_obs"] > 0
        assert ("ratio_to_replay" in agent) == (agent["engine"] == "vllm")  # the replay needs vLLM's step loop
        for row in same:  # a baseline row: the faster of its two walls, the agent's prompts (+ observations)
            assert len(row["wall_s_all"]) == 2 and row["wall_s"] == min(row["wall_s_all"])
            assert row["tokens_per_s"] == pytest.approx(row["model_tokens"] / row["wall_s"], rel=0.05)
            obs = agent["observation_tokens"] if row["mode"] == "plain_with_obs" else 0
            assert row["prompt_tokens"] == agent["prompt_tokens"] + obs
        assert agent["turns_per_trajectory"] >= 1 and sum(agent["finish"].values()) == agent["trajectories"]
    vllm = [row for row in agents if row["engine"] == "vllm"]
    if not vllm:
        return
    assert all(row["engine_core_client"] != "InprocClient" for row in rows if row["engine"] == "vllm")
    assert {row["schedule"] for row in vllm} == {"sync", "async", "continuous"}
    replays = [row for row in rows if row["mode"] == "replay"]
    assert len(replays) == len(vllm)
    for a, r in zip(vllm, replays):
        assert r["model_tokens"] == a["model_tokens"] and len(r["wall_s_all"]) == 2
        # The same requests, prefix for prefix (up to what the cache evicted in between).
        assert r["prefix_cached_frac"] == pytest.approx(a["prefix_cached_frac"], abs=0.05)
        assert a["ratio_to_replay"] == pytest.approx(r["wall_s"] / a["wall_s"], abs=_rounding(r["wall_s"], a["wall_s"]))
        assert a["core_steps"] > 0 and 0 < a["core_span_s"] <= a["wall_s"]
        assert 0 <= a["client_lag_ms_mean"] <= a["wall_s"] * 1000
        if a["retrieval_calls"]:
            assert 0 < a["retrieval_call_ms_p50"] <= a["retrieval_call_ms_p90"]
    for a in (row for row in vllm if row["schedule"] == "continuous"):
        # Every core step has its mode (eager on CPU: "NONE"); the first admission is a prefill.
        assert sum(m["steps"] for m in a["core_modes"].values()) == a["core_steps"] - 1
        assert 1 <= a["prefill_steps"] < a["core_steps"] and 0 < a["prefill_step_s"] < a["core_span_s"]
        assert 0 < a["core_wait_frac"] <= 1  # the core waits for the model at least while it computes
    timelines = [json.loads(line) for line in timeline_path.read_text().splitlines()]
    assert {t["mode"] for t in timelines} == {"agent", "plain", "plain_with_obs", "replay"}
    first = next(t for t in timelines if t["mode"] == "agent")
    assert len(first["t"]) == len(first["batch"]) == vllm[0]["core_steps"] and first["t"] == sorted(first["t"])
    assert len(first["tokens"]) == len(first["prefill_tokens"]) == len(first["waiting"]) == len(first["wait_ms"]) \
        == len(first["graph"]) == len(first["t"])


def quick_server(tmp_path, flag: str):
    """bench_server.py --quick with one more flag: its stdout and rows."""
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_server.py"), "--quick", flag,
                        "--out", str(out), "--workdir", str(tmp_path / "work"), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    return r, [json.loads(line) for line in out.read_text().splitlines()]


def test_server_with_worker_process(tmp_path):
    """bench_server.py --worker-process: the synthetic retriever is built and searched in the
    server's child process; the clients get answers and /health the child's counters."""
    r, rows = quick_server(tmp_path, "--worker-process")
    assert rows and all(row["qps"] > 0 and row["worker_process"] for row in rows)
    assert "'encode':" in r.stdout  # the worker phases came back from the child


def test_rollout_with_two_engines_sharing_the_device(tmp_path, bundled_bm25_server):
    """--engines 2: two vLLM engines (cores in processes of their own), each with half the
    trajectories, run the agent and every baseline at once; one row per mode with both engines'
    statistics, the replay writing exactly the agent's tokens on each engine. --vllm-arg reaches
    both engines: at most two sequences run at once in either."""
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    out = tmp_path / "out.jsonl"
    args = [sys.executable, str(ROOT / "benchmarks" / "bench_rollout.py"), "--quick", "--engine", "vllm",
            "--schedules", "continuous", "--engine-core", "separate", "--engines", "2", "--trajectories", "4",
            "--vllm-arg", "max_num_seqs=2", "--retriever-url", f"{bundled_bm25_server.url}/retrieve",
            "--out", str(out), "--workdir", str(tmp_path / "work")]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {row["mode"] for row in rows} == {"agent", "plain", "plain_with_obs", "replay"}
    assert all(row["engines"] == 2 and len(row["per_engine"]) == 2 for row in rows)
    assert all(row["vllm_args"] == {"max_num_seqs": 2} for row in rows)
    assert all(0 < part["core_mean_batch"] <= 2 for row in rows for part in row["per_engine"])
    for agent in (row for row in rows if row["mode"] == "agent"):
        same = [row for row in rows if row["mode"] != "agent" and row["trajectories"] == agent["trajectories"]]
        assert all(row["model_tokens"] == agent["model_tokens"] for row in same)
        assert agent["model_tokens"] == sum(part["model_tokens"] for part in agent["per_engine"])
        replay = next(row for row in same if row["mode"] == "replay")
        assert agent["ratio_to_replay"] == pytest.approx(replay["wall_s"] / agent["wall_s"],
                                                         abs=_rounding(replay["wall_s"], agent["wall_s"]))
    bad = subprocess.run(args[:-4] + ["--engine-core", "in-process"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert bad.returncode != 0 and "needs --engine vllm --engine-core separate" in bad.stderr


def test_server_instant_measures_the_http_side(tmp_path):
    """bench_server.py --instant: no encoder or index behind the server; the rows give its CPU time
    per request (Linux), which is what the HTTP side and the batching cost alone."""
    r, rows = quick_server(tmp_path, "--instant")
    assert rows and all(row["instant"] and row["qps"] > 0 for row in rows)
    assert all(0 < row["server_cpu_ms_per_request"] < 100 for row in rows)
    assert "'encode':" not in r.stdout  # nothing was encoded
