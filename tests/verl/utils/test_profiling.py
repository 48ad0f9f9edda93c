"""StepProfiler on the CPU: what it records is written as a gzipped Chrome trace and a table; and
how a worker call's wall time is split from a trace's GPU intervals."""
import gzip
import json

import pytest
import torch

from verl.utils.profiling import StepProfiler, gpu_time_by_phase, phase, phase_table


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
