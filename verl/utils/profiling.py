"""trainer.profile_steps: torch.profiler over each worker's part of chosen training steps.

The driver starts every worker's profiler before such a step and stops it after; each worker then
writes two files under `<default_local_dir>/profile/`, named `step<N>_<role><rank>`:
- `.json.gz`: the Chrome trace (open it in Perfetto or chrome://tracing): CPU operators of the
  process and, on a GPU, every kernel, copy and NCCL collective it launched, on one timeline;
- `.txt`: first, for each worker call of the step (the methods marked with `phase`: rollout,
  log-prob passes, updates, weight sync), how its wall time splits on the GPU: compute (any kernel
  or copy but a collective running), communication not hidden behind compute (only NCCL kernels
  running), and idle; then operators by their own time on the device (on the CPU: CPU time).
With `rollout.engine_core=separate` (the GPU default) the engine's kernels run in another process,
where vLLM's own profiler records them: `step<N>_policy<rank>_engine.json.gz`, and in the `.txt` a
table of what the engine core did during each rollout call (GPU busy time, model steps, tokens a
step, time inside the steps; the rest is its scheduling and its waits for the agent's requests).
"""
from __future__ import annotations

import functools
import gzip
import json
import os
import re
import shutil

import torch
from torch.profiler import ProfilerActivity, profile

TABLE_ROWS = 60
PHASE_PREFIX = "worker."
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
ROLLOUT_PHASE = "generate"
# vLLM's range around each model step of its workers: requests and tokens of prefill and of decode
ENGINE_STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
# vLLM's ranges around the parts of a step (with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1): the model
# runner's input preparation, forward, sampling…, and pieces of the scheduler
ENGINE_PARTS = ("gpu_model_runner: ", "schedule: ")


