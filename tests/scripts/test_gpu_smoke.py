"""The GPU smoke script's own logic, on CPU: its checks must fail what they are meant to catch."""
from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
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


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie waiting for its reaper does not)."""
    time.sleep(0.5)   # the signal's delivery
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _sleeper(tmp_path, name: str) -> "smoke.Part":
    """A part whose command leaves a grandchild (as an engine or a raylet would) and waits on it."""
    return smoke.Part(name, 1, [smoke.sh("bash", "-c", f"echo {name} working; sleep 120 & "
                                         f"echo $! > {tmp_path / name}.pid; wait")])


@pytest.mark.e2e  # waits out a part's time limit
def test_a_part_past_its_time_fails_naming_its_last_log_line_and_leaves_nothing_running(tmp_path, capsys):
    ok = smoke.Part("quick", 1, [smoke.sh("bash", "-c", "echo fine")])
    results = smoke.run_all([_sleeper(tmp_path, "slow"), ok], gpu_count=1, lanes=1, out=tmp_path, timeout=3)
    out = capsys.readouterr().out
    assert results == [False, True]
    assert "FAIL  slow" in out and "timed out after 3 s; its log ended on: slow working" in out
    assert "PASS  quick" in out
    assert not _alive(int((tmp_path / "slow.pid").read_text()))


def test_what_a_finished_command_left_running_is_ended_and_named(tmp_path, capsys):
    """A command that exits while a child it started runs on (an engine core or a Ray process its
    program failed to stop) would share the next part's GPU: the part ends it and says so."""
    # the command exits only once its child is `sleep` (before its exec the child is still a bash)
    stray = smoke.Part("stray", 1, [smoke.sh("bash", "-c", f"sleep 120 & p=$!; until grep -qx sleep /proc/$p/comm; "
                                                         f"do :; done; echo $p > {tmp_path}/stray.pid; echo done")])
    clean = smoke.Part("clean", 1, [smoke.sh("bash", "-c", "echo fine")])
    assert smoke.run_all([stray, clean], gpu_count=1, lanes=1, out=tmp_path, timeout=60) == [True, True]
    out = capsys.readouterr().out
    assert "PASS  stray" in out and "ended 1 processes it left running: sleep 120" in out
    assert "PASS  clean" in out and "ended" not in out.split("PASS  clean")[1]
    assert not _alive(int((tmp_path / "stray.pid").read_text()))
    assert "ended 1 processes the command left running" in (tmp_path / "stray.log").read_text()


def test_sigterm_gives_every_part_a_verdict_and_ends_the_running_ones(tmp_path):
    """The script under a wrapper's `timeout`: before, the wrapper's kill left no verdict at all."""
    code = (f"import sys, signal; sys.path.insert(0, {str(SCRIPT.parent)!r}); import gpu_smoke as s; "
            f"from pathlib import Path; out = Path({str(tmp_path)!r}); "
            "signal.signal(signal.SIGTERM, s.raise_stopped); "
            "slow = f'echo slow working; sleep 120 & echo $! > {out}/slow.pid; wait'; "
            "parts = [s.Part('slow', 1, [s.sh('bash', '-c', slow)]), s.Part('later', 1, [s.sh('true')])]; "
            "sys.exit(1 if not any(s.run_all(parts, 1, 1, out, None)) else 0)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (tmp_path / "slow.pid").exists() and time.time() < deadline:
        time.sleep(0.2)
    assert (tmp_path / "slow.pid").exists(), "the part did not start"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "FAIL  slow" in out and "stopped (SIGTERM); its log ended on: slow working" in out
    assert "FAIL  later" in out and "not started" in out
    assert not _alive(int((tmp_path / "slow.pid").read_text()))
