"""trace_steps.py on a hand-written trace in the torch profiler's format (Chrome trace events, as
vLLM's worker writes them with `detailed_trace_annotation`): kernels are assigned to the step whose
CPU call launched them, and the summary keeps only pure decode steps of the requested width."""
import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from trace_steps import kernel_kind, load_events, main, steps_of, summarize  # noqa: E402


def step_mark(ts, decode, kv, prefill=0, prefill_tokens=0):
    name = (f"execute_{decode + prefill_tokens}_context_{prefill}(sq{prefill_tokens}sk{prefill_tokens}sqsq0sqsk0)"
            f"_generation_{decode}(sq{decode}sk{kv}sqsq{decode}sqsk{kv})")
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": 3000}


def launch(ts, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 50,
            "args": {"correlation": correlation}}


def kernel(ts, dur, name, correlation):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


@pytest.fixture
def trace(tmp_path):
    events = [
        # step 0: 900 decodes; a graph with an attention and a GEMM kernel, then a sampling kernel.
        step_mark(0, 900, 450_000), launch(100, 1), launch(4000, 2),
        kernel(500, 6000, "void flash::FlashAttnFwdSm90<...>", 1), kernel(6600, 8000, "nvjet_sm90_tst_128x128", 1),
        kernel(14700, 300, "triton_poi_fused_sample", 2),
        # step 1: a prefill of 2 requests next to 898 decodes (kept out of the decode summary).
        step_mark(20000, 898, 451_000, prefill=2, prefill_tokens=600), launch(20100, 3),
        kernel(20200, 30000, "nvjet_sm90_tst_256x144", 3),
        # step 2: 500 decodes (below --min-batch 700).
        step_mark(55000, 500, 200_000), launch(55100, 4), kernel(55200, 4000, "nvjet_sm90_tst_128x128", 4),
        # a launch before the first step belongs to none
        launch(-10, 5), kernel(-5, 100, "nvjet_sm90_tst_128x128", 5),
        step_mark(70000, 500, 200_000),  # the last mark only closes step 2
    ]
    path = tmp_path / "replay.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_kernels_go_to_the_step_that_launched_them(trace):
    steps = steps_of(load_events(trace))
    assert len(steps) == 3
    first = steps[0]
    assert (first["decode_requests"], first["decode_kv"], first["prefill_requests"]) == (900, 450_000, 0)
    assert first["cpu_ms"] == 20.0 and first["kernel_ms"] == pytest.approx(14.3)
    assert first["attention_ms"] == 6.0 and first["gemm_ms"] == 8.0 and first["other_ms"] == pytest.approx(0.3)
    assert first["gpu_ms"] == pytest.approx(14.5)  # first kernel start to last kernel end
    assert steps[1]["prefill_requests"] == 2 and steps[1]["prefill_tokens"] == 600
    assert steps[2]["kernel_ms"] == 4.0  # the launch before the first mark was not counted anywhere


def test_summary_keeps_pure_decode_steps_of_the_requested_width(trace):
    row = summarize(steps_of(load_events(trace)), min_batch=700)
    assert (row["steps"], row["decode_steps"], row["prefill_steps"]) == (3, 1, 1)
    assert row["decode_requests"] == 900 and row["kernel_ms"] == pytest.approx(14.3)
    assert list(row["top_kernels_ms"])[0] == "nvjet_sm90_tst_128x128"


def test_kernel_kinds():
    assert kernel_kind("void cutlass::device_kernel<flash::FlashAttnFwdCombine<...>>") == "attention"
    assert kernel_kind("nvjet_sm90_tst_256x144_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert kernel_kind("triton_red_fused_fused_add_rms_norm_2") == "other"


def test_command_prints_and_appends_one_row_per_trace(trace, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    out.write_text('{"earlier": "run"}\n')  # --out appends: rows of earlier runs stay
    main([trace, "--min-batch", "700", "--top", "1", "--out", str(out)])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0] == {"earlier": "run"} and rows[1:] == printed
    (row,) = printed
    assert row["trace"] == "replay.pt.trace.json.gz" and row["min_batch"] == 700
    assert row["decode_steps"] == 1 and list(row["top_kernels_ms"]) == ["nvjet_sm90_tst_128x128"]
