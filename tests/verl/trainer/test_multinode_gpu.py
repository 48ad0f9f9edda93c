"""Multi-node on one GPU host, as users run it on several: two Ray nodes started with `ray start`, each
given half of the visible GPUs (CUDA_VISIBLE_DEVICES per raylet, the way one node's GPUs are its own),
then one GRPO step of a Qwen2.5-0.5B-shaped model (random weights, benchmarks/random_models.py)
through `python -m verl.trainer.main_ppo` with `trainer.nnodes=2`. The workers need
every GPU of both nodes, so the step's NCCL process group spans the two raylets. Two GPUs make it
2×1, four 2×2. Skipped with fewer than two GPUs or without vLLM."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from conftest import free_port, vllm_skip_reason
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from random_models import make_random_model  # noqa: E402
from test_main_ppo import bm25_server, bundled_data, common, train  # noqa: F401 (fixtures)
from test_multinode import alive_nodes

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
# Ray's command line through this interpreter: on a GPU node the packages' scripts may not be on PATH
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return listed.split(",") if listed else [str(i) for i in range(torch.cuda.device_count())]


@pytest.fixture
def two_gpu_nodes(monkeypatch):
    """(the head's address, GPUs per node); each raylet sees only its half of the GPUs."""
    gpus = visible_gpus()
    per_node = min(2, len(gpus) // 2)
    port = free_port()
    temp = f"/tmp/ray_mng_{os.getpid()}"   # Ray's socket paths must stay under 107 characters
    # token authentication, as README says for several nodes: the cluster's token in the environment
    # of every node and of the driver (a fresh machine has no ~/.ray/auth_token to fall back on)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", uuid.uuid4().hex)
    base = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    args = ["--num-cpus=4", f"--num-gpus={per_node}", "--disable-usage-stats"]
    head = {**base, "CUDA_VISIBLE_DEVICES": ",".join(gpus[:per_node])}
    worker = {**base, "CUDA_VISIBLE_DEVICES": ",".join(gpus[per_node:2 * per_node])}
    try:
        ray_cli(["start", "--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}",
                 *args], head)
        ray_cli(["start", f"--address=127.0.0.1:{port}", *args], worker)
        yield f"127.0.0.1:{port}", per_node
    finally:
        stop_cluster(port, temp)
        shutil.rmtree(temp, ignore_errors=True)


def ray_cli(args: list[str], env: dict) -> None:
    """Run `ray ARGS`; a failure carries Ray's own output, which says why."""
    done = subprocess.run([*RAY, *args], env=env, capture_output=True, text=True, timeout=180)
    if done.returncode:
        raise RuntimeError(f"`ray {' '.join(args)}` exited {done.returncode}:\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def stop_cluster(port: int, temp: str) -> None:
    """Stop this cluster's processes only: `ray stop` would also stop the Ray runs of other smoke
    parts on the same host. Each of ours names the head's port or the cluster's temp dir on its
    command line, or is a child of one that does (the raylets' agents, which outlive them)."""
    mine = re.compile(rb"[:=]%d(\x00|$)|%s" % (port, re.escape(temp.encode())))
    parent, pids = {}, set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            parent[int(pid)] = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if int(pid) != os.getpid() and mine.search(cmdline):
            pids.add(int(pid))
    while children := {p for p, pp in parent.items() if pp in pids and p not in pids}:
        pids |= children
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        time.sleep(3)


def test_grpo_step_with_nccl_across_two_ray_nodes(two_gpu_nodes, bundled_data, bm25_server, tmp_path):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    address, per_node = two_gpu_nodes
    world = 2 * per_node
    model = make_random_model(tmp_path / "policy", "0.5b", None)   # the shape the step is measured at
    args = common(model, bundled_data, bm25_server) + [
        "trainer.device=cuda", "trainer.nnodes=2", f"trainer.n_gpus_per_node={per_node}",
        f"trainer.ray_address={address}", "data.train_batch_size=4",
        # micro-batch sizes count every worker's rows: one row a worker
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", f"actor_rollout_ref.actor.ppo_micro_batch_size={world}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size={world}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size={world}", f"critic.ppo_micro_batch_size={world}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.total_training_steps=1", "trainer.val_before_train=false"]
    rows, log = train(args, tmp_path / "run")
    assert [r["step"] for r in rows] == [1] and rows[0]["grad_norm"] > 0
    gpus = [n["Resources"].get("GPU", 0) for n in alive_nodes(address)]
    assert gpus == [per_node, per_node]   # two nodes; the step needed every GPU of both
