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


# -- the token file (the real ~/.ray is never touched: HOME points into tmp_path) -----------------

@pytest.fixture
def home(tmp_path, monkeypatch):
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.setenv(var, "")   # recorded, so that what Ray sets (RAY_AUTH_MODE=token) is undone
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_the_token_of_a_new_cluster_is_written_readable_by_its_owner_only(home):
    """Ray wrote ~/.ray/auth_token 0644: any user of the node could read it and run code in the cluster."""
    from verl.single_controller.ray_group import private_auth_token
    path = private_auth_token(create=True)
    assert path == home / ".ray" / "auth_token"
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(path.read_text()) == 64
    token = path.read_text()
    assert private_auth_token(create=True) == path and path.read_text() == token   # kept, not replaced


def test_a_token_file_readable_by_others_is_narrowed_and_a_joining_driver_writes_none(home, caplog):
    from verl.single_controller.ray_group import private_auth_token
    assert private_auth_token(create=False) is None and not (home / ".ray").exists()   # joining: the cluster's token
    path = home / ".ray" / "auth_token"
    path.parent.mkdir()
    path.write_text("a" * 64)
    path.chmod(0o644)
    with caplog.at_level("WARNING"):
        assert private_auth_token(create=False) == path
    assert oct(path.stat().st_mode & 0o777) == "0o600" and path.read_text() == "a" * 64
    assert "narrowed to 0600" in caplog.text


def test_no_token_file_without_token_authentication(home, monkeypatch):
    from verl.single_controller.ray_group import private_auth_token
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert private_auth_token(create=True) is None and not (home / ".ray").exists()


@pytest.mark.e2e  # starts a Ray cluster
def test_the_cluster_started_here_uses_the_private_token(home):
    # In a process of its own: Ray's driver keeps the first token it read for the process's lifetime.
    script = ("import os, stat, ray\n"
              "from verl.single_controller.ray_group import start_ray\n"
              "start_ray(None, 'cpu')\n"
              "print('mode', oct(stat.S_IMODE(os.stat(os.path.expanduser('~/.ray/auth_token')).st_mode)), "
              "os.environ.get('RAY_AUTH_MODE'))\n"
              "ray.shutdown()\n")
    r = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mode 0o600 token" in r.stdout   # the cluster came up with token authentication, on this file
