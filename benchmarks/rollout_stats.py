"""What the rollout benchmark (bench_rollout.py) records and how it sums it up.

Instruments: `TimedSearcher` (every search call's interval), `StepTimer` (vLLM's engine steps and
its engine core's timeline), `profiled` (cProfile) and `gpu_profiled` (vLLM's torch profiler).
Summaries: a rollout's agent row (`agent_stats`, `merged_agent_stats` for several engines at once),
a core timeline's (`core_timeline_stats`, `core_mode_stats`), a trajectory's turns (`turns_of`,
which the replay baseline re-runs) and the median of a baseline's repeats (`median_run`,
`baseline_row`). Kept apart from the script so that tests/benchmarks/test_rollout_stats.py checks
the arithmetic on hand-made inputs, without an engine.
"""
from __future__ import annotations

import contextlib
import cProfile
import math
import pstats
import time
from collections import Counter
from pathlib import Path


def percentile(sorted_values: list[float], q: int) -> float:
    """The q-th percentile (nearest rank below) of an ascending list."""
    return sorted_values[q * (len(sorted_values) - 1) // 100]


class TimedSearcher:
    """The real HTTP searcher; records the wall-clock interval of every call and empty answers."""

    def __init__(self, inner):
        self.inner = inner
        self.intervals: list[tuple[float, float]] = []
        self.empty = 0  # queries answered with no passage

    def search(self, queries, topk):
        t0 = time.perf_counter()
        try:
            hits = self.inner.search(queries, topk)
        finally:
            self.intervals.append((t0, time.perf_counter()))
        self.empty += sum(not h for h in hits)
        return hits

    async def asearch(self, queries, topk):
        t0 = time.perf_counter()
        try:
            hits = await self.inner.asearch(queries, topk)
        finally:
            self.intervals.append((t0, time.perf_counter()))
        self.empty += sum(not h for h in hits)
        return hits

    def call_ms(self) -> dict:
        """Median and 90th percentile of one call's duration (a batched request: all queries of a step)."""
        calls = sorted(stop - start for start, stop in self.intervals)
        if not calls:
            return {}
        return {f"retrieval_call_ms_p{q}": round(1000 * percentile(calls, q), 1) for q in (50, 90)}

    def busy_s(self) -> float:
        """Time during which at least one search was in flight (overlapping calls count once)."""
        total, end = 0.0, -math.inf
        for start, stop in sorted(self.intervals):
            if stop > end:
                total += stop - max(start, end)
                end = stop
        return total


class StepTimer:
    """Times vLLM's engine steps during a rollout and counts the prompt tokens its prefix cache
    served: the wall time outside the steps is the agent loop's own (Python) time, during which the
    in-process engine is idle. Steps that begin with requests waiting to be scheduled ("admission
    steps": they prefill the new requests next to the running decodes) are also timed apart.
    `prefix_cached_frac` is over ALL prompt tokens of all requests, first prompts and new
    observations included, which the cache cannot hold: it is not the hit rate on re-sent history.

    It also keeps the engine core's own timeline: every core step's time stamp (taken in the core,
    on the system's monotonic clock, so also when the core runs in a process of its own and steps
    ahead of this one) and how many requests it advanced. From it, `core_span_s` (first to last
    core step), `tail_s` (time in core steps that advanced fewer than a quarter of the run's largest
    batch: the end of the rollout, where the engine runs far below its width) and `core_gaps_s` (the
    intervals between core steps longer than 10 median steps, less one median step each: the core
    idle, waiting for requests; an admission step, which prefills, lasts several median steps).
    `client_lag_ms_*`: how long a core step's outputs waited before this process took them (with
    the core in its own process, the loop sees finished turns that much later).

    With vLLM's statistics on (`--core-stats`: log stats, CUDA-graph metrics, iteration details),
    every core step is kept, also one that advanced no request (a prefill chunk), with the tokens it
    scheduled (and how many of them were prefill), the requests left waiting, the CUDA-graph mode it
    ran in and how long the core waited for its output; `core_modes` then sums steps and seconds per
    mode, `prefill_steps`/`prefill_step_s` those that carried a prefill, and
    `core_wait_frac` the share of the span the core waited on the GPU (the rest it spent in its own
    Python: scheduling, bookkeeping, outputs)."""

    def __init__(self, engine):
        self.llm_engine = getattr(getattr(engine, "llm", None), "llm_engine", None)
        core = getattr(getattr(self.llm_engine, "engine_core", None), "engine_core", None)
        self.scheduler = getattr(core, "scheduler", None)  # in-process engine core only
        self.steps, self.step_s, self.prompt_tokens, self.cached_tokens = 0, 0.0, 0, 0
        self.admission_steps, self.admission_step_s = 0, 0.0
        self.core_client = getattr(self.llm_engine, "engine_core", None)
        self.core_steps: list[tuple[float, int]] = []  # (core's monotonic time stamp, requests advanced)
        self.lags: list[float] = []  # seconds from a core step's outputs to this process taking them
        self.with_stats = bool(getattr(self.llm_engine, "log_stats", False))
        # per core step: tokens, prefill tokens, requests waiting, CUDA-graph mode, ms waited on the GPU
        self.core_stats: list[tuple[int, int, int, str, float]] = []

    def __enter__(self):
        self.entered = time.monotonic()
        if self.llm_engine is not None:
            inner = self.llm_engine.step

            def step():
                admitting = self.scheduler is not None and bool(getattr(self.scheduler, "waiting", ()))
                t0 = time.perf_counter()
                outputs = inner()
                dt = time.perf_counter() - t0
                self.step_s += dt
                self.steps += 1
                if admitting:
                    self.admission_steps += 1
                    self.admission_step_s += dt
                for o in outputs:
                    if o.finished:
                        self.prompt_tokens += len(o.prompt_token_ids or ())
                        self.cached_tokens += o.num_cached_tokens or 0
                return outputs

            self.llm_engine.step = step
            inner_get = self.core_client.get_output

            def get_output():
                outputs = inner_get()
                stats = getattr(outputs, "scheduler_stats", None)  # each core step's, with --core-stats
                now = time.monotonic()
                stamp = getattr(outputs, "timestamp", 0.0) or now
                # A step that advanced nothing can arrive after its run ended: not this run's.
                if outputs.outputs or (stats is not None and stamp >= self.entered):
                    self.core_steps.append((stamp, len(outputs.outputs)))
                    self.lags.append(now - stamp)
                    if self.with_stats:
                        # CUDA-graph statistics come from vLLM's first model runner only; the
                        # iteration details (vLLM >= 0.26) from every runner.
                        graph = getattr(stats, "cudagraph_stats", None)
                        details = getattr(stats, "iteration_details", None)
                        tokens = (graph.num_unpadded_tokens if graph else
                                  details.num_ctx_tokens + details.num_generation_tokens if details else -1)
                        self.core_stats.append((tokens, details.num_ctx_tokens if details else -1,
                                                stats.num_waiting_reqs if stats else -1,
                                                str(graph.runtime_mode) if graph else "unknown",
                                                round(details.elapsed_ms, 3) if details else -1.0))
                return outputs

            self.core_client.get_output = get_output
        return self

    def __exit__(self, *exc):
        if self.llm_engine is not None:
            del self.llm_engine.step  # the instance attributes: the classes' methods show again
            del self.core_client.get_output

    def stats(self, wall_s: float) -> dict:
        if self.llm_engine is None:
            return {}
        stats = {"engine_steps": self.steps, "engine_step_s": round(self.step_s, 3),
                 "outside_steps_s": round(wall_s - self.step_s, 3),
                 "prefix_cached_frac": round(self.cached_tokens / max(1, self.prompt_tokens), 3)}
        if self.scheduler is not None:
            stats |= {"admission_steps": self.admission_steps, "admission_step_s": round(self.admission_step_s, 3)}
        lags = sorted(self.lags)
        if lags:  # a core in its own process steps ahead; a lagging loop sees finished turns late
            stats |= {"client_lag_ms_mean": round(1000 * sum(lags) / len(lags), 2),
                      "client_lag_ms_p90": round(1000 * percentile(lags, 90), 2)}
        return stats | core_timeline_stats(self.core_steps) | core_mode_stats(self.core_steps, self.core_stats)

    def timeline(self) -> dict:
        """The core steps as seconds from the first and requests advanced (for --timeline), and with
        --core-stats the tokens each scheduled, the requests waiting, its CUDA-graph mode and the
        milliseconds the core waited for its output."""
        t0 = self.core_steps[0][0] if self.core_steps else 0.0
        timeline = {"t": [round(t - t0, 5) for t, _ in self.core_steps], "batch": [n for _, n in self.core_steps]}
        if self.core_stats:
            timeline |= dict(zip(("tokens", "prefill_tokens", "waiting", "graph", "wait_ms"),
                                 map(list, zip(*self.core_stats))))
        return timeline


def core_timeline_stats(core_steps: list[tuple[float, int]]) -> dict:
    """Summary of a core timeline [(time stamp, requests advanced)]; see StepTimer."""
    if len(core_steps) < 2:
        return {}
    times = [t for t, _ in core_steps]
    gaps = [b - a for a, b in zip(times, times[1:])]  # gaps[i] ends at core step i + 1
    median = sorted(gaps)[len(gaps) // 2]
    widest = max(n for _, n in core_steps)
    tail = [gap for gap, (_, n) in zip(gaps, core_steps[1:]) if 4 * n < widest]
    return {"core_steps": len(core_steps), "core_span_s": round(times[-1] - times[0], 3),
            "core_mean_batch": round(sum(n for _, n in core_steps) / len(core_steps), 1),
            "tail_steps": len(tail), "tail_s": round(sum(tail), 3),
            "core_gaps_s": round(sum(gap - median for gap in gaps if gap > 10 * median), 3)}


def core_mode_stats(core_steps: list[tuple[float, int]], core_stats: list[tuple[int, int, int, str, float]]) -> dict:
    """Steps and seconds per CUDA-graph mode, and of the steps that carried a prefill; a step's
    seconds are the interval that ends at its time stamp. `core_wait_frac`: the share of the core's
    span it spent blocked on the model's output (vLLM's iteration details: with asynchronous
    scheduling the core waits only when it has nothing left to prepare) — near 1 the GPU sets the
    pace, near 0 the core's own Python does. Empty without --core-stats."""
    if len(core_stats) != len(core_steps) or len(core_steps) < 2:
        return {}
    modes: dict[str, list] = {}
    prefill_steps, prefill_s = 0, 0.0
    waits = [wait for *_, wait in core_stats[1:] if wait >= 0]
    for (t_prev, _), (t, advanced), (tokens, prefill, _, mode, _) in zip(core_steps, core_steps[1:], core_stats[1:]):
        entry = modes.setdefault(mode, [0, 0.0])
        entry[0] += 1
        entry[1] += t - t_prev
        # vLLM's count of prefill tokens where it gives one: "more tokens than requests advanced" also
        # holds for a step that decoded a request the loop had just aborted (a stop string matched).
        carried_prefill = prefill > 0 if prefill >= 0 else tokens > advanced
        if carried_prefill:
            prefill_steps += 1
            prefill_s += t - t_prev
    span = core_steps[-1][0] - core_steps[0][0]
    return {"core_modes": {mode: {"steps": n, "s": round(sec, 3)} for mode, (n, sec) in sorted(modes.items())},
            "prefill_steps": prefill_steps, "prefill_step_s": round(prefill_s, 3),
            **({"core_wait_frac": round(sum(waits) / 1000 / span, 3)} if waits and span > 0 else {})}


def turns_of(t) -> list[tuple[int, list[int]]]:
    """A trajectory as its turns: (model tokens written, observation ids appended after them)."""
    turns: list[list] = []
    for token, model in zip(t.response_ids, t.loss_mask):
        if not turns or (model and turns[-1][1]):  # a model token after an observation opens a turn
            turns.append([0, []])
        if model:
            turns[-1][0] += 1
        else:
            turns[-1][1].append(token)
    return [(n, obs) for n, obs in turns]


def agent_stats(prompts, trajectories, searcher: TimedSearcher, timer: StepTimer, wall_s: float) -> dict:
    """The agent row's figures of one rollout: tokens/s of the model's own tokens (loss_mask 1),
    what it prefilled besides, its turns, searches and finish reasons, and the searcher's and the
    engine's timings."""
    model_tokens_B = [sum(t.loss_mask) for t in trajectories]
    n, turns = len(trajectories), sum(t.turns for t in trajectories)
    return {
        "wall_s": round(wall_s, 3),
        "model_tokens": sum(model_tokens_B),
        "tokens_per_s": round(sum(model_tokens_B) / wall_s, 1),
        "prompt_tokens": sum(map(len, prompts)),
        "observation_tokens": sum(len(t.loss_mask) for t in trajectories) - sum(model_tokens_B),
        "turns_per_trajectory": round(turns / n, 3),
        "model_tokens_per_turn": round(sum(model_tokens_B) / turns, 1),
        "searches_valid": sum(t.searches for t in trajectories),
        "invalid_actions": sum(t.invalid_actions for t in trajectories),
        "finish": dict(Counter(str(t.finish) for t in trajectories)),
        "retrieval_busy_s": round(searcher.busy_s(), 3),
        "retrieval_calls": len(searcher.intervals),
        **searcher.call_ms(),
        "searches_without_passages": searcher.empty,
        "retrieval_failed": sum(t.retrieval_failed for t in trajectories),
        **timer.stats(wall_s),
    }


def merged_agent_stats(parts: list[dict], sizes: list[int], wall_s: float) -> dict:
    """One row from the agent rollouts of several engines run at once (`--engines`); each engine's
    own statistics stay in `per_engine`."""
    tokens = sum(p["model_tokens"] for p in parts)
    turns = sum(p["turns_per_trajectory"] * n for p, n in zip(parts, sizes))
    finish: Counter = Counter()
    for p in parts:
        finish.update(p["finish"])
    return {"wall_s": round(wall_s, 3), "model_tokens": tokens, "tokens_per_s": round(tokens / wall_s, 1),
            **{key: sum(p[key] for p in parts) for key in (
                "prompt_tokens", "observation_tokens", "searches_valid", "invalid_actions", "retrieval_calls",
                "searches_without_passages", "retrieval_failed")},
            "turns_per_trajectory": round(turns / sum(sizes), 3), "model_tokens_per_turn": round(tokens / turns, 1),
            "retrieval_busy_s": round(sum(p["retrieval_busy_s"] for p in parts), 3), "finish": dict(finish),
            "per_engine": parts}


def median_run(runs: list[tuple[float, dict]]) -> tuple[float, dict, list[float]]:
    """The run of median wall time (its seconds and statistics) and every run's seconds, in the
    order they ran: the baselines vary more from run to run than the agent loop does. Of an even
    number of runs, the faster middle one: the ratios then do not favour the agent loop."""
    wall_s, stats = sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2]
    return wall_s, stats, [round(run[0], 3) for run in runs]


def baseline_row(run: dict, mode: str, median: tuple[float, dict, list[float]], model_tokens: int,
                 prompt_tokens: int) -> dict:
    """The row of a baseline from its `median_run`: the median run's wall and statistics, every
    repeat's wall, and tokens/s over the agent's model tokens (a baseline writes exactly as many)."""
    wall_s, stats, wall_s_all = median
    return {**run, "mode": mode, "wall_s": round(wall_s, 3), "wall_s_all": wall_s_all, "model_tokens": model_tokens,
            "tokens_per_s": round(model_tokens / wall_s, 1), "prompt_tokens": prompt_tokens, **stats}


@contextlib.contextmanager
def profiled(path: str | None, title: str):
    """Appends the block's cProfile (the busiest functions by own and by cumulative time; from
    Python 3.12 on, other threads' calls count too) to `path`; does nothing without a path."""
    if not path:
        yield
        return
    t0 = time.perf_counter()
    with cProfile.Profile() as prof:
        yield
    with open(path, "a") as f:
        f.write(f"\n=== {title}, {time.perf_counter() - t0:.1f} s (profiled) ===\n")
        stats = pstats.Stats(prof, stream=f)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)


@contextlib.contextmanager
def gpu_profiled(engine, trace_dir: str | None, label: str):
    """With `trace_dir` (`--torch-profile`), vLLM's torch profiler records a window of the block's
    engine steps (its profiler config says which), and the trace is renamed `{label}.pt.trace.json.gz`
    for `trace_steps.py`. The core stops to write the trace when the window ends: walls measured so
    are for diagnosis only."""
    if not trace_dir or not hasattr(engine, "llm"):
        yield
        return
    before = set(Path(trace_dir).glob("*.pt.trace.json*"))
    engine.llm.start_profile()
    try:
        yield
    finally:
        engine.llm.stop_profile()
        new = sorted(set(Path(trace_dir).glob("*.pt.trace.json*")) - before, key=lambda f: f.stat().st_mtime)
        for k, trace in enumerate(new):  # one per window; none if the block ended before the window began
            trace.rename(Path(trace_dir) / f"{label}{f'-{k}' if k else ''}.pt.trace.json.gz")