def phase(method):
    """Mark a worker method as a range `worker.<name>` in profiles (next to free without a profiler)."""
    name = PHASE_PREFIX + method.__name__

    @functools.wraps(method)
    def marked(*args, **kwargs):
        with torch.profiler.record_function(name):
            return method(*args, **kwargs)
    return marked


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def gpu_time_by_phase(events: list[dict]) -> list[dict]:
    """For each `phase` range in a Chrome trace's events: its wall time and how the GPU spent it
    (seconds): compute, communication alone (NCCL kernels with nothing else running), idle."""
    device = [(e["ts"], e["ts"] + e["dur"], e["name"].lower().startswith("nccl"))
              for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    rows = []
    for p in events:
        if p.get("cat") != "user_annotation" or not p.get("name", "").startswith(PHASE_PREFIX):
            continue
        lo, hi = p["ts"], p["ts"] + p["dur"]
        inside = [(max(s, lo), min(e, hi), nccl) for s, e, nccl in device if e > lo and s < hi]
        busy = _covered([(s, e) for s, e, _ in inside])
        compute = _covered([(s, e) for s, e, nccl in inside if not nccl])
        rows.append({"phase": p["name"].removeprefix(PHASE_PREFIX), "wall_s": (hi - lo) / 1e6,
                     "compute_s": compute / 1e6, "comm_alone_s": (busy - compute) / 1e6,
                     "idle_s": (hi - lo - busy) / 1e6})
    return rows


def _phase_ranges(events: list[dict], name: str) -> list[tuple[float, float]]:
    return [(p["ts"], p["ts"] + p["dur"]) for p in events
            if p.get("cat") == "user_annotation" and p.get("name") == PHASE_PREFIX + name]


def engine_time_by_rollout(events: list[dict], engine_events: list[dict], shift_us: float = 0.0) -> list[dict]:
    """For each rollout call in a worker's trace (`events`), what the engine core did meanwhile in its
    own process (`engine_events`, moved by `shift_us` onto the worker's clock): GPU busy seconds,
    model steps, tokens a step, and seconds inside the steps (the rest of the call's wall time is the
    core's scheduling and output handling, and its waits for the agent's next requests); `parts_s`:
    the seconds of each of vLLM's named parts of a step (ENGINE_PARTS) that the trace holds."""
    def clipped(spans, lo, hi):
        return _covered([(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]) / 1e6

    device = [(e["ts"] + shift_us, e["ts"] + e["dur"] + shift_us) for e in engine_events
              if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    steps, parts = [], {}
    for e in engine_events:
        if e.get("cat") != "user_annotation" or "dur" not in e:
            continue
        span = (e["ts"] + shift_us, e["ts"] + e["dur"] + shift_us)
        if m := ENGINE_STEP.match(e["name"]):
            steps.append((*span, int(m[2]) + int(m[4])))
        elif e["name"].startswith(ENGINE_PARTS):
            parts.setdefault(e["name"], []).append(span)
    rows = []
    for lo, hi in _phase_ranges(events, ROLLOUT_PHASE):
        inside = [(s, e, tokens) for s, e, tokens in steps if lo <= s < hi]
        parts_s = {name: clipped(spans, lo, hi) for name, spans in parts.items()}
        rows.append({"phase": ROLLOUT_PHASE, "wall_s": (hi - lo) / 1e6, "gpu_busy_s": clipped(device, lo, hi),
                     "model_steps": len(inside),
                     "tokens_per_step": sum(t for _, _, t in inside) / len(inside) if inside else 0.0,
                     "in_steps_s": _covered([(s, min(e, hi)) for s, e, _ in inside]) / 1e6,
                     "parts_s": {name: t for name, t in sorted(parts_s.items(), key=lambda kv: -kv[1]) if t > 0}})
    return rows


def engine_table(rows: list[dict]) -> str:
    lines = [f"{'worker call':<24}{'wall s':>10}{'GPU busy s':>12}{'model steps':>13}{'tokens/step':>13}"
             f"{'in steps s':>12}"]
    for r in rows:
        lines.append(f"{r['phase']:<24}{r['wall_s']:>10.3f}{r['gpu_busy_s']:>12.3f}{r['model_steps']:>13d}"
                     f"{r['tokens_per_step']:>13.1f}{r['in_steps_s']:>12.3f}")
    for i, r in enumerate(rows):
        if r.get("parts_s"):
            lines.append(f"  call {i + 1}, vLLM's named parts (CPU s): "
                         + ", ".join(f"{name} {t:.3f}" for name, t in r["parts_s"].items()))
    return "\n".join(lines)


def _load_trace(path: str) -> dict:
    with gzip.open(path, "rb") as f:
        return json.load(f)


def phase_table(rows: list[dict]) -> str:
    lines = [f"{'worker call':<24}{'wall s':>10}{'compute s':>12}{'comm alone s':>14}{'idle s':>10}"]
    for r in rows:
        lines.append(f"{r['phase']:<24}{r['wall_s']:>10.3f}{r['compute_s']:>12.3f}{r['comm_alone_s']:>14.3f}"
                     f"{r['idle_s']:>10.3f}")
    return "\n".join(lines)


class StepProfiler:
    def __init__(self):
        self.prof: profile | None = None

    def start(self) -> None:
        if self.prof is not None:
            raise RuntimeError("the profiler is already recording")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=activities)
        self.prof.start()

    def stop(self, path_prefix: str, engine_trace: str | None = None) -> list[str]:
        """Stop recording and write `<path_prefix>.json.gz` and `<path_prefix>.txt`; returns their paths.
        `engine_trace`: the rollout engine's own trace of the same step (vLLM's profiler, in the engine
        core's process), summed up per rollout call in the table."""
        if self.prof is None:
            raise RuntimeError("the profiler was not started")
        prof, self.prof = self.prof, None
        prof.stop()
        os.makedirs(os.path.dirname(path_prefix) or ".", exist_ok=True)
        trace, table = path_prefix + ".json.gz", path_prefix + ".txt"
        prof.export_chrome_trace(path_prefix + ".json")
        cuda = torch.cuda.is_available()
        with open(path_prefix + ".json", "rb") as src:
            own = json.load(src) if cuda or engine_trace else {}   # the tables need the ranges and kernels
            events = own.get("traceEvents", [])
            src.seek(0)
            with gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.remove(path_prefix + ".json")
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        with open(table, "w") as f:
            if cuda:
                f.write("How the GPU spent each worker call (this process's kernels only)\n"
                        + phase_table(gpu_time_by_phase(events)) + "\n\n")
            if engine_trace:
                engine = _load_trace(engine_trace)
                shift_us = (engine.get("baseTimeNanoseconds", 0) - own.get("baseTimeNanoseconds", 0)) / 1e3
                f.write("What the engine core did during each rollout call (its own process)\n"
                        + engine_table(engine_time_by_rollout(events, engine["traceEvents"], shift_us)) + "\n\n")
            f.write(prof.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS) + "\n")
        return [trace, table]
