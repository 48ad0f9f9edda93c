"""Rollout: generated tokens/s of the search agent loop vs the engine's plain generation of the same tokens.

For each concurrency (trajectories in one rollout) and schedule (sync, async), the agent loop of
`search_r1.agent.loop` runs with a real engine against a real retrieval server: the bundled MiniLM
encoder and an exact index over the bundled corpus (BM25 would answer most gibberish queries with
nothing: it drops hits that share no term with the query). Then ONE plain engine call (or the
median of --baseline-repeats such calls: this side varies more between runs) generates, for
every trajectory, exactly as many tokens as the model wrote in it (loss_mask 1; observations
excluded), from the same prompt, with the same sampling settings but no stop strings and EOS ignored.
ratio = agent tokens/s ÷ plain tokens/s; the goal is ≥ 0.9 (tool calls must not stall the engine).
A second plain call puts each trajectory's observation tokens at the end of its prompt
(`ratio_to_plain_with_obs`): it prefills them too and decodes over contexts as long as the agent's
final ones, which bounds from the other side what the observations themselves cost.
A third baseline (vLLM only) replays the agent's own turns without its tools (`ratio_to_replay`):
each trajectory's turns in order, each writing as many tokens as the agent's did, its observation
appended the moment the turn ends and admitted as the continuous schedule admits turns. The engine
then does the agent's work — the same requests, prefills and contexts — with no search to wait for
and no parsing: the ratio measures what the tool calls and the loop cost the engine, which is what
"tool calls must not stall the engine" asks about. The replay itself is slower than one plain call
(observations to prefill, turns of a trajectory one after another), which caps the first ratio.
Every vLLM row also summarises the engine core's timeline (`StepTimer`: its steps, batch, the tail
where it runs below a quarter of its width, idle gaps); `--timeline FILE` keeps the whole of it.
The HF fallback runs the same loop at a smaller concurrency, and its tokens/s are compared with
vLLM's at that concurrency.

The plain run does less work: the agent loop also prefills the observations (retrieved passages,
corrections) and re-sends each trajectory's history every turn (vLLM's prefix cache, on by default,
serves most of it; HF recomputes it). Rows report prompt and observation tokens so this can be judged.
The async schedule goes through the engines' `generate_one` micro-batcher, as the trainer runs it;
the continuous schedule (vLLM) steps the engine itself and adds each next turn to the running batch.
vLLM's engine core (scheduler and model) runs in this process, as in the trainer, which pushes
weights into it; `--engine-core separate` gives it a process of its own, so the agent loop's Python
(admissions, detokenising, search threads) no longer competes with the scheduler for one interpreter.
`--engines K` (with a separate core) runs K engines on the same device, each with 1/K of the
trajectories and of the memory share, all at once — the agent and each baseline alike: where one
core's per-request CPU work leaves the GPU idle part of every step, K cores may fill it.

Model: random weights of a Qwen2.5 shape (Llama layout), Qwen3-4B or Qwen3-30B-A3B (`random_models.py`,
as `bench_grpo_step.py` builds it), vocabulary = the tokenizer's: SmolLM2's 49,152 (+2 tags) by default;
pass --tokenizer with a Qwen2.5 or Qwen3 tokenizer for its 151k-token LM head.

How the random policy is steered (on its own it never writes a tag):
- `<search>` and `</search>` are added to the tokenizer as single ordinary (not special) tokens: each
  is one draw, decodes to its text (the loop parses text decoded without special tokens), and the
  model's vocabulary covers both.
- Both get a logit bias through `SamplingConfig.logit_bias` (vLLM `logit_bias`, HF `sequence_bias`)
  that gives each the same probability p = (max_turns + 1) / response_tokens per token. Each bias is
  calibrated once, with the first engine built: start from b = ln(p·V / (1 − 2p)) (right if the
  logits were uniform over the V tokens; a random model's own offset for a token puts it off by up
  to ~2x), generate freely from the prompts (2/p tokens each, no stop strings), count the tag and
  correct b by ln(p / measured frequency). --tag-bias sets both instead. A turn then ends at its
  first `</search>`, after ~1/p tokens (geometric), so max_turns + 1 turns make ~response_tokens
  model tokens. Each turn is capped at --max-tokens-per-turn (default 4/p: a turn reaches it with
  probability e^-4 ≈ 2%, which ends the trajectory as `length`).
- Nothing else is steered: prompts (bundled questions, 5 trajectories per question), stop strings,
  parsing, observations and finish rules are the loop's own; sampling is at temperature 1.
- A bias that does not depend on earlier tokens cannot make most turns valid: a turn is a valid
  search only if exactly one `<search>` precedes its `</search>`, which happens with probability
  r(1 − r), r = P(<search>) / (P(<search>) + P(</search>)), at most 1/4 at r = 1/2 (hence equal
  biases). The rest are invalid actions (`</search>` without `<search>`: 1/2; two `<search>`: 1/4)
  that the loop answers with its short correction instead of passages. Expect ~1 real (gibberish)
  search per trajectory of 4 searchable turns; rows report valid searches, invalid actions, turns
  and finish reasons. `</answer>` is several tokens and never appears, so trajectories end by
  max_turns (a `</search>` in the last turn), length (a turn hit its cap) or, rarely, EOS.

CPU figures (--quick) are a smoke test: on a busy machine torch ops ran much slower in the main
thread (the sync schedule, the plain runs) than in a worker thread (the async schedule's engine
calls), so CPU ratios say nothing about the schedules.

HF decodes step by step at a cost that hardly depends on the batch, and a sync turn lasts as long as
its longest trajectory, so HF at the full settings takes many minutes: compare it at smaller ones.

    python benchmarks/bench_rollout.py --shape 3b --engine vllm --trajectories 256,512,1024   # one GPU
    python benchmarks/bench_rollout.py --shape 3b --engine both --trajectories 64 --hf-trajectories 64 \
        --max-turns 2 --response-tokens 300 --schedules sync                                 # HF vs vLLM
    python benchmarks/bench_rollout.py --quick                                                # CPU (CI)

The script reads top to bottom: arguments, setup (model, prompts, tag bias, retrieval server), the
runs (`measure`: each agent rollout, then its baselines), the report. What it records and how it
sums it up is in `rollout_stats.py`; the baselines are in `rollout_baselines.py`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the package first, then the test helpers

import torch  # noqa: E402

from random_models import SHAPES, TAGS, make_random_model, tag_bias, tagged_tokenizer  # noqa: E402
from result_rows import emit_row  # noqa: E402
from rollout_baselines import cold_prefix_cache, plain_hf, plain_vllm, replay_vllm  # noqa: E402
from rollout_stats import (StepTimer, TimedSearcher, agent_stats, baseline_row, gpu_profiled,  # noqa: E402
                           median_run, merged_agent_stats, profiled, turns_of)

log = logging.getLogger("bench_rollout")

SAMPLES_PER_QUESTION = 5  # trajectories share a prompt in groups, as GRPO's n does


# -- arguments -------------------------------------------------------------------------------------
def vllm_arg(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not (key and sep):
        raise argparse.ArgumentTypeError(f"{item!r}: write KEY=VALUE, e.g. max_num_seqs=512")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, --quick's settings and the checks that need no engine."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    p.add_argument("--tokenizer", help="a tokenizer dir (default: SmolLM2's, from the bundled GGUF)")
    p.add_argument("--engine", choices=["vllm", "hf", "both"],
                   help="default: both (--quick: both if vllm imports, else hf)")
    p.add_argument("--trajectories", default="256,512,1024", help="vLLM concurrencies, comma-separated")
    p.add_argument("--hf-trajectories", default="64", help="HF concurrencies (vLLM also runs these with both)")
    p.add_argument("--schedules", default="sync,async,continuous",
                   help="agent-loop schedules, comma-separated (continuous: vLLM only, skipped for HF)")
    p.add_argument("--max-turns", type=int, default=4, help="searches allowed per trajectory")
    p.add_argument("--response-tokens", type=int, default=900,
                   help="mean model tokens per trajectory, spread over max_turns + 1 turns (sets the tag bias)")
    p.add_argument("--max-tokens-per-turn", type=int, help="default: 4 × the mean turn length")
    p.add_argument("--max-obs-length", type=int, default=500, help="tokens per observation")
    p.add_argument("--topk", type=int, default=3, help="passages per search")
    p.add_argument("--tag-bias", type=float, help="logit bias of both tags (default: calibrated to --response-tokens)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.7,
                   help="vLLM's share of GPU memory; the rest holds the HF engine with --engine both")
    p.add_argument("--cudagraph-mode", help="vLLM compilation_config.cudagraph_mode, e.g. FULL (default: vLLM's); "
                   "GPU only")
    p.add_argument("--max-cudagraph-capture-size", type=int,
                   help="vLLM: steps of up to this many tokens run as CUDA graphs (default: vLLM's, ≤ 512)")
    p.add_argument("--engine-core", choices=["in-process", "separate"], default="in-process",
                   help="vLLM's engine core (scheduler + model) in this process, as the trainer runs it, or in a "
                        "process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1), away from the agent loop's Python")
    p.add_argument("--retriever-url", help="search this running server (its /retrieve) instead of starting one "
                   "over a MiniLM index of the bundled corpus (e.g. the tests' BM25 server)")
    p.add_argument("--retrieval-devices",
                   help="the retrieval server's --devices, e.g. cpu (default: the server's, every GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-seeds", action="store_true",
                   help="every request with a seed of its own, as the trainer's rollout.request_seeds=true seeds "
                        "them (the agent's per trajectory and turn, the baselines' per request); default: none, "
                        "all draw from the engine's stream")
    p.add_argument("--workdir", default="outputs/bench_rollout")
    p.add_argument("--quick", action="store_true", help="CPU, tiny shape and sizes (CI)")
    p.add_argument("--out", help="append one JSON row per measurement to this file")
    p.add_argument("--admit-every-steps", default="8",
                   help="continuous schedule: comma-separated values of AgentConfig.admit_every_steps, each timed")
    p.add_argument("--baseline-repeats", type=int, default=1,
                   help="run each plain baseline this many times and compare with the median (rows keep every wall)")
    p.add_argument("--timeline", help="append every run's engine-core timeline (time stamps, requests advanced per "
                                      "core step) to this JSONL file")
    p.add_argument("--core-stats", action="store_true",
                   help="vLLM: statistics of every core step (log stats, CUDA-graph metrics, iteration details): "
                        "tokens scheduled, requests waiting, CUDA-graph mode, time waited on the GPU "
                        "(rows: core_modes, prefill_steps, core_wait_frac; --timeline: per step)")
    p.add_argument("--profile", help="append a cProfile summary of every agent rollout and plain run with "
                                     "observations to this file "
                                     "(slows the loop's Python: rows measured so are for diagnosis only)")
    p.add_argument("--engines", type=int, default=1,
                   help="vLLM: this many engines share the device, each with 1/K of the trajectories and of "
                        "--gpu-memory-utilization, all running at once (needs --engine-core separate)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE", type=vllm_arg,
                   help="vLLM: one more vllm.LLM argument, VALUE read as JSON if it parses (else a string); "
                        "repeatable, e.g. --vllm-arg max_num_batched_tokens=16384 --vllm-arg "
                        "prefix_caching_hash_algo=xxhash (rows: vllm_args)")
    p.add_argument("--torch-profile", metavar="DIR",
                   help="vLLM: record a window of engine steps of every run with the torch profiler into DIR "
                        "(summarise with trace_steps.py; the walls are then for diagnosis only)")
    p.add_argument("--torch-profile-steps", default="300,40", type=lambda s: tuple(map(int, s.split(","))),
                   help="the window: steps after each run's start, steps recorded")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.quick:
        a.shape, a.trajectories, a.hf_trajectories, a.max_turns = "tiny", "4", "4", 2
        a.response_tokens, a.max_obs_length = 48, 128
        from conftest import vllm_skip_reason
        a.engine = a.engine or ("hf" if vllm_skip_reason() else "both")
    a.engine = a.engine or "both"
    if a.engines > 1 and (a.engine != "vllm" or a.engine_core != "separate" or a.profile or a.torch_profile
                          or a.timeline or a.core_stats):
        raise SystemExit("--engines > 1 runs vLLM engine cores in processes of their own: it needs --engine vllm "
                         "--engine-core separate, and takes none of --profile, --torch-profile, --timeline, "
                         "--core-stats")
    if a.torch_profile:  # an absolute path: vLLM's profiler may write it from the core's own process
        a.torch_profile = str(Path(a.torch_profile).resolve())
    return a


# -- setup -----------------------------------------------------------------------------------------
def build_model(a, work: Path) -> tuple[str, object]:
    name = "smollm2" if a.tokenizer is None else Path(a.tokenizer).name
    tok = tagged_tokenizer(a.tokenizer, work / f"tokenizer_{name}")
    out = work / f"model_{a.shape}_{name}"
    if (out / "config.json").is_file():  # same arguments give the same weights: reuse
        return str(out), tok
    return make_random_model(out, a.shape, work / f"tokenizer_{name}"), tok


def make_prompts(tok, n: int) -> list[list[int]]:
    from search_r1.data.bundled import bundled_paths, read_jsonl
    from search_r1.data.templates import make_prompt, make_prompt_text

    questions = [r["question"] for split in ("test", "train") for r in read_jsonl(bundled_paths()[split])]
    prompts = []
    for i in range(n):
        question = questions[(i // SAMPLES_PER_QUESTION) % len(questions)]
        text = (tok.apply_chat_template(make_prompt(question), add_generation_prompt=True, tokenize=False)
                if tok.chat_template else make_prompt_text(question, "base"))
        prompts.append(tok(text, add_special_tokens=False).input_ids)
    return prompts


def calibrate_tag_bias(engine, prompts, tag_ids: list[int], mean_turn: float) -> dict[int, float]:
    """Each tag's bias such that the engine writes it once every `mean_turn` tokens.

    A random model's logit for a given token has an offset of its own (`tag_bias`, right for uniform
    logits, is off for a 0.5b/3b shape: see the module docstring), so measure: generate freely (no
    stop strings) under the uniform-logit guess, count each tag, and correct its bias by
    log(target / measured frequency). While p ≪ 1 it is proportional to e^bias, so one step
    suffices up to sampling noise (~10% with ≥ 100 hits)."""
    from verl.workers.rollout.engine import SamplingConfig

    guess = {t: tag_bias(len(engine.tokenizer), mean_turn) for t in tag_ids}
    generations = engine.generate(prompts, SamplingConfig(max_tokens=round(2 * mean_turn), logit_bias=guess), stop=[])
    counts = Counter(t for g in generations for t in g.token_ids)
    total = sum(len(g.token_ids) for g in generations)
    return {t: b + math.log(total / mean_turn / max(counts[t], 1)) for t, b in guess.items()}


def vllm_engine_kwargs(a, gpu: bool) -> dict:
    """The vllm.LLM arguments the flags ask for, beyond the model, seed and context length."""
    kw = ({"gpu_memory_utilization": a.gpu_memory_utilization / a.engines} if gpu
          else {"kv_cache_memory_bytes": 256 << 20})  # small explicit CPU cache: no profiling run
    compilation = {k: v for k, v in (("cudagraph_mode", a.cudagraph_mode),
                                      ("max_cudagraph_capture_size", a.max_cudagraph_capture_size)) if v}
    if compilation:
        kw["compilation_config"] = compilation
    kw |= dict(a.vllm_arg)
    if a.core_stats:
        kw |= {"disable_log_stats": False, "cudagraph_metrics": True,
               "enable_logging_iteration_details": True}
        logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)  # a line per step
    if a.torch_profile:  # a window of steps of every run, each step named with its batch
        kw["profiler_config"] = {
            "profiler": "torch", "torch_profiler_dir": a.torch_profile, "torch_profiler_with_stack": False,
            "torch_profiler_dump_cuda_time_total": False, "detailed_trace_annotation": True,
            "ignore_frontend": True, "delay_iterations": a.torch_profile_steps[0],
            "max_iterations": a.torch_profile_steps[1]}
    return kw


def start_retrieval_server(a, work: Path, gpu: bool):
    """The retrieval server the agent searches: the bundled MiniLM encoder and an exact index over
    the bundled corpus (built into `work` once)."""
    from conftest import ServerProcess
    from search_r1.data.bundled import bundled_paths
    from search_r1.retrieval.build import build_dense

    corpus = bundled_paths()["corpus"]
    index = work / "minilm_index"
    if not ((index / "index_meta.json").is_file() and json.loads((index / "index_meta.json").read_text())["complete"]):
        build_dense(str(corpus), str(index), "all-MiniLM-L6-v2", progress=False)
        if gpu:
            torch.cuda.empty_cache()  # the encoder's memory goes back before vLLM sizes its cache
    return ServerProcess(["--retriever_name", "minilm", "--retriever_model", "all-MiniLM-L6-v2",
                          "--index_path", str(index), "--corpus_path", str(corpus),
                          *(["--devices", a.retrieval_devices] if a.retrieval_devices else [])],
                         work / "retrieval.log")


# -- runs ------------------------------------------------------------------------------------------
def run_agent(engine, searcher: TimedSearcher, prompts, cfg, sampling, profile: str | None = None,
              timeline: list | None = None) -> tuple[dict, list[list[tuple[int, list[int]]]]]:
    """One rollout; returns its statistics and every trajectory's turns (`turns_of`). With
    `profile`, appends the rollout's cProfile to that file; with `timeline`, appends its core steps."""
    from search_r1.agent.loop import SearchAgent

    searcher.intervals.clear()
    searcher.empty = 0
    t0 = time.perf_counter()
    with StepTimer(engine) as timer, profiled(profile, f"agent, {len(prompts)} trajectories, {cfg.schedule} schedule"):
        trajectories = SearchAgent(engine, searcher, cfg).run(prompts, sampling)
    wall_s = time.perf_counter() - t0
    if timeline is not None:
        timeline.append(timer.timeline())
    return agent_stats(prompts, trajectories, searcher, timer, wall_s), [turns_of(t) for t in trajectories]


