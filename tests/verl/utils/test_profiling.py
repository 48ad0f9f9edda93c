"""StepProfiler on the CPU: what it records is written as a gzipped Chrome trace and a table."""
import gzip
import json

import pytest
import torch

from verl.utils.profiling import StepProfiler


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
