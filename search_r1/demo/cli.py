"""`python -m search_r1.demo`: the command line, the preset it selects, and `main`, which runs the
seven stages in order and stops the retrieval server whatever happens."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

from search_r1.data.templates import TEMPLATES
from search_r1.demo.presets import (GPU_PRESETS, MAX_OBS, PRESETS, TEST_QUESTIONS, Preset, grpo_overrides, sft_steps,
                                    write_tool_config)
from search_r1.demo.progress import Progress, StepWatch, say
from search_r1.demo.results import next_steps, print_curve, summary
from search_r1.demo.stages import build_index, evaluate, final_samples, learning_curve, run, start_server, stop


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def parse_args(argv=None) -> tuple[argparse.Namespace, Preset]:
    """The command line and the preset it selects, with the size flags applied."""
    # named: run with -m, a package's argv[0] is its __main__.py, which says nothing to a user
    p = argparse.ArgumentParser(prog="python -m search_r1.demo",
                                description=sys.modules[__package__].__doc__.splitlines()[0])
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
                 "--batch-size", size.sft_batch,
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
