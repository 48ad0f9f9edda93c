"""What the demo prints at its end: the GRPO learning curve, EM after each stage, the last line, and
what to do next with the trained model."""
from __future__ import annotations

import math
from pathlib import Path

from search_r1.data.templates import RESPONSE_PREFIXES
from search_r1.demo.presets import Preset


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
