"""StepProfiler on a GPU: the kernels a step launched are in the trace (and the table sorted by
device time is written)."""
import gzip
import json

import pytest
import torch

from verl.utils.profiling import StepProfiler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_gpu_kernels_are_recorded(tmp_path):
    p = StepProfiler()
    p.start()
    a = torch.randn(1024, 1024, device="cuda")
    for _ in range(3):
        a = torch.mm(a, a).tanh()
    torch.cuda.synchronize()
    trace, table = p.stop(str(tmp_path / "step1_policy0"))
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    assert sum(e.get("cat") == "kernel" for e in events) >= 6  # three GEMMs and three tanh
    assert "aten::mm" in open(table).read()