def measure(engine_name: str, engine, plain, searcher, prompts_all, concurrencies, schedules, cfg, sampling,
            common: dict, emit, profile: str | None = None, admit_every: tuple[int, ...] = (8,),
            baseline_repeats: int = 1, timeline_path: str | None = None, torch_profile: str | None = None) -> None:
    from search_r1.agent.loop import Schedule

    for n in concurrencies:
        prompts = prompts_all[:n]
        runs = [(s, k) for s in schedules for k in (admit_every if s == "continuous" else (None,))]
        for schedule, admit in runs:
            if schedule == "continuous" and not engine.continuous:
                continue  # the HF engine has no continuous batching
            log.info("%s: %d trajectories, %s schedule%s", engine_name, n, schedule,
                     f", admitting every {admit} steps" if admit else "")
            cfg_s = replace(cfg, schedule=Schedule(schedule), admit_every_steps=admit or cfg.admit_every_steps)
            extra = {"admit_every_steps": admit} if admit else {}
            run = {**common, "engine": engine_name, "trajectories": n, "schedule": schedule, **extra}
            timelines = {mode: [] for mode in ("agent", "plain", "plain_with_obs", "replay")}
            cold_prefix_cache(engine)
            with gpu_profiled(engine, torch_profile, f"agent-{n}-{schedule}{admit or ''}"):
                agent, turns_B = run_agent(engine, searcher, prompts, cfg_s, sampling, profile, timelines["agent"])
            n_tokens_B = [sum(k for k, _ in turns) for turns in turns_B]
            obs_ids_B = [[i for _, obs in turns for i in obs] for turns in turns_B]
            # Each baseline `baseline_repeats` times, the repeats interleaved (plain, plain + obs, replay,
            # plain, …): identical runs differ noticeably, and interleaved, the baselines share the
            # machine's good and bad minutes instead of each getting minutes of its own.
            # "plain + obs": each trajectory's observations appended to its prompt, so the plain run
            # also prefills them and decodes over contexts as long as the agent's last turn.
            # "replay": the same turns, without the tools (needs the engine's step loop).
            baselines = {"plain": lambda tl: plain(engine, prompts, n_tokens_B, sampling, timeline=tl),
                         "plain_with_obs": lambda tl: plain(engine, [p + o for p, o in zip(prompts, obs_ids_B)],
                                                            n_tokens_B, sampling, timeline=tl)}
            if plain is plain_vllm:
                baselines["replay"] = lambda tl: replay_vllm(engine, prompts, turns_B, sampling,
                                                             cfg_s.admit_every_steps, timeline=tl)
            done: dict[str, list] = {mode: [] for mode in baselines}
            for k in range(baseline_repeats):
                for mode, baseline in baselines.items():
                    log.info("%s: %s baseline of the same %d tokens (%d of %d)", engine_name, mode,
                             sum(n_tokens_B), k + 1, baseline_repeats)
                    title = f"{mode}, {n} trajectories, after the {schedule} schedule"
                    cold_prefix_cache(engine)
                    with (profiled(profile if mode == "plain_with_obs" else None, title),
                          gpu_profiled(engine, torch_profile, f"{mode}-{n}-{schedule}{admit or ''}-{k}")):
                        done[mode].append(baseline(timelines[mode]))
            # ratio_to_plain from the rows' tokens/s (the same tokens: the walls' inverse ratio), the
            # others from the median baseline's wall over the agent's.
            medians = {mode: median_run(runs) for mode, runs in done.items()}
            baseline_rows = {mode: baseline_row(run, mode, median, sum(n_tokens_B), agent["prompt_tokens"]
                                                + (agent["observation_tokens"] if mode == "plain_with_obs" else 0))
                             for mode, median in medians.items()}
            emit({**run, "mode": "agent", **agent,
                  "ratio_to_plain": round(agent["tokens_per_s"] / baseline_rows["plain"]["tokens_per_s"], 3),
                  **{f"ratio_to_{mode}": round(medians[mode][0] / agent["wall_s"], 3)
                     for mode in ("plain_with_obs", "replay") if mode in medians}})
            for row in baseline_rows.values():
                emit(row)
            if timeline_path:
                with open(timeline_path, "a") as f:
                    for mode, runs_ in timelines.items():
                        for k, timeline in enumerate(runs_):
                            f.write(json.dumps({**run, "mode": mode, "repeat": k, **timeline}) + "\n")


