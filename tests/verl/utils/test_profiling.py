"""StepProfiler on the CPU: what it records is written as a gzipped Chrome trace and a table; how a
worker call's wall time is split from a trace's GPU intervals; and what a rollout engine's own trace
(another process, another time base) adds for each rollout call."""
import gzip
import json

import pytest
import torch

from verl.utils.profiling import (StepProfiler, engine_table, engine_time_by_rollout, gpu_time_by_phase, phase,
                                  phase_table)


def test_a_profiled_stretch_is_written_as_trace_and_table(tmp_path):
    p = StepProfiler()
    p.start()
    with pytest.raises(RuntimeError, match="already recording"):
        p.start()
    a = torch.randn(64, 64)
    for _ in range(3):
        a = torch.mm(a, a).tanh()
    trace, table = p.stop(str(tmp_path / "profile" / "step2_policy0"))
    assert trace.endswith("step2_policy0.json.gz") and table.endswith("step2_policy0.txt")
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    assert sum(e.get("name") == "aten::mm" for e in events) == 3
    assert "aten::mm" in open(table).read()
    assert not (tmp_path / "profile" / "step2_policy0.json").exists()  # only the gzipped copy stays
    with pytest.raises(RuntimeError, match="not started"):
        p.stop(str(tmp_path / "again"))


def test_a_phase_range_is_recorded_under_the_methods_name(tmp_path):
    @phase
    def update_actor(x):
        return torch.mm(x, x)

    p = StepProfiler()
    p.start()
    update_actor(torch.randn(8, 8))
    trace, _ = p.stop(str(tmp_path / "s"))
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    assert [e["cat"] for e in events if e.get("name") == "worker.update_actor"] == ["user_annotation"]
    assert update_actor.__name__ == "update_actor"


def test_gpu_time_by_phase_splits_wall_time_into_compute_communication_and_idle():
    us = 1e6
    events = [
        {"cat": "user_annotation", "name": "worker.update_actor", "ts": 0, "dur": 100 * us},
        {"cat": "user_annotation", "name": "something_else", "ts": 0, "dur": 100 * us},   # not a phase
        {"cat": "kernel", "name": "gemm", "ts": 10 * us, "dur": 30 * us},
        {"cat": "kernel", "name": "tanh", "ts": 30 * us, "dur": 30 * us},     # overlaps the gemm: 10-60 compute
        {"cat": "kernel", "name": "ncclDevKernel_ReduceScatter", "ts": 50 * us, "dur": 30 * us},  # alone 60-80
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 90 * us, "dur": 20 * us},  # clipped at 100: 10
        {"cat": "kernel", "name": "gemm", "ts": 150 * us, "dur": 10 * us},    # after the phase
    ]
    [row] = gpu_time_by_phase(events)
    assert row == {"phase": "update_actor", "wall_s": 100, "compute_s": 60, "comm_alone_s": 20, "idle_s": 20}
    assert "update_actor" in phase_table([row]).splitlines()[1]


def test_engine_time_by_rollout_sums_up_the_engine_cores_trace_in_each_rollout_call():
    us = 1e6
    worker = [
        {"cat": "user_annotation", "name": "worker.generate", "ts": 100 * us, "dur": 10 * us},
        {"cat": "user_annotation", "name": "worker.update_actor", "ts": 120 * us, "dur": 10 * us},
        {"cat": "gpu_user_annotation", "name": "worker.generate", "ts": 100 * us, "dur": 10 * us},  # GPU copy
    ]
    shift = 100 * us   # the engine's clock starts 100 s later: its 0 is the worker's 100

    def step(ts, dur, prefill, decode):
        return {"cat": "user_annotation", "ts": ts * us, "dur": dur * us,
                "name": f"execute_context_1({prefill})_generation_3({decode})"}

    engine = [
        step(-1, 0.5, 0, 4),                    # before the call: not counted
        step(1, 1, 100, 0), step(2, 1, 0, 3), step(2.5, 1, 0, 5),   # in steps 1-3.5: 2.5 s
        step(9.5, 2, 0, 8),                     # starts inside, clipped at the call's end: 0.5 s
        {"cat": "user_annotation", "name": "gpu_model_runner: forward", "ts": 4 * us, "dur": 1 * us},  # a part
        {"cat": "user_annotation", "name": "gpu_model_runner: sample", "ts": 5 * us, "dur": 1 * us},
        {"cat": "user_annotation", "name": "gpu_model_runner: sample", "ts": 9.5 * us, "dur": 1 * us},  # clipped
        {"cat": "user_annotation", "name": "gpu_model_runner: sample", "ts": 30 * us, "dur": 1 * us},  # later
        {"cat": "kernel", "name": "gemm", "ts": 1 * us, "dur": 2 * us},
        {"cat": "kernel", "name": "attn", "ts": 2 * us, "dur": 2 * us},   # overlaps: busy 1-4
        {"cat": "kernel", "name": "gemm", "ts": 9 * us, "dur": 3 * us},   # clipped: 9-10
        {"cat": "kernel", "name": "gemm", "ts": 30 * us, "dur": 1 * us},  # during the update: not the rollout's
    ]
    [row] = engine_time_by_rollout(worker, engine, shift)
    assert row == {"phase": "generate", "wall_s": 10, "gpu_busy_s": 4, "model_steps": 4,
                   "tokens_per_step": (100 + 3 + 5 + 8) / 4, "in_steps_s": 3,
                   "parts_s": {"gpu_model_runner: sample": 1.5, "gpu_model_runner: forward": 1}}
    table = engine_table([row]).splitlines()
    assert table[1].split() == ["generate", "10.000", "4.000", "4", "29.0", "3.000"]
    assert table[2] == ("  call 1, vLLM's named parts (CPU s): gpu_model_runner: sample 1.500, "
                        "gpu_model_runner: forward 1.000")
