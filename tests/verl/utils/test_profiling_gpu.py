"""StepProfiler on a GPU: the kernels a worker call launched are in the trace, and the table says
how the GPU spent the call."""
import gzip
import json

import pytest
import torch

from verl.utils.profiling import StepProfiler, gpu_time_by_phase, phase

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@phase
def update_actor(a):
    for _ in range(3):
        a = torch.mm(a, a).tanh()
    torch.cuda.synchronize()
    return a


def test_gpu_kernels_are_recorded_and_split_by_worker_call(tmp_path):
    p = StepProfiler()
    p.start()
    update_actor(torch.randn(2048, 2048, device="cuda"))
    trace, table = p.stop(str(tmp_path / "step1_policy0"))
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    assert sum(e.get("cat") == "kernel" for e in events) >= 6  # three GEMMs and three tanh
    [row] = gpu_time_by_phase(events)
    assert row["phase"] == "update_actor" and row["compute_s"] > 0 and row["comm_alone_s"] == 0
    text = open(table).read()
    assert "How the GPU spent each worker call" in text and "update_actor" in text and "aten::mm" in text
