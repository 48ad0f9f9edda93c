"""Learning experiments on the bundled task: several GRPO (or PPO) runs side by side, one table.

    python benchmarks/bench_learning.py --out DIR --slots 0,0,1,1 --minutes 6 \\
        --variant "sft-grpo" \\
        --variant "rl-example start=base template=example +reward.reward_kwargs.format_score=0.2 \\
                   +reward.reward_kwargs.final_format_score=0.1" \\
        --variant "no-masking actor_rollout_ref.actor.state_masking=false"

Each variant is the demo's `gpu` preset (SmolLM2-135M-Instruct, 32 prompts × 5 samples per step, lr
1e-5, validation every 10 steps on the first 100 test questions) changed by its own words:
- `start=sft` (default): from the demo's SFT warm start, made once and shared by every such variant;
  `start=base`: from the bundled instruct model itself (reinforcement learning alone);
- `template=NAME`: the prompt template of its training and test rows (search_r1.data.templates);
- `types=T1,T2`: only these bundled question types in its training rows (e.g. the one-hop ones, the
  first stage of a curriculum); validation and evaluation keep every type;
- `eval=search,rag,no-search`: the modes its final model is evaluated in (default: search; none: no
  evaluation, the validation curve only);
- `eval_topk=K`: passages per search in its final evaluation (default: retriever.topk of the variant, or 3);
- `turn_prefix=TEXT`: the search agent writes TEXT after each observation, in training
  (`actor_rollout_ref.rollout.agent_kwargs`) and in its final evaluation (`--turn-prefix`) alike;
- any other `key=value` is a trainer key, set over the preset's.
All variants share one BM25 server over the bundled corpus and the same seeds. `--slots` lists the GPU
of every run that may go at once (`0,0,1,1`: two runs on each of GPUs 0 and 1); variants wait for a
free slot, in the order given. Runs that share a GPU keep their engine awake while they train
(`rollout.enable_sleep=false`: vLLM's sleep fails when another process allocates on the GPU
meanwhile) and get a KV cache of fixed size (`--kv-gib`: sized from free memory, it came out empty
for runs starting together), their evaluations too, and fixed token budgets for their updates and
log-prob passes; they slow each other down: compare variants at equal steps, not equal minutes. A
run that runs out of GPU memory beside others starts over once a neighbour has finished, and its GPU
takes one run fewer from then on (twice at most a run).
SIGTERM (e.g. from `timeout`) or Ctrl-C ends every run with its processes and still writes the table,
results.json and compare.html from what the runs wrote.
After training, each final model is evaluated greedily on every test question, with EM per
question type and hop count.

Writes DIR/<variant>/ (the run: metrics.jsonl, samples, eval_*), DIR/results.json, DIR/compare.html
(`search-r1 report` over the runs: their curves side by side) and prints a
Markdown table: steps, minutes, final EM ± s.e., EM and searches per question by hops and type, and,
from the first 10 steps, what the reward signal looked like (share of groups with all-equal rewards,
answer rate, searches per trajectory), and the searches per two-hop question at the first and last
validation. Variants named SETTING-s1, SETTING-s2, … (e.g. `trainer.seed=2 data.seed=2` each) are seeds
of one setting: a second table gives each setting's final EM as mean ± standard error over its seeds
and the same-seed difference from the first setting.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from search_r1.compat import trainer_env  # noqa: E402
from search_r1.demo import MAX_OBS, MAX_TURNS, PRESETS, build_index, grpo_overrides, start_server  # noqa: E402

SHARED_UPDATE_TOKENS = 8192   # tokens per update micro-batch of a run that shares its GPU
MAX_RETRIES = 2   # times a run that ran out of GPU memory beside other runs is started again


@dataclass
class Variant:
    name: str
    start: str = "sft"
    template: str = "instruct"
    types: str = ""               # bundled question types of the training rows, comma-separated; "": all
    evals: list[str] = field(default_factory=lambda: ["search"])
    eval_topk: int | None = None
    turn_prefix: str = ""
    overrides: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        name, *words = spec.split()
        v = cls(name)
        for word in words:
            key, sep, value = word.partition("=")
            if not sep:
                raise SystemExit(f"variant {name}: {word!r} is not key=value")
            if key == "start":
                if value not in ("sft", "base"):
                    raise SystemExit(f"variant {name}: start={value}: use sft or base")
                v.start = value
            elif key == "template":
                v.template = value
            elif key == "types":
                v.types = value
            elif key == "eval":
                v.evals = [] if value == "none" else value.split(",")
            elif key == "eval_topk":
                v.eval_topk = int(value)
            elif key == "turn_prefix":
                v.turn_prefix = value
            else:
                v.overrides[key] = value
        return v

    @property
    def topk(self) -> int:
        return self.eval_topk or int(self.overrides.get("retriever.topk", 3))


def merged(base: list[str], overrides: dict[str, str]) -> list[str]:
    """Hydra refuses a key given twice: the variant's values replace the preset's."""
    keys = dict(item.split("=", 1) for item in base)
    keys.update(overrides)
    return [f"{k}={v}" for k, v in keys.items()]


def run_logged(cmd: list, log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start cmd in a session of its own (`stop_all` ends it with every process it started), output to log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "w")
    out.write("$ " + " ".join(map(str, cmd)) + "\n")
    out.flush()
    return subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def ran_out_of_memory(log: Path) -> bool:
    """Whether a failed run's log ends on the GPU running out of memory."""
    if not log.exists():
        return False
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - 50_000))
        tail = f.read().decode(errors="replace")
    return "CUDA out of memory" in tail or "OutOfMemoryError" in tail


