#!/usr/bin/env python3
"""GPU smoke test: every GPU-only path that CI (CPU only) never runs, one PASS/FAIL line per part.

    python scripts/gpu_smoke.py [--out outputs/gpu_smoke] [--only demo,grpo] [--sequential]
    make gpu-smoke

Run it on a GPU node with the packages installed (the offline bundle: scripts/offline_bundle.py)
before calling a change to a GPU path done. Parts:

- gpu-tests       every tests/**/*_gpu.py (skips count as failures unless a test needs more GPUs)
- eval-separate   `search-r1 eval` with vLLM, engine core in its own process (the default on a GPU)
- eval-inprocess  the same with the engine core in this process and a fixed KV cache (--kv-cache-gib)
- demo            `python -m search_r1.demo --preset gpu --retriever bm25 --grpo-minutes 1`
- demo-tools      the same with `--protocol tools` (tool calls through the chat template)
- demo-rl-only    the same with `--preset rl-only` (no SFT; the response begun with `<think>`, a
                  `<think>` opened after each observation, the format paid only after a search,
                  Dr.GRPO advantages)
- grpo-0.5b       two GRPO steps of a Qwen2.5-0.5B-shaped model through `verl.trainer.main_ppo` (Ray),
                  two optimizer steps in each; the second rollout follows a weight sync
- grpo-0.5b-ahead three such steps with the rollout one step ahead (trainer.rollout_ahead_steps=1): a
                  rollout worker beside the policy worker on its GPU, its engine awake throughout, the
                  weights pushed as CUDA IPC handles; the steps after the first train on batches one
                  update old
- grpo-lora       the same with LoRA adapters (actor_rollout_ref.model.lora_rank): the reference is
                  the base with them off, and vLLM serves them as a LoRA adapter after each update
- grpo-qwen3-moe  two GRPO steps of a small Qwen3-MoE (routed experts, q/k norms) with vLLM's fused MoE
                  kernels, the engine's log-probs beside the trainer's after the push
- dense-server    `search-r1 index build` on the GPU and `search-r1 serve` over that dense index,
                  answering concurrent requests

On a node with several GPUs the parts run side by side, each on GPUs of its own; logs are written
to `<out>/<part>.log`. The exit status is non-zero when any part failed. Every part gets a verdict:
one that runs past `--part-timeout` fails with its log's last line, and SIGTERM or Ctrl-C (a
wrapper's `timeout`) stops the running parts, each in a process session of its own, and fails them
and the parts not started.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
from bench_learning import Stopped, raise_stopped, stop_all  # noqa: E402 - ending a part's process session
PY = sys.executable
EVAL_QUESTIONS = 40
LIVE: set[subprocess.Popen] = set()   # the parts' commands running now, each in a session of its own
LOCK, STOPPING = threading.Lock(), threading.Event()


@dataclass
class Part:
    name: str
    gpus: int                 # GPUs it needs at least
    commands: list            # run one after another; a callable runs in this process
    check: object = None      # callable -> error text or None, after the commands succeeded


def sh(*cmd) -> list[str]:
    return [str(c) for c in cmd]


def parts(out: Path, gpu_count: int, tokenizer: str) -> list[Part]:
    """The parts, with what they need prepared (SmolLM2 model dir, bundled data, BM25 server)."""
    from conftest import ServerProcess
    from search_r1.data.bundled import bundled_paths
    from search_r1.local_models import materialize_smollm2
    from search_r1.retrieval.build import build_bm25_index

    model = materialize_smollm2(out / "smollm2")
    corpus = bundled_paths()["corpus"]
    test = out / "test.parquet"
    if not test.exists():
        subprocess.run(sh(PY, "-m", "search_r1.data.preprocess", "--bundled", "--split", "test", "--out", test),
                       check=True, cwd=ROOT)
    index = build_bm25_index(str(corpus), str(out / "bm25"), progress=False)
    bm25 = ServerProcess(["--retriever_name", "bm25", "--index_path", str(index), "--corpus_path", str(corpus)],
                         out / "bm25_server.log")

    def eval_part(core: str, *flags) -> Part:
        dest = out / f"eval_{core}"
        return Part(f"eval-{core.replace('_', '')}", 1, [sh(
            PY, "-m", "search_r1.cli", "eval", "--model", model, "--data", test, "--retriever-url",
            f"{bm25.url}/retrieve", "--limit", EVAL_QUESTIONS, "--mode", "search", "--engine", "vllm",
            "--engine-core", core, "--max-turns", 3, "--out", dest, *flags)],
            lambda: expect_eval(dest / "eval_search.json"))

    enc, dense = out / "e5-shaped-random", out / "dense_index"
    from synthetic_retrieval import make_encoder_dir  # benchmarks/: the server benchmark's random encoder
    make_encoder_dir(str(enc), tokenizer, dim=384, layers=2)
    # The longest part first: parts start in this order as GPUs come free, and the demo needs the
    # most time of any.
    def demo_part(name: str, preset: str = "gpu", protocol: str = "tags") -> Part:
        dest = out / name
        return Part(name, 1, [sh(PY, "-m", "search_r1.demo", "--preset", preset, "--retriever", "bm25",
                                 "--grpo-minutes", 1, "--eval-questions", EVAL_QUESTIONS, "--protocol", protocol,
                                 "--out", dest)],
                    lambda: expect_file(dest / "run" / "report.html"))

    return [
        demo_part("demo"),
        demo_part("demo-tools", protocol="tools"),   # verl's multi_turn keys, the search tool
        demo_part("demo-rl-only", preset="rl-only"),  # the search agent's turn_prefix, the reward's format_needs_search
        Part("gpu-tests", min(2, gpu_count), [sh(PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                                 *sorted(str(p) for p in ROOT.glob("tests/**/*_gpu.py")))],
             lambda: expect_no_skips(out / "gpu-tests.log", gpu_count)),
        eval_part("separate"),
        eval_part("in_process", "--kv-cache-gib", 2),   # a fixed KV cache, as on a GPU shared with other runs
        # two mini-batches: the update computes the second one's old log-probs (actor.old_log_probs=auto)
        Part("grpo-0.5b", 1, [sh(PY, ROOT / "benchmarks" / "bench_grpo_step.py", "--shape", "0.5b", "--steps", 2,
                                 "--prompts", 8, "--n", 4, "--mini-batches", 2, "--max-turns", 2, "--search-every", 100,
                                 "--workdir", out / "grpo", "--out", out / "grpo.jsonl",
                                 # the trainer's defaults, which the bench pins to its earlier settings
                                 "actor_rollout_ref.actor.entropy_coeff=0.001",
                                 "actor_rollout_ref.rollout.top_p=0.95")],
             lambda: expect_rows(out / "grpo.jsonl", 2)),
        Part("grpo-0.5b-ahead", 1, [sh(PY, ROOT / "benchmarks" / "bench_grpo_step.py", "--shape", "0.5b", "--steps", 3,
                                       "--prompts", 8, "--n", 4, "--max-turns", 2, "--search-every", 100, "--ahead", 1,
                                       "--workdir", out / "grpo_ahead", "--out", out / "grpo_ahead.jsonl",
                                       "actor_rollout_ref.actor.entropy_coeff=0.001",
                                       # the engine keeps its memory beside the actor's
                                       "actor_rollout_ref.rollout.gpu_memory_utilization=0.3")],
             lambda: expect_ahead(out / "grpo_ahead.jsonl", 3)),
        Part("grpo-lora", 1, [sh(PY, ROOT / "benchmarks" / "bench_grpo_step.py", "--shape", "0.5b", "--steps", 2,
                                 "--prompts", 8, "--n", 4, "--max-turns", 2, "--search-every", 100,
                                 "--workdir", out / "grpo_lora", "--out", out / "grpo_lora.jsonl",
                                 "actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
                                 "actor_rollout_ref.actor.optim.lr=1e-4")],
             lambda: expect_rows(out / "grpo_lora.jsonl", 2)
             or expect_in_log(out / "grpo-lora.log", "served as a vLLM LoRA adapter")),
        # Qwen3-MoE through main_ppo (vLLM's fused MoE kernels on the GPU), the engine's log-probs logged
        # beside the trainer's
        Part("grpo-qwen3-moe", 1, [sh(PY, ROOT / "benchmarks" / "bench_grpo_step.py", "--shape", "qwen3-moe-small",
                                      "--steps", 2, "--prompts", 8, "--n", 4, "--max-turns", 2, "--search-every", 100,
                                      "--workdir", out / "grpo_qwen3_moe", "--out", out / "grpo_qwen3_moe.jsonl",
                                      "actor_rollout_ref.rollout.calculate_log_probs=true",
                                      # a step that moves the weights well away from those the engine loaded
                                      "actor_rollout_ref.actor.optim.lr=1e-2")],
             lambda: expect_rows(out / "grpo_qwen3_moe.jsonl", 2)
             or expect_engine_matches_trainer(out / "grpo_qwen3_moe.jsonl")),
        Part("dense-server", 1, [
            sh(PY, "-m", "search_r1.cli", "index", "build", "--corpus_path", corpus, "--out", dense,
               "--retriever_model", enc),
            lambda: query_dense_server(enc, dense, corpus, out / "dense_server.log")]),
    ], bm25


# -- checks: a part passes only if it did what it is for, not merely exited 0 ----------------------

def expect_eval(path: Path) -> str | None:
    if not path.exists():
        return f"{path} was not written"
    n = json.loads(path.read_text())["n"]
    return None if n == EVAL_QUESTIONS else f"{n} questions scored, expected {EVAL_QUESTIONS}"


def expect_file(path: Path) -> str | None:
    return None if path.exists() else f"{path} was not written"


def expect_rows(path: Path, n: int) -> str | None:
    rows = path.read_text().splitlines() if path.exists() else []
    return None if len(rows) >= n else f"{len(rows)} step rows in {path}, expected {n}"


def expect_ahead(path: Path, n: int) -> str | None:
    """n steps, the first on its own batch, the others on batches generated one update before."""
    if error := expect_rows(path, n):
        return error
    staleness = [json.loads(line).get("rollout/staleness") for line in path.read_text().splitlines()]
    return None if staleness == [0] + [1] * (n - 1) else f"rollout/staleness per step {staleness}, expected 0, then 1"


def expect_engine_matches_trainer(path: Path, max_kl: float = 0.25) -> str | None:
    """After the first push the engine samples from the weights the trainer scores with. A random MoE's
    near-tied router scores make bf16 noise large already before any update (benchmarks/RESULTS.md,
    "GPU smoke run"): the bound catches a push that leaves the engine computing another model, while
    tests/verl/workers/test_qwen3_gpu.py checks the experts one by one."""
    kl = json.loads(path.read_text().splitlines()[-1]).get("rollout_is_kl")
    if kl is None:
        return f"no rollout_is_kl in the last row of {path}"
    return None if kl < max_kl else f"KL(engine || trainer) {kl:.4f} after a push, expected < {max_kl}"


def expect_in_log(log: Path, text: str) -> str | None:
    return None if text in log.read_text() else f"{log} does not say {text!r}"


def expect_no_skips(log: Path, gpu_count: int) -> str | None:
    """A GPU test that skips on a GPU node hides a broken path (a missing package, say); only tests
    that need more GPUs than the part was given may skip."""
    skips = [line for line in log.read_text().splitlines() if line.startswith("SKIPPED")]
    hidden = [s for s in skips if not ("GPUs" in s and gpu_count < 2)]
    return None if not hidden else "skipped on a GPU node: " + "; ".join(hidden)


def query_dense_server(enc: Path, index: Path, corpus, log: Path) -> None:
    """Serve the dense index on the GPU and ask it 64 questions from 8 concurrent clients."""
    from conftest import ServerProcess
    server = ServerProcess(["--retriever_name", "e5", "--retriever_model", str(enc), "--index_path", str(index),
                            "--corpus_path", str(corpus)], log)
    try:
        health = httpx.get(server.url + "/health", timeout=10).json()
        queries = [f"what is the capital of country number {i}?" for i in range(64)]

        def ask(batch):
            r = httpx.post(server.url + "/retrieve", json={"queries": batch, "topk": 3, "return_scores": True},
                           timeout=60)
            r.raise_for_status()
            return r.json()["result"]

        with ThreadPoolExecutor(8) as pool:
            results = [hit for part in pool.map(ask, [queries[i:i + 8] for i in range(0, 64, 8)]) for hit in part]
        if len(results) != 64 or any(len(hits) != 3 or "contents" not in hits[0]["document"] for hits in results):
            raise AssertionError(f"unexpected answer shape: {results[:1]}")
        print(f"dense server: {health}; 64 queries answered, 3 passages each")
    finally:
        server.stop()


# -- running ---------------------------------------------------------------------------------------

def last_line(log: Path) -> str:
    """The log's last non-empty line (progress bars' carriage returns split lines too), for a verdict."""
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - 20_000))
        lines = [ln.strip() for ln in f.read().decode(errors="replace").replace("\r", "\n").splitlines()]
    return next((ln for ln in reversed(lines) if ln), "")[:200]


def left_in_session(session: int) -> list[str]:
    """The command lines of the live processes still in process group `session` (a part's command
    runs as the leader of its own session and group)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(group) == session and state not in "ZX":
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                             .strip()[:120])
        except (OSError, ValueError):
            continue   # it ended meanwhile
    return found