def in_parallel(calls: list) -> tuple[float, list]:
    """Runs the calls at once, one thread each, released together; returns the seconds from the
    release to the last one's end and their results, in order."""
    results, errors = [None] * len(calls), []
    release = threading.Barrier(len(calls) + 1)

    def run(i, call):
        release.wait()
        try:
            results[i] = call()
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    release.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, results


def measure_split(engines: list, searchers: list, prompts_all, concurrencies, cfg, sampling, common: dict, emit,
                  admit_every: tuple[int, ...], baseline_repeats: int) -> None:
    """`--engines K`: K vLLM engines (cores in processes of their own) share the GPU, each with
    1/K of the trajectories, all running at once — the agent, then each baseline the same way. When
    one engine core is the bottleneck (its per-request CPU work, with the GPU idle part of each
    step), K cores can keep the GPU busier; the rows say whether they do (`engines`: K)."""
    from search_r1.agent.loop import Schedule

    k = len(engines)
    for n in concurrencies:
        bounds = [n * i // k for i in range(k + 1)]
        chunks = [prompts_all[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
        sizes = [len(c) for c in chunks]
        for admit in admit_every:
            log.info("vllm x%d: %d trajectories, continuous schedule, admitting every %d steps", k, n, admit)
            cfg_s = replace(cfg, schedule=Schedule.CONTINUOUS, admit_every_steps=admit)
            run = {**common, "engine": "vllm", "engines": k, "trajectories": n, "schedule": "continuous",
                   "admit_every_steps": admit}
            for engine in engines:
                cold_prefix_cache(engine)
            wall_s, outs = in_parallel([
                lambda e=e, s=s, c=c: run_agent(e, s, c, cfg_s, sampling) for e, s, c in zip(engines, searchers, chunks)])
            agent = merged_agent_stats([stats for stats, _ in outs], sizes, wall_s)
            turns_K = [turns for _, turns in outs]
            n_tokens_K = [[sum(t for t, _ in turns) for turns in turns_B] for turns_B in turns_K]
            obs_K = [[[i for _, obs in turns for i in obs] for turns in turns_B] for turns_B in turns_K]
            baselines = {
                "plain": lambda e, c, i: plain_vllm(e, c, n_tokens_K[i], sampling),
                "plain_with_obs": lambda e, c, i: plain_vllm(e, [p + o for p, o in zip(c, obs_K[i])], n_tokens_K[i],
                                                             sampling),
                "replay": lambda e, c, i: replay_vllm(e, c, turns_K[i], sampling, admit)}
            done: dict[str, list] = {mode: [] for mode in baselines}
            for _ in range(baseline_repeats):  # interleaved, as in `measure`
                for mode, baseline in baselines.items():
                    for engine in engines:
                        cold_prefix_cache(engine)
                    wall, outs_ = in_parallel([lambda e=e, c=c, i=i: baseline(e, c, i)
                                               for i, (e, c) in enumerate(zip(engines, chunks))])
                    done[mode].append((wall, {"per_engine": [stats for _, stats in outs_]}))
            walls = {mode: median_run(runs) for mode, runs in done.items()}
            emit({**run, "mode": "agent", **agent,
                  "ratio_to_plain": round(walls["plain"][0] / wall_s, 3),
                  "ratio_to_plain_with_obs": round(walls["plain_with_obs"][0] / wall_s, 3),
                  "ratio_to_replay": round(walls["replay"][0] / wall_s, 3)})
            for mode, median in walls.items():
                emit(baseline_row(run, mode, median, agent["model_tokens"], agent["prompt_tokens"]
                                  + (agent["observation_tokens"] if mode == "plain_with_obs" else 0)))


# -- report ----------------------------------------------------------------------------------------
def print_table(rows: list[dict]) -> None:
    def key(r):
        return r["engine"], r["trajectories"], r["schedule"], r.get("admit_every_steps")

    plain = {key(r): r for r in rows if r["mode"] == "plain"}
    head = (f"{'engine':6} {'traj':>5} {'sched':10} {'agent tok/s':>11} {'plain tok/s':>11} {'ratio':>6} "
            f"{'r/+obs':>6} {'r/rep':>6} {'hf/vllm':>7} {'wall s':>7} {'turns':>5} {'tok/turn':>8} {'valid/inv':>10} {'retr s':>6} "
            f"{'prompt+obs tok':>15}  finish")
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        if r["mode"] != "agent":
            continue
        p = plain[key(r)]
        sched = r["schedule"] + (f"/{r['admit_every_steps']}" if r.get("admit_every_steps") else "")
        hf = f"{r['hf_over_vllm']:.2f}" if "hf_over_vllm" in r else "-"
        rep = f"{r['ratio_to_replay']:.2f}" if "ratio_to_replay" in r else "-"
        finish = " ".join(f"{k}:{v}" for k, v in sorted(r["finish"].items()))
        print(f"{r['engine']:6} {r['trajectories']:>5} {sched:10} {r['tokens_per_s']:>11,.0f} "
              f"{p['tokens_per_s']:>11,.0f} {r['ratio_to_plain']:>6.2f} {r['ratio_to_plain_with_obs']:>6.2f} {rep:>6} "
              f"{hf:>7} {r['wall_s']:>7.1f} "
              f"{r['turns_per_trajectory']:>5.2f} {r['model_tokens_per_turn']:>8.0f} "
              f"{r['searches_valid']:>4}/{r['invalid_actions']:<5} {r['retrieval_busy_s']:>6.1f} "
              f"{r['prompt_tokens']:>7}+{r['observation_tokens']:<7}  {finish}")


def main(argv=None):
    a = parse_args(argv)
    gpu = torch.cuda.is_available() and not a.quick
    mean_turn = a.response_tokens / (a.max_turns + 1)
    if mean_turn <= 2:
        raise SystemExit(f"--response-tokens {a.response_tokens} over {a.max_turns + 1} turns is ≤ 2 tokens a "
                         "turn: raise --response-tokens")
    if a.request_seeds and not gpu:
        raise SystemExit("--request-seeds needs a GPU: vLLM on CPU cannot seed a request")
    cap = a.max_tokens_per_turn or round(4 * mean_turn)
    vllm_n = [int(x) for x in a.trajectories.split(",")] if a.engine != "hf" else []
    hf_n = [int(x) for x in a.hf_trajectories.split(",")] if a.engine != "vllm" else []
    if a.engine == "both":  # the HF rows are compared with vLLM at the same concurrency
        vllm_n = sorted(set(vllm_n) | set(hf_n))
    schedules = a.schedules.split(",")
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)

    from search_r1.agent.loop import AgentConfig, HTTPSearcher, response_budget
    from search_r1.retrieval.client import RetrieverConfig
    from verl.workers.rollout.engine import SamplingConfig
    from verl.workers.rollout.hf_engine import HFEngine
    from verl.workers.rollout.vllm_engine import VLLMEngine

    model, tok = build_model(a, work)
    prompts_all = make_prompts(tok, max(vllm_n + hf_n))
    tag_ids = [tok.convert_tokens_to_ids(tag) for tag in TAGS]
    logit_bias = None if a.tag_bias is None else {t: a.tag_bias for t in tag_ids}
    # Room for every turn's cap and observation: the per-turn cap, not the total, limits a turn.
    cfg = AgentConfig(max_turns=a.max_turns, max_obs_length=a.max_obs_length, topk=a.topk, timeout_s=3600,
                      max_response_tokens=response_budget(a.max_turns, cap, a.max_obs_length))
    max_model_len = max(map(len, prompts_all)) + cfg.max_response_tokens + 8
    common = {"bench": "rollout", "device": torch.cuda.get_device_name() if gpu else "cpu", "shape": a.shape,
              "vocab": len(tok), "max_turns": a.max_turns, "mean_turn_target": round(mean_turn, 1),
              "max_tokens_per_turn": cap, "max_obs_length": a.max_obs_length, "topk": a.topk,
              "cudagraph_mode": a.cudagraph_mode or "default",
              "max_cudagraph_capture_size": a.max_cudagraph_capture_size or "default",
              "retrieval_devices": a.retrieval_devices or "default", "engine_core": a.engine_core,
              "core_stats": a.core_stats, "request_seeds": a.request_seeds,
              **({"torch_profile": True} if a.torch_profile else {}),
              **({"gpu_memory_utilization_each": round(a.gpu_memory_utilization / a.engines, 3)}
                 if a.engines > 1 and gpu else {}),
              **({"vllm_args": dict(a.vllm_arg)} if a.vllm_arg else {})}
    log.info("model %s; mean turn %.0f tokens, cap %d; vLLM at %s, HF at %s", model, mean_turn, cap, vllm_n, hf_n)

    rows: list[dict] = []

    def emit(row: dict) -> None:
        if row["engine"] == "hf":  # vLLM ran first, at the same concurrency where --engine both
            ref = next((r for r in rows if r["engine"] == "vllm" and all(
                r[k] == row[k] for k in ("trajectories", "schedule", "mode"))), None)
            if ref:
                row["hf_over_vllm"] = round(row["tokens_per_s"] / ref["tokens_per_s"], 3)
        rows.append(row)
        emit_row(row, a.out)

    server = None if a.retriever_url else start_retrieval_server(a, work, gpu)
    t_start = time.perf_counter()
    try:
        url = a.retriever_url or f"{server.url}/retrieve"
        searcher = TimedSearcher(HTTPSearcher(RetrieverConfig(url=url, topk=a.topk)))
        searcher.search(["warm up"], a.topk)
        asyncio.run(searcher.asearch(["warm up"], a.topk))
        # vLLM first: it takes its share of GPU memory at start, and HF uses what is left.
        for name, concurrencies in (("vllm", vllm_n), ("hf", hf_n)):
            if not concurrencies:
                continue
            if name == "vllm":
                kw = vllm_engine_kwargs(a, gpu)
                engine = VLLMEngine(model, seed=a.seed, max_model_len=max_model_len,
                                    separate_core=a.engine_core == "separate", **kw)
                common["engine_core_client"] = type(engine.llm.llm_engine.engine_core).__name__  # InprocClient or not
                plain = plain_vllm
            else:
                engine = HFEngine(model, device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                                  seed=a.seed, batch_size=max(hf_n))
                plain = plain_hf
            engine.generate(prompts_all[:8], SamplingConfig(max_tokens=8), [])  # warm-up
            if logit_bias is None:  # with the first engine; both share the weights
                logit_bias = calibrate_tag_bias(engine, prompts_all[:64], tag_ids, mean_turn)
            common["tag_bias"] = {tag: round(logit_bias[t], 3) for tag, t in zip(TAGS, tag_ids)}
            log.info("tag logit bias %s", common["tag_bias"])
            sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=cap, logit_bias=logit_bias,
                                      seed=a.seed if a.request_seeds else None)
            if name == "vllm" and a.engines > 1:
                engines = [engine] + [VLLMEngine(model, seed=a.seed + i, max_model_len=max_model_len,
                                                 separate_core=True, **kw) for i in range(1, a.engines)]
                for other in engines[1:]:
                    other.generate(prompts_all[:8], SamplingConfig(max_tokens=8), [])  # warm-up
                searchers = [searcher] + [TimedSearcher(HTTPSearcher(searcher.inner.cfg)) for _ in engines[1:]]
                measure_split(engines, searchers, prompts_all, concurrencies, cfg, sampling, common, emit,
                              tuple(int(k) for k in a.admit_every_steps.split(",")), a.baseline_repeats)
                continue
            measure(name, engine, plain, searcher, prompts_all, concurrencies, schedules, cfg, sampling, common, emit,
                    a.profile, tuple(int(k) for k in a.admit_every_steps.split(",")), a.baseline_repeats, a.timeline,
                    a.torch_profile if name == "vllm" else None)
    finally:
        if server is not None:
            server.stop()
    print_table(rows)
    print(f"measured in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
