"""Per-step GPU time of vLLM engine steps, from torch-profiler traces (`bench_rollout.py --torch-profile`).

vLLM's worker marks every step it executes with a range named
`execute_{tokens}_context_{n}(sq{tokens}sk{kv}…)_generation_{n}(sq{tokens}sk{kv}…)` (with the profiler
config `detailed_trace_annotation`): how many requests the step prefilled ("context") and decoded
("generation"), and how many key/value positions they read (`sk`). A step here runs from the start of
its range to the start of the next one, so the sampling that follows the forward pass counts too.
Every kernel belongs to the step whose CPU call launched it (a kernel inside a CUDA graph carries the
correlation id of the graph's launch), so for each step we get:
  cpu_ms     the step's interval on the CPU (start of its range to the start of the next),
  kernel_ms  the sum of its kernels' durations, split into attention / gemm / other by kernel name,
  gpu_ms     first kernel start to last kernel end (kernels of one step can wait for the previous step's).
Comparing runs (one plain generate call against the agent's turns replayed) at the same number of
decoding requests shows whether a slower step is slower on the GPU, and in which kernels, or waits
for the CPU.

    python benchmarks/trace_steps.py TRACE.pt.trace.json.gz [...] [--min-batch 700] [--top 8]
"""
import argparse
import bisect
import gzip
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from result_rows import emit_row

STEP = re.compile(r"execute_(\d+)_context_(\d+)\(sq(\d+)sk(\d+)[^)]*\)_generation_(\d+)\(sq(\d+)sk(\d+)")


def kernel_kind(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "attn", "attention")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "matmul", "sm90_xmma", "cublas")):
        return "gemm"
    return "other"


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def steps_of(events: list[dict]) -> list[dict]:
    """One record per annotated engine step, in order (see the module docstring)."""
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and STEP.match(e.get("name", ""))),
                   key=lambda e: e["ts"])
    if not marks:
        return []
    starts = [m["ts"] for m in marks]
    # CPU launch calls (cudaLaunchKernel, cudaGraphLaunch, …) -> the step whose interval holds them.
    step_of_call: dict[int, int] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            i = _interval(starts, e["ts"])
            if i is not None:
                step_of_call[e["args"]["correlation"]] = i
    kernels: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            i = step_of_call.get(e.get("args", {}).get("correlation"))
            if i is not None:
                kernels[i].append(e)
    steps = []
    for i, mark in enumerate(marks[:-1]):  # the last one has no end: the next step's start
        tokens, ctx_n, ctx_q, ctx_kv, gen_n, gen_q, gen_kv = map(int, STEP.match(mark["name"]).groups())
        ks = kernels.get(i, [])
        per_name = _per_name(ks)
        by_kind = defaultdict(float)
        for name, ms in per_name.items():
            by_kind[kernel_kind(name)] += ms
        steps.append({
            "tokens": tokens, "prefill_requests": ctx_n, "prefill_tokens": ctx_q, "decode_requests": gen_n,
            "decode_kv": gen_kv, "prefill_kv": ctx_kv,
            "cpu_ms": (starts[i + 1] - starts[i]) / 1000,
            "kernel_ms": sum(per_name.values()),
            "gpu_ms": (max(k["ts"] + k["dur"] for k in ks) - min(k["ts"] for k in ks)) / 1000 if ks else 0.0,
            **{f"{kind}_ms": by_kind[kind] for kind in ("attention", "gemm", "other")},
            "kernels": per_name,
        })
    return steps


def _interval(starts: list[float], ts: float) -> int | None:
    """Index i with starts[i] <= ts < starts[i + 1], or None outside [starts[0], starts[-1])."""
    if not starts or ts < starts[0] or ts >= starts[-1]:
        return None
    return bisect.bisect_right(starts, ts) - 1


def _per_name(kernels: list[dict]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for k in kernels:
        out[k["name"]] += k["dur"] / 1000
    return dict(out)


def summarize(steps: list[dict], min_batch: int = 0, top: int = 8) -> dict:
    """Medians over the pure decode steps with at least `min_batch` decoding requests, and the
    kernels that take the most time per such step."""
    decode = [s for s in steps if s["prefill_requests"] == 0 and s["decode_requests"] >= min_batch]
    out = {"steps": len(steps), "decode_steps": len(decode),
           "prefill_steps": sum(s["prefill_requests"] > 0 for s in steps)}
    if not decode:
        return out
    for key in ("decode_requests", "decode_kv", "cpu_ms", "gpu_ms", "kernel_ms", "attention_ms", "gemm_ms",
                "other_ms"):
        out[key] = round(statistics.median(s[key] for s in decode), 3)
    per_name: dict[str, float] = defaultdict(float)
    for s in decode:
        for name, ms in s["kernels"].items():
            per_name[name] += ms / len(decode)
    out["top_kernels_ms"] = {name[:90]: round(ms, 3)
                             for name, ms in sorted(per_name.items(), key=lambda kv: -kv[1])[:top]}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--min-batch", type=int, default=0, help="summarise decode steps with at least this many requests")
    p.add_argument("--top", type=int, default=8, help="kernels listed per trace")
    p.add_argument("--out", help="append one JSON row per trace to this file")
    a = p.parse_args(argv)
    for path in a.traces:
        row = {"trace": Path(path).name, "min_batch": a.min_batch,
               **summarize(steps_of(load_events(path)), a.min_batch, a.top)}
        emit_row(row, a.out)


if __name__ == "__main__":
    main()
