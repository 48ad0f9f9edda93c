"""The learning benchmark's own parts: variant specs, key merging and the summary of a run's
metrics, on hand-made inputs (the runs themselves need a GPU; RESULTS.md has them)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_learning import Variant, eval_cmd, merged, signal_stats, table, train_keys  # noqa: E402


def test_a_variant_spec_splits_into_runner_words_and_trainer_keys():
    v = Variant.parse("rl start=base template=example eval=search,rag retriever.topk=1 reward.search_cost=0.1")
    assert (v.name, v.start, v.template, v.evals, v.topk) == ("rl", "base", "example", ["search", "rag"], 1)
    assert v.overrides == {"retriever.topk": "1", "reward.search_cost": "0.1"}
    assert Variant.parse("curve-only eval=none").evals == []
    assert Variant.parse("one-hop types=city_country,city_timezone").types == "city_country,city_timezone"
    assert Variant.parse("plain").start == "sft" and Variant.parse("plain").topk == 3
    with pytest.raises(SystemExit, match="start=scratch"):
        Variant.parse("x start=scratch")
    with pytest.raises(SystemExit, match="not key=value"):
        Variant.parse("x topk")


def test_the_variants_keys_replace_the_presets_once():
    keys = merged(["a=1", "b=x=y", "c=3"], {"a": "2", "d": "4"})
    assert keys == ["a=2", "b=x=y", "c=3", "d=4"]   # Hydra refuses a key given twice


def test_runs_sharing_a_gpu_get_a_fixed_kv_cache_fixed_token_budgets_and_an_engine_that_never_sleeps():
    from hydra import compose, initialize_config_dir
    from verl.config.load import load_config
    from verl.trainer.main_ppo import accept_plus_on_existing_keys   # the original's keys, as main_ppo reads them
    data = {"train": Path("train.parquet"), "test": Path("test.parquet")}
    v = Variant.parse("top1 retriever.topk=1")
    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base=None):
        for shared in (False, True):
            keys = train_keys(v, Path("model"), data, "http://127.0.0.1:1/retrieve", Path("run"), 1.0, 0.12,
                              shared=shared, kv_gib=2)
            config = load_config(compose("ppo_trainer", overrides=accept_plus_on_existing_keys(keys))).actor_rollout_ref
            rollout = config.rollout
            assert config.actor.ppo_max_token_len_per_gpu == (8192 if shared else None)
            assert config.ref.log_prob_max_token_len_per_gpu == rollout.log_prob_max_token_len_per_gpu == (
                16384 if shared else None)
            assert rollout.gpu_memory_utilization == 0.12 and "retriever.topk=1" in keys
            assert rollout.enable_sleep is not shared
            assert rollout.engine_kwargs == ({"kv_cache_memory_bytes": 2 << 30} if shared else None)


def test_an_evaluation_on_a_shared_gpu_asks_for_the_same_fixed_kv_cache():
    from search_r1.cli import build_parser
    for kv_gib in (None, 2.0):
        cmd = eval_cmd(Path("m"), Path("t.parquet"), "http://127.0.0.1:1/retrieve", Path("o"), "search", 3, 0.12,
                       None, kv_gib)
        args = build_parser().parse_args([str(c) for c in cmd[3:]])
        assert args.kv_cache_gib == kv_gib and args.gpu_memory_utilization == 0.12 and args.max_turns == 3
    cmd = eval_cmd(Path("m"), Path("t.parquet"), "http://127.0.0.1:1/retrieve", Path("o"), "search", 3, 0.12,
                   None, None, max_turns=4)   # a variant trained with max_turns=4 is evaluated with 4
    assert build_parser().parse_args([str(c) for c in cmd[3:]]).max_turns == 4


def test_a_turn_prefix_reaches_the_agent_in_training_and_the_final_evaluation_alike():
    from hydra import compose, initialize_config_dir
    from search_r1.cli import build_parser
    from verl.config.load import load_config
    from verl.trainer.main_ppo import accept_plus_on_existing_keys
    v = Variant.parse("rl start=base turn_prefix=<think> +reward.reward_kwargs.format_score=0.2 "
                      "reward.format_needs_search=true")   # the new name and the old one (search_r1.compat)
    data = {"train": Path("train.parquet"), "test": Path("test.parquet")}
    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base=None):
        keys = train_keys(v, Path("model"), data, "http://127.0.0.1:1/retrieve", Path("run"), 1.0, 0.12,
                          shared=False, kv_gib=2)
        cfg = load_config(compose("ppo_trainer", overrides=accept_plus_on_existing_keys(keys)))
    assert cfg.actor_rollout_ref.rollout.agent_kwargs["turn_prefix"] == "<think>"
    assert cfg.reward.reward_kwargs == {"format_score": 0.2, "format_needs_search": True}
    for mode, expected in (("search", "<think>"), ("rag", "")):
        cmd = eval_cmd(Path("m"), Path("t.parquet"), "http://127.0.0.1:1/retrieve", Path("o"), mode, 3, 0.12,
                       None, turn_prefix=v.turn_prefix)
        assert build_parser().parse_args([str(c) for c in cmd[3:]]).turn_prefix == expected


def test_the_signal_summary_counts_missing_finish_reasons_as_zero():
    rows = [{"step": 0, "val/reward/em": 0.0},
            {"step": 1, "reward/mean": 0.0, "reward/flat_groups": 1.0, "agent/searches": 0.0},
            {"step": 2, "reward/mean": 0.2, "reward/flat_groups": 0.5, "agent/searches": 1.0,
             "agent/finish_answer": 0.5}]
    assert signal_stats(rows) == {"flat_groups": 0.75, "answer_rate": 0.25, "searches": 0.5, "reward": 0.1}


def test_the_table_has_a_row_per_variant_and_says_why_one_has_no_em():
    done = {"variant": "a", "start": "sft", "steps": 3, "minutes": 1.0, "status": "done",
            "curve": [{"step": 0, "val_em": 0.4, "two_hop_searches": 1.7}, {"step": 3, "val_em": 0.5,
                                                                             "two_hop_searches": 1.0}],
            "signal_first_10": {"flat_groups": 0.5, "answer_rate": None, "searches": 1.0},
            "eval_search": {"em": 0.5, "se": 0.05, "searches": 1.2, "per_group": {"hops=1": {"em": 0.9, "searches": 1.0}}}}
    failed = {"variant": "b", "start": "base", "steps": 0, "minutes": 0.0, "status": "failed (train, exit 1)",
              "curve": [],
              "signal_first_10": {"flat_groups": None, "answer_rate": None, "searches": None}}
    lines = table([done, failed]).splitlines()
    assert len(lines) == 4
    assert lines[2] == ("| a | sft | 3 | 1.0 | 0.500 ± 0.050 | 1.20 | hops=1: 0.90 / 1.00 | 0.50, -, 1.00 "
                        "| 1.70 → 1.00 |")
    assert "failed (train, exit 1)" in lines[3]


def test_the_summary_keeps_the_two_hop_searches_of_each_validation(tmp_path):
    import json

    from bench_learning import summarize
    rows = [{"step": 0, "time": 0.0, "val/reward/em": 0.4, "val/searches_by_hops/2": 1.7},
            {"step": 1, "time": 30.0, "reward/mean": 0.2},
            {"step": 2, "time": 60.0, "reward/mean": 0.3, "val/reward/em": 0.5, "val/searches_by_hops/2": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = summarize(Variant.parse("plain eval=none"), tmp_path, "done")
    assert out["curve"] == [{"step": 0, "val_em": 0.4, "two_hop_searches": 1.7},
                            {"step": 2, "val_em": 0.5, "two_hop_searches": 1.0}]
    assert out["steps"] == 2 and out["minutes"] == 1.0


def test_a_run_that_ran_out_of_gpu_memory_is_told_from_other_failures(tmp_path):
    from bench_learning import ran_out_of_memory
    oom, other = tmp_path / "oom.log", tmp_path / "other.log"
    oom.write_text("x" * 60_000 + "\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    other.write_text("ValueError: data.train_files: no such file\n")
    assert ran_out_of_memory(oom) and not ran_out_of_memory(other)
    assert not ran_out_of_memory(tmp_path / "missing.log")


def test_a_run_out_of_memory_beside_others_waits_and_its_gpu_keeps_one_slot_fewer():
    from types import SimpleNamespace

    from bench_learning import MAX_RETRIES, slots_after_oom

    def job(gpu, oom=False, name="r"):   # the scheduler reads only these fields of a run
        return SimpleNamespace(gpu=gpu, out_of_memory=oom, v=SimpleNamespace(name=name))
    failed = job("0", oom=True)
    running = [job("0"), job("0"), job("1")]
    assert slots_after_oom(failed, ["1"], running, {}) == 2            # two runs still on GPU 0
    assert slots_after_oom(failed, ["0"], [job("1")], {}) == 1         # a free slot of GPU 0 counts
    assert slots_after_oom(failed, ["1"], [job("1")], {}) == 0         # alone on its GPU: the failure stands
    assert slots_after_oom(failed, [], running, {"r": MAX_RETRIES}) == 0
    assert slots_after_oom(job("0", oom=False), [], running, {}) == 0  # not a memory failure


@pytest.mark.e2e
def test_sigterm_ends_the_runs_and_the_server_and_still_writes_the_table(tmp_path):
    """A real run on the CPU (the bundled model, the BM25 server), stopped as `timeout` stops it."""
    import json
    import os
    import re
    import signal
    import socket
    import subprocess
    import time
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "abl"
    proc = subprocess.Popen([sys.executable, str(root / "benchmarks" / "bench_learning.py"), "--out", str(out),
                             "--variant", "x start=base eval=none"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)
    lines, deadline = [], time.time() + 300
    for line in proc.stdout:
        lines.append(line)
        if "x: started" in line or time.time() > deadline:
            break
    assert "x: started" in lines[-1], "".join(lines[-20:])
    time.sleep(5)                     # the trainer is up
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, rest[-3000:]
    assert "stopped (SIGTERM): 1 runs unfinished" in rest and "| x | base |" in rest
    rows = json.loads((out / "results.json").read_text())
    assert [(r["variant"], r["status"]) for r in rows] == [("x", "stopped (train)")]
    port = int(re.search(r"127\.0\.0\.1:(\d+)", (out / "logs" / "retrieval_server.log").read_text()).group(1))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    left = []                         # no process of the run (trainer, Ray, engine) outlives it
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(out) in cmdline:
            left.append(cmdline[:200])
    assert not left, left


def test_seeds_of_a_setting_give_its_mean_and_standard_error_and_the_same_seed_differences():
    from bench_learning import seed_table

    def run(name, em):
        return {"variant": name, "eval_search": {"em": em}} if em is not None else {"variant": name}
    results = [run("on-s1", 0.9), run("off-s1", 0.4), run("on-s2", 0.6), run("off-s2", 0.4),
               run("on-s3", 0.6), run("off-s3", 0.7), run("off-s4", None), run("other", 0.5)]
    lines = seed_table(results).splitlines()
    assert lines[0] == "| setting | seeds | final EM, mean ± s.e. | same seed, minus on |"
    assert lines[2] == "| on | 1, 2, 3 | 0.700 ± 0.100 | – |"
    # off: 0.4, 0.4, 0.7 → 0.5 ± 0.1; differences −0.5, −0.2, +0.1 → −0.2 ± 0.173
    assert lines[3] == "| off | 1, 2, 3 | 0.500 ± 0.100 | -0.200 ± 0.173 (-0.500, -0.200, +0.100) |"
    assert len(lines) == 4                      # "other" has no seeds; off-s4 has no EM
    assert seed_table([run("a-s1", 0.5), run("b", 0.4)]) == ""