def end_leftovers(session: int, grace_s: float = 10.0) -> list[str]:
    """End what a part's command left running after it exited (an engine core, a Ray process): it
    would share the next part's GPUs and CPUs. Returns their command lines, for the verdict."""
    left = alive = left_in_session(session)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not alive:
            break
        try:
            os.killpg(session, sig)
        except ProcessLookupError:
            break
        deadline = time.time() + wait_s
        while (alive := left_in_session(session)) and time.time() < deadline:
            time.sleep(0.2)
    return left


def run_part(part: Part, devices: list[int], out: Path,
             timeout: float | None = None) -> tuple[str, bool, float, str]:
    """Run a part's commands on `devices`; past `timeout` seconds its process session (engines and
    Ray with it) is ended and the part fails, naming the last line its log reached. What a command
    leaves running when it exits is ended too, and named in the verdict (the part may still pass)."""
    # `devices` index the GPUs this script sees, which CUDA_VISIBLE_DEVICES may already narrow
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    names = [visible[d] if visible[0] else str(d) for d in devices]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(names),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start, error, leftovers = time.perf_counter(), None, []
    log_path = out / f"{part.name}.log"
    with open(log_path, "w") as log:
        for cmd in part.commands:
            if callable(cmd):
                try:
                    cmd()
                except Exception as e:  # noqa: BLE001 - reported as this part's failure
                    error = f"{type(e).__name__}: {e}"
            else:
                log.write("$ " + " ".join(cmd) + "\n")
                log.flush()
                with LOCK:   # a SIGTERM now either sees this process in LIVE or stops it starting
                    if STOPPING.is_set():
                        error = "stopped"
                        break
                    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
                    LIVE.add(proc)
                left = None if timeout is None else max(1.0, start + timeout - time.perf_counter())
                try:
                    if proc.wait(left):
                        error = f"exit {proc.returncode}"
                except subprocess.TimeoutExpired:
                    stop_all([proc])
                    error = f"timed out after {timeout:.0f} s; its log ended on: {last_line(log_path)}"
                finally:
                    LIVE.discard(proc)
                if stray := end_leftovers(proc.pid):
                    log.write(f"# ended {len(stray)} processes the command left running: {stray}\n")
                    leftovers += stray
            if error:
                break
    if error is None and part.check is not None:
        error = part.check()
    note = f"ended {len(leftovers)} processes it left running: {', '.join(leftovers)[:300]}" if leftovers else ""
    return part.name, error is None, time.perf_counter() - start, "; ".join(filter(None, [error, note]))