def slots_after_oom(job: "Job", free: list[str], running: list["Job"], retries: dict[str, int]) -> int:
    """A run that ran out of GPU memory beside other runs starts over when a neighbour has finished, and its
    GPU keeps one slot fewer: the slots it keeps, or 0 where the failure stands (alone on its GPU, or
    MAX_RETRIES tries already)."""
    left = free.count(job.gpu) + sum(j.gpu == job.gpu for j in running)
    return left if job.out_of_memory and retries.get(job.v.name, 0) < MAX_RETRIES else 0


def stop_all(procs: list[subprocess.Popen]):
    """End each process's session (the run's Ray and vLLM processes with it): SIGTERM to all, then SIGKILL."""
    def signal_group(proc, sig):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    for proc in procs:
        signal_group(proc, signal.SIGTERM)
    deadline = time.time() + 15
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()


class Stopped(Exception):
    """SIGTERM (e.g. from `timeout`): end the runs, then write what there is."""


def raise_stopped(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def gpu_env(gpu: str) -> dict:
    return trainer_env() | {"CUDA_VISIBLE_DEVICES": gpu}   # the demo's keys include the original's (max_turns)


def prepare_data(out: Path, template: str, types: str) -> dict[str, Path]:
    """Training rows of `types` (all when empty) and every test row, in `template`."""
    tag = f"{template}_{types.replace(',', '+')}" if types else template
    paths = {"train": out / "data" / f"{tag}_train.parquet", "test": out / "data" / f"{template}_test.parquet"}
    for split, path in paths.items():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            only = ["--bundled-types", types] if split == "train" and types else []
            subprocess.run([sys.executable, "-m", "search_r1.data.preprocess", "--bundled", "--split", split,
                            "--template", template, *only, "--out", str(path)], check=True, capture_output=True)
    return paths


def eval_cmd(model: Path, data: Path, url: str, out: Path, mode: str, topk: int, memory: float,
             limit: int | None, kv_gib: float | None = None, max_turns: int = MAX_TURNS, turn_prefix: str = "") -> list:
    return [sys.executable, "-m", "search_r1.cli", "eval", "--model", model, "--data", data,
            *(["--limit", limit] if limit else []),
            "--retriever-url", url, "--mode", mode, "--out", out, "--topk", topk, "--max-turns", max_turns,
            "--max-response-length", PRESETS["gpu"].response_length, "--max-obs-length", MAX_OBS,
            "--gpu-memory-utilization", memory, "--enforce-eager",
            *(["--kv-cache-gib", kv_gib] if kv_gib else []),
            *(["--turn-prefix", turn_prefix] if turn_prefix and mode == "search" else [])]


def train_keys(v: Variant, model: Path, data: dict, url: str, run_dir: Path, minutes: float, memory: float,
               shared: bool, kv_gib: float) -> list[str]:
    """The trainer keys of one variant's run: the demo's `gpu` preset, then the variant's own."""
    preset = replace(PRESETS["gpu"], grpo_minutes=minutes, turn_prefix=v.turn_prefix)
    keys = grpo_overrides(preset, data["train"], data["test"], model, url, run_dir)
    keys += [f"actor_rollout_ref.rollout.gpu_memory_utilization={memory}",
             f"trainer.experiment_name={v.name}"]
    if shared:
        # vLLM measures the device's free memory, which the other runs on the GPU move meanwhile:
        # sized from it, the KV cache came out as nothing for runs starting together; a sleeping
        # engine failed its check that memory was freed. So: a fixed KV cache, never asleep.
        keys += ["actor_rollout_ref.rollout.enable_sleep=false",
                 f"actor_rollout_ref.rollout.engine_kwargs={{kv_cache_memory_bytes:{int(kv_gib * 2**30)}}}"]
        # Token budgets measured at start-up would take the neighbours' free memory for this run's own:
        # fixed ones instead, a few GiB of activations for this model size
        keys += [f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={SHARED_UPDATE_TOKENS}",
                 f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={2 * SHARED_UPDATE_TOKENS}",
                 f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={2 * SHARED_UPDATE_TOKENS}"]
    return merged(keys, v.overrides)


class Job:
    """One variant: train, then evaluate its final model, each a process on the slot's GPU."""

    def __init__(self, v: Variant, gpu: str, out: Path, model: Path, data: dict, url: str, minutes: float,
                 memory: float, eval_limit: int | None, shared: bool, kv_gib: float):
        self.v, self.gpu, self.dir, self.url, self.memory = v, gpu, out / v.name, url, memory
        self.eval_limit = eval_limit
        self.data = data
        self.eval_kv_gib = kv_gib if shared else None   # evaluations share the GPU as training did
        keys = train_keys(v, model, data, url, self.dir, minutes, memory, shared, kv_gib)
        self.proc = run_logged([sys.executable, "-m", "verl.trainer.main_ppo", *keys],
                               self.dir / "train.log", gpu_env(gpu))
        self.evals = list(v.evals)
        self.phase = "train"
        self.out_of_memory = False

    def poll(self) -> bool:
        """Advance; True when the job is finished (or failed)."""
        code = self.proc.poll()
        if code is None:
            return False
        if code != 0:
            self.out_of_memory = self.phase == "train" and ran_out_of_memory(self.dir / "train.log")
            self.phase = f"failed ({self.phase}, exit {code}; see {self.dir})"
            return True
        if not self.evals:
            self.phase = "done"
            return True
        mode = self.evals.pop(0)
        self.phase = f"eval {mode}"
        cmd = eval_cmd(self.dir / "hf_actor", self.data["test"], self.url, self.dir / "eval", mode, self.v.topk,
                       self.memory, self.eval_limit, self.eval_kv_gib,
                       int(self.v.overrides.get("max_turns", MAX_TURNS)),   # searches as the run trained with
                       self.v.turn_prefix)
        self.proc = run_logged(cmd, self.dir / f"eval_{mode}.log", gpu_env(self.gpu))
        return False


def signal_stats(rows: list[dict], first: int = 10) -> dict:
    """What the reward signal looked like in the first steps."""
    early = [r for r in rows if "reward/mean" in r][:first]

    def mean(key, missing=None):   # a finish reason no trajectory had is not logged: it was 0
        vals = [r.get(key, missing) for r in early]
        vals = [v for v in vals if v is not None]
        return sum(vals) / len(vals) if vals else None
    searches = "agent/searches" if any("agent/searches" in r for r in early) else "agent/tool_calls"
    return {"flat_groups": mean("reward/flat_groups"), "answer_rate": mean("agent/finish_answer", 0.0),
            "searches": mean(searches), "reward": mean("reward/mean")}


TWO_HOP = "val/searches_by_hops/2"   # does the policy keep (or learn) the second search?


def summarize(v: Variant, run_dir: Path, phase: str) -> dict:
    from search_r1.report import read_metrics
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    steps = [r for r in rows if "reward/mean" in r]
    out = {"variant": v.name, "start": v.start, "template": v.template, "overrides": v.overrides, "status": phase,
           "steps": len(steps), "minutes": (steps[-1]["time"] - rows[0]["time"]) / 60 if steps else 0.0,
           "curve": [{"step": r["step"], "val_em": r["val/reward/em"],
                      **({"two_hop_searches": r[TWO_HOP]} if TWO_HOP in r else {})}
                     for r in rows if "val/reward/em" in r],
           "train_reward": [round(r["reward/mean"], 4) for r in steps],
           "signal_first_10": signal_stats(rows),
           "rollbacks": max((r.get("health/rollbacks", 0) for r in rows), default=0),
           "alarms": sum(r.get("health/alarms", 0) for r in rows)}
    for mode in v.evals:
        path = run_dir / "eval" / f"eval_{mode}.json"
        if path.exists():
            result = json.loads(path.read_text())
            em, n = float(result["macro"]["em"]), int(result["n"])
            out[f"eval_{mode}"] = {"em": em, "se": math.sqrt(em * (1 - em) / n) if n else None, "n": n,
                                   "searches": result["macro"].get("searches"),
                                   "per_group": result.get("per_group")}
    return out


def table(results: list[dict]) -> str:
    lines = ["| variant | start | steps | min | EM (all) ± s.e. | searches | by group: EM / searches | "
             "first 10 steps: flat groups, answer rate, searches | two-hop searches, validation: first → last |",
             "|---|---|---:|---:|---:|---:|---|---|---|"]
    for r in results:
        e = r.get("eval_search") or {}
        groups = "; ".join(f"{g}: {d.get('em', 0):.2f} / {d.get('searches', 0):.2f}"
                           for g, d in sorted((e.get("per_group") or {}).items()))
        s = r["signal_first_10"]
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        em = f"{e['em']:.3f} ± {e['se']:.3f}" if e else r["status"]
        two_hop = [c["two_hop_searches"] for c in r["curve"] if "two_hop_searches" in c]
        two_hop = f"{two_hop[0]:.2f} → {two_hop[-1]:.2f}" if two_hop else "-"
        lines.append(f"| {r['variant']} | {r['start']} | {r['steps']} | {r['minutes']:.1f} | {em} | "
                     f"{fmt(e.get('searches'))} | {groups} | {fmt(s['flat_groups'])}, {fmt(s['answer_rate'])}, "
                     f"{fmt(s['searches'])} | {two_hop} |")
    return "\n".join(lines)


def seed_table(results: list[dict]) -> str:
    """Variants named SETTING-sN are seeds of one setting: final EM (search mode) as mean ± standard
    error over its seeds, and the same-seed difference from the first setting. "" when no setting
    has two seeds with an EM."""
    from search_r1.report import mean_se, setting_and_seed

    settings: dict[str, dict[str, float]] = {}
    for r in results:
        setting, seed = setting_and_seed(r["variant"])
        if seed and r.get("eval_search"):
            settings.setdefault(setting, {})[seed] = r["eval_search"]["em"]
    if not any(len(ems) > 1 for ems in settings.values()):
        return ""
    first, base = next(iter(settings.items()))
    lines = [f"| setting | seeds | final EM, mean ± s.e. | same seed, minus {first} |", "|---|---|---:|---|"]
    for name, ems in settings.items():
        seeds = sorted(ems, key=int)
        diffs = [ems[s] - base[s] for s in seeds if s in base]
        versus = "–" if name == first or not diffs else \
            f"{mean_se(diffs)} ({', '.join(f'{d:+.3f}' for d in diffs)})"
        lines.append(f"| {name} | {', '.join(seeds)} | {mean_se([ems[s] for s in seeds])} | {versus} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variant", action="append", required=True, help="NAME [start=sft|base] [template=T] "
                   "[types=T1,T2] [eval=search,rag,no-search] [eval_topk=K] [trainer.key=value ...]")
    p.add_argument("--slots", default="0", help="the GPU of each run that may go at once, e.g. 0,0,1,1")
    p.add_argument("--minutes", type=float, default=10.0, help="GRPO minutes per variant (trainer.time_limit_minutes)")
    p.add_argument("--memory", type=float, default=0.3, help="vLLM's share of GPU memory per run")
    p.add_argument("--kv-gib", type=float, default=4.0,
                   help="runs sharing a GPU: each one's KV cache in GiB, fixed instead of sized from free memory")
    p.add_argument("--eval-limit", type=int, default=None,
                   help="test questions in the final evaluations (default: all)")
    a = p.parse_args(argv)
    variants = [Variant.parse(s) for s in a.variant]
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit("variant names must differ")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from search_r1.data.bundled import bundled_paths
    from search_r1.local_models import materialize_smollm2

    t0 = time.time()
    model = Path(materialize_smollm2(out / "smollm2"))
    retriever_args = build_index("bm25", Path(bundled_paths()["corpus"]), out, out / "logs" / "index.log")
    data = {(v.template, v.types): prepare_data(out, v.template, v.types) for v in variants}
    server, url = start_server(retriever_args, out / "logs" / "retrieval_server.log")
    slots = a.slots.split(",")
    free, running, done = list(slots), [], []
    sft_model, sft_proc = out / "sft_model", None
    pending = list(variants)
    order = {v.name: i for i, v in enumerate(variants)}
    retries: dict[str, int] = {}
    stopped = None
    signal.signal(signal.SIGTERM, raise_stopped)
    try:
        if any(v.start == "sft" for v in variants) and not (sft_model / "config.json").exists():
            gpu = free.pop(0)
            gpu_preset = PRESETS["gpu"]
            sft_proc = (gpu, run_logged([sys.executable, "-m", "search_r1.cli", "sft", "--model", model, "--out",
                                         sft_model, "--bundled", gpu_preset.sft_questions, "--retriever-url", url,
                                         "--epochs", gpu_preset.sft_epochs, "--micro-batch-size", 8,
                                         "--max-obs-length", MAX_OBS], out / "logs" / "sft.log", gpu_env(gpu)))
        while pending or running or sft_proc:
            if sft_proc and sft_proc[1].poll() is not None:
                if sft_proc[1].returncode:
                    raise SystemExit(f"SFT failed; see {out / 'logs' / 'sft.log'}")
                free.append(sft_proc[0])
                sft_proc = None
            for job in [j for j in running if j.poll()]:
                running.remove(job)
                stop_all([job.proc])   # what its trainer left behind (Ray, the engine) holds GPU memory
                left = slots_after_oom(job, free, running, retries)
                if left:
                    retries[job.v.name] = retries.get(job.v.name, 0) + 1
                    shutil.rmtree(job.dir)
                    pending = sorted(pending + [job.v], key=lambda v: order[v.name])
                    print(f"[{(time.time() - t0) / 60:5.1f} min] {job.v.name}: out of GPU memory beside other runs; "
                          f"GPU {job.gpu} now takes {left} at once, the run waits its turn", flush=True)
                    continue
                free.append(job.gpu)
                done.append(summarize(job.v, job.dir, job.phase))
                print(f"[{(time.time() - t0) / 60:5.1f} min] {job.v.name}: {job.phase}", flush=True)
                (out / "results.json").write_text(json.dumps(done, indent=1))
            for v in list(pending):
                if not free or (v.start == "sft" and sft_proc):
                    continue
                pending.remove(v)
                start_model = sft_model if v.start == "sft" else model
                gpu = free.pop(0)
                running.append(Job(v, gpu, out, start_model, data[(v.template, v.types)], url, a.minutes, a.memory,
                                   a.eval_limit, shared=slots.count(gpu) > 1, kv_gib=a.kv_gib))
                print(f"[{(time.time() - t0) / 60:5.1f} min] {v.name}: started", flush=True)
                time.sleep(5)   # engines start one after another on a shared GPU
            time.sleep(5)
    except (Stopped, KeyboardInterrupt) as e:
        stopped = str(e) or "interrupted"
        print(f"[{(time.time() - t0) / 60:5.1f} min] stopped ({stopped}): {len(running)} runs unfinished, "
              f"{len(pending)} not started; the table has what they wrote", flush=True)
        done += [summarize(j.v, j.dir, f"stopped ({j.phase})") for j in running]
        done += [summarize(v, out / v.name, "not started") for v in pending]
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second signal must not cut the clean-up short
        stop_all([j.proc for j in running] + ([sft_proc[1]] if sft_proc else []) + [server])
    done.sort(key=lambda r: order[r["variant"]])
    (out / "results.json").write_text(json.dumps(done, indent=1))
    from search_r1.report import write_comparison
    runs = [out / r["variant"] for r in done if (out / r["variant"] / "metrics.jsonl").exists()]
    if runs:
        print(f"curves side by side: {write_comparison(runs, out / 'compare.html')}")
    print(table(done), flush=True)
    if by_setting := seed_table(done):
        print("\n" + by_setting, flush=True)
    print(f"\n{'stopped' if stopped else 'all done'} after {(time.time() - t0) / 60:.1f} min", flush=True)
    return 1 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
