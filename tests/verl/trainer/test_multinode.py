"""Multi-node as users run it, on one CPU host: two Ray nodes started with `ray start` (a head and a
worker joining it, one CPU each, so the two trainer workers must land on different nodes), then the
tiny GRPO run through `python -m verl.trainer.main_ppo` with `trainer.nnodes=2` and
`trainer.ray_address` pointing at the head. The workers meet over gloo across the two raylets."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import free_port, vllm_skip_reason
from test_main_ppo import ROOT, bm25_server, bundled_data, common, train  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("ray") is None, reason="needs the `ray` command")]


@pytest.fixture
def two_node_cluster(tmp_path, monkeypatch):
    port = free_port()
    # Short temp dir: Ray's socket paths must stay under the OS limit of 107 characters.
    temp = f"/tmp/ray_mn_{os.getpid()}"
    # token authentication, as README says for several nodes: the head, the node that joins it and the
    # trainer's driver all run with RAY_AUTH_MODE=token and the cluster's token (here RAY_AUTH_TOKEN;
    # without one, as on a fresh machine with no ~/.ray/auth_token, `ray start` refuses token mode)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", uuid.uuid4().hex)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    common_args = ["--num-cpus=1", "--num-gpus=0", "--disable-usage-stats"]
    subprocess.run(["ray", "start", "--head", f"--port={port}", "--include-dashboard=false",
                    f"--temp-dir={temp}", *common_args], check=True, env=env, capture_output=True, timeout=180)
    try:
        subprocess.run(["ray", "start", f"--address=127.0.0.1:{port}", *common_args], check=True, env=env,
                       capture_output=True, timeout=180)
        yield f"127.0.0.1:{port}"
    finally:
        stop_cluster((temp, f":{port} ", f"gcs_server_port={port} "))
        shutil.rmtree(temp, ignore_errors=True)


def stop_cluster(marks: tuple[str, ...], grace_s: float = 10.0) -> None:
    """End the processes of this cluster alone: those whose command line names its temp dir or its
    GCS port (as host:port, on 127.0.0.1 or the node's address). `ray stop --force` would end every Ray process on the host, other tests' clusters too."""
    def ours() -> list[int]:
        pids = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if int(proc.name) != os.getpid() and any(mark in cmdline for mark in marks):
                pids.append(int(proc.name))
        return pids
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ours():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        while ours() and time.time() < deadline:
            time.sleep(0.2)


def test_grpo_across_two_ray_nodes(two_node_cluster, tiny_model_dir, bundled_data, bm25_server, tmp_path):
    if reason := vllm_skip_reason():
        pytest.skip(reason)
    args = common(tiny_model_dir, bundled_data, bm25_server) + [
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.nnodes=2", "trainer.n_gpus_per_node=1", f"trainer.ray_address={two_node_cluster}",
        "trainer.total_training_steps=1", "trainer.val_before_train=false"]
    rows, log = train(args, tmp_path / "run")
    assert [r["step"] for r in rows] == [1] and rows[0]["grad_norm"] > 0
    assert len(alive_nodes(two_node_cluster)) == 2


def alive_nodes(address: str) -> list[dict]:
    """The live nodes of the cluster at `address`, as ray.nodes() describes them (asked from a
    process of its own, so this test process never joins the cluster)."""
    out = subprocess.run(
        [sys.executable, "-c", "import json, ray; ray.init(address=%r, log_to_driver=False); "
         "print(json.dumps([n for n in ray.nodes() if n['Alive']], default=str))" % address],
        capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
    return json.loads(out.splitlines()[-1])