def run_all(todo: list[Part], gpu_count: int, lanes: int, out: Path, timeout: float | None) -> list[bool]:
    """Start every part whose GPUs are free, print each verdict as it comes. On SIGTERM or Ctrl-C the
    running parts are stopped and fail, and the parts not yet started fail: every part gets its line."""
    free, results, pending, running = list(range(gpu_count)), [], list(todo), {}

    def verdict(name, ok, seconds, error):
        results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}  {name:<15} {seconds:6.0f} s  {error}", flush=True)

    with ThreadPoolExecutor(lanes) as pool:
        try:
            while pending or running:
                for part in list(pending):
                    need = min(part.gpus, gpu_count)
                    if len(free) >= need and len(running) < lanes:
                        devices, free[:] = free[:need], free[need:]
                        running[pool.submit(run_part, part, devices, out, timeout)] = devices
                        pending.remove(part)
                        print(f"start {part.name} on GPU {','.join(map(str, devices))}", flush=True)
                done = next((f for f in running if f.done()), None)
                if done is None:
                    time.sleep(0.5)
                    continue
                free.extend(running.pop(done))
                free.sort()
                verdict(*done.result())
        except (Stopped, KeyboardInterrupt) as e:
            why = f"stopped ({e or 'SIGINT'})"
            with LOCK:
                STOPPING.set()
                stop_all(list(LIVE))
            for f in running:
                name, _, seconds, _ = f.result()
                verdict(name, False, seconds, f"{why}; its log ended on: {last_line(out / f'{name}.log')}")
            for part in pending:
                verdict(part.name, False, 0, f"{why}: not started")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/gpu_smoke")
    p.add_argument("--only", help="comma-separated part names")
    p.add_argument("--sequential", action="store_true", help="one part at a time, on the first GPUs")
    p.add_argument("--part-timeout", type=float, default=900,
                   help="seconds a part may run before it is stopped and fails (its log's last line is "
                        "printed), so that a slow part still gets a verdict; 0: no limit")
    p.add_argument("--tokenizer", default=os.environ.get("SMOKE_BERT_TOKENIZER", "all-MiniLM-L6-v2"),
                   help="a BERT-vocabulary tokenizer (dir or bundled name) for the random encoders of the dense "
                        "server and of the GPU tests")
    a = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("FAIL  setup: no CUDA device visible")
        return 1
    from search_r1.retrieval.models import resolve_model
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    gpu_count = torch.cuda.device_count()
    print(f"GPU smoke on {gpu_count} × {torch.cuda.get_device_name(0)}; logs in {out}", flush=True)
    t0 = time.perf_counter()
    tokenizer = resolve_model(a.tokenizer)
    os.environ["SMOKE_BERT_TOKENIZER"] = tokenizer  # read by the encoder's GPU tests
    todo, bm25 = parts(out, gpu_count, tokenizer)
    if a.only:
        names = a.only.split(",")
        todo = [part for part in todo if part.name in names]
    signal.signal(signal.SIGTERM, raise_stopped)
    try:
        results = run_all(todo, gpu_count, 1 if a.sequential else max(1, gpu_count), out,
                          a.part_timeout or None)
    finally:
        bm25.stop()
    passed = sum(results)
    print(f"{passed}/{len(results)} parts passed in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if passed == len(results) == len(todo) else 1


if __name__ == "__main__":
    sys.exit(main())
