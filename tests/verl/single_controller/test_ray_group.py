"""The Ray cluster the trainer starts for a single-node run: its ports accept no client without the
cluster's token (Ray 2.60's token authentication, which start_ray leaves on)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")


@pytest.mark.e2e  # starts a Ray cluster
def test_the_local_cluster_refuses_a_client_without_its_token(tmp_path):
    from verl.single_controller.ray_group import start_ray
    start_ray(None, "cpu")
    try:
        gcs = ray.get_runtime_context().gcs_address
        join = [sys.executable, "-c", f"import ray; ray.init(address={gcs!r}); print('joined')"]
        stranger = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}
        r = subprocess.run(join, env=stranger, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "joined" not in r.stdout
        assert "InvalidAuthToken" in r.stderr
        # the same client with this user's token (~/.ray/auth_token) joins
        r = subprocess.run(join, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "joined" in r.stdout, r.stderr[-2000:]
    finally:
        ray.shutdown()


def test_workers_left_by_a_killed_driver_are_found():
    from verl.single_controller.ray_group import leftover_workers
    # a process titled as Ray titles our policy workers
    proc = subprocess.Popen(["bash", "-c", 'exec -a "ray::PolicyWorker" sleep 60'])
    try:
        import time
        deadline = time.time() + 10
        while proc.pid not in leftover_workers() and time.time() < deadline:
            time.sleep(0.1)
        assert proc.pid in leftover_workers()
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in leftover_workers()
