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


def test_runs_sharing_a_gpu_get_a_fixed_kv_cache_and_an_engine_that_never_sleeps():
    from hydra import compose, initialize_config_dir
    from verl.trainer.config import load_config
    data = {"train": Path("train.parquet"), "test": Path("test.parquet")}
    v = Variant.parse("top1 retriever.topk=1")
    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base=None):
        for shared in (False, True):
            keys = train_keys(v, Path("model"), data, "http://127.0.0.1:1/retrieve", Path("run"), 1.0, 0.12,
                              shared=shared, kv_gib=2)
            rollout = load_config(compose("ppo_trainer", overrides=keys)).actor_rollout_ref.rollout
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
    from verl.trainer.config import load_config
    v = Variant.parse("rl start=base turn_prefix=<think> reward.format_score=0.2 reward.format_needs_search=true")
    data = {"train": Path("train.parquet"), "test": Path("test.parquet")}
    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base=None):
        keys = train_keys(v, Path("model"), data, "http://127.0.0.1:1/retrieve", Path("run"), 1.0, 0.12,
                          shared=False, kv_gib=2)
        cfg = load_config(compose("ppo_trainer", overrides=keys))
    assert cfg.actor_rollout_ref.rollout.agent_kwargs == {"turn_prefix": "<think>"}
    assert cfg.reward.kwargs() == {"format_score": 0.2, "format_needs_search": True}
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
