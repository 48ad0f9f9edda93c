"""trainer.rollout_ahead_steps end to end on CPU, through the real entry point: rollout workers in
processes of their own generate the next step's batch while the trainer updates.

- With the weights held still (lr 0) the asynchronous run samples, step by step, what the synchronous
  run samples (same prompts and seeds, transformers engine), also across a crash of the rollout
  process (which fails the run naming it) and the resume after it, which generates again what was
  ahead.
- With vLLM on a rollout worker of its own, weights broadcast after every update: the staleness stays
  within its bound and the importance weights see it; validation runs on the rollout workers.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import vllm_skip_reason
from test_main_ppo import ROOT, bundled_data, common, train  # noqa: F401 - bundled_data: the fixture

pytestmark = pytest.mark.e2e

SAMPLED = ["response/length", "response/model_tokens", "reward/mean", "agent/searches"]


def held_still(model, data, server):
    """One worker, the transformers engine, the weights never moving: what is sampled depends on the
    prompts and seeds alone."""
    return common(model, data, server) + [
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=hf", "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=false", "actor_rollout_ref.actor.optim.lr=0.0",
        "actor_rollout_ref.rollout.calculate_log_probs=true", "trainer.export_hf_on_save=false"]


def rollout_worker_pids(root: int) -> list[int]:
    """The processes under `root` (the trainer: Ray's raylet, its workers) that Ray titled RolloutWorker."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RolloutWorker"):
                    found.append(pid)
            except OSError:
                continue
    return found


def test_a_run_ahead_samples_what_the_synchronous_run_samples_across_a_crash_and_resume(
        tiny_model_dir, bundled_data, bundled_bm25_server, tmp_path):
    args = held_still(tiny_model_dir, bundled_data, bundled_bm25_server)
    sync, _ = train(args + ["trainer.single_process=true", "trainer.total_training_steps=3"], tmp_path / "sync")

    # k = 1, rollout worker beside the policy worker; its process is killed once step 1 is saved
    out = tmp_path / "ahead"
    ahead = args + ["trainer.rollout_ahead_steps=1", "trainer.save_freq=1"]
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *ahead, "trainer.total_training_steps=10",
           f"trainer.default_local_dir={out}", f"hydra.run.dir={out / 'hydra'}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(Path(__file__).parent),
                                                                      os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while not (out / "checkpoints" / "global_step_1").is_dir() and proc.poll() is None:
            assert time.time() < deadline, "step 1 was not saved in time"
            time.sleep(0.1)
        pids = rollout_worker_pids(proc.pid)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)   # fails, never hangs
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "rollout worker(s) [0] died during" in stderr and "resumes from the last checkpoint" in stderr, \
        stderr[-3000:]

    resumed, log = train(ahead + ["trainer.total_training_steps=3"], out)
    rows = [r for r in resumed if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [[r[k] for k in SAMPLED] for r in rows] == [[r[k] for k in SAMPLED] for r in sync]
    saved = int(log.split("resumed from step ")[1].split()[0])
    staleness = [r["rollout/staleness"] for r in rows]
    # the first step had nothing to run ahead of; the step after the resume was generated again, from the
    # checkpoint's weights; the others came from the weights before the update of the step before them
    assert staleness[0] == 0 and staleness[saved] == 0
    assert all(s == 1 for s in staleness[1:saved] + staleness[saved + 1:])
    order = [json.loads(line) for line in (out / "data_order.jsonl").read_text().splitlines()]
    assert [o["step"] for o in order] == [1, 2, 3]   # what the crashed run drew ahead was dropped, then drawn again


def test_a_rollout_worker_of_its_own_trains_within_the_staleness_bound(tiny_model_dir, bundled_data,
                                                                        bundled_bm25_server, tmp_path):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    args = common(tiny_model_dir, bundled_data, bundled_bm25_server) + [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.n_gpus_per_node=1", "trainer.total_training_steps=3", "trainer.test_freq=2",
        "trainer.rollout_ahead_steps=1", "rollout.n_gpus_per_node=1", "rollout.weight_transport=broadcast",
        "actor_rollout_ref.rollout.top_p=1.0"]   # the engine's log-probs of the full softmax, as the actor's
    rows, log = train(args, tmp_path / "own")
    assert "exited unexpectedly" not in log   # the engine stopped before Ray ended its process
    assert "val/reward/em" in rows[0] and "val/reward/em" in rows[2] and "val/reward/em" in rows[3]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["rollout/staleness"] for r in steps] == [0, 1, 1]
    assert all(r["grad_norm"] > 0 and r["rollout/generate_s"] > 0 and "timing_s/weight_sync" in r for r in steps)
    # the engine's log-probs are on without being asked for; the importance weights see the stale samples:
    # step 1's come from the actor's own weights, step 2's from the weights before its update
    assert steps[0]["rollout_is_kl"] < 1e-4 < steps[1]["rollout_is_kl"]
