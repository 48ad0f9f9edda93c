"""The GPU smoke script's own logic, on CPU: its checks must fail what they are meant to catch."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_smoke.py"
_spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
smoke = importlib.util.module_from_spec(_spec)
sys.modules["gpu_smoke"] = smoke  # dataclasses look their module up there
_spec.loader.exec_module(smoke)


def test_a_skipped_gpu_test_fails_the_part_unless_it_needs_more_gpus(tmp_path):
    log = tmp_path / "gpu-tests.log"
    log.write_text("SKIPPED [1] tests/verl/workers/test_actor_gpu.py:40: needs two GPUs\n13 passed\n")
    assert smoke.expect_no_skips(log, gpu_count=1) is None
    assert "needs two GPUs" in smoke.expect_no_skips(log, gpu_count=2)
    log.write_text("SKIPPED [2] tests/verl/workers/test_engines_gpu.py:15: vLLM is not installed\n")
    assert "vLLM is not installed" in smoke.expect_no_skips(log, gpu_count=4)


def test_an_evaluation_of_the_wrong_size_fails(tmp_path):
    path = tmp_path / "eval_search.json"
    assert "not written" in smoke.expect_eval(path)
    path.write_text(json.dumps({"n": smoke.EVAL_QUESTIONS - 1}))
    assert "expected" in smoke.expect_eval(path)
    path.write_text(json.dumps({"n": smoke.EVAL_QUESTIONS}))
    assert smoke.expect_eval(path) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_a_gpu_it_fails_at_once(capsys, tmp_path):
    assert smoke.main(["--out", str(tmp_path)]) == 1
    assert "no CUDA device" in capsys.readouterr().out
