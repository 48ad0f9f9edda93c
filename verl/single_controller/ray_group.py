"""Ray worker groups: one process per GPU (or per CPU worker), placed with a placement group so
a group can span nodes (`ray start --head` on one, `ray start --address` on the others, then
`trainer.ray_address=auto`, `trainer.nnodes`, `trainer.n_gpus_per_node`).

The policy and critic groups share the GPUs: each takes a fraction of every GPU bundle. Calls are
made at the call site, visibly: `ray.get([w.update_actor.remote(part) for w, part in ...])`.
"""
from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)

# Environment that every worker process must see (NVLink multicast stays off on shared hosts).
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NVSHMEM_DISABLE_NVLS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "TOKENIZERS_PARALLELISM": "false", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


class WorkerDied(RuntimeError):
    pass


def start_ray(address: str | None, device: str):
    """Join the cluster at `address`, or start one on this node. Ray authenticates every client with
    the cluster's token (on by default for the cluster started here, which writes ~/.ray/auth_token;
    `ray start` turns it on where it finds a token or RAY_AUTH_MODE=token): its ports, open on the
    node's network interfaces, serve no one else. RAY_AUTH_MODE=disabled turns that off, with a warning."""
    if ray.is_initialized():
        return
    private_auth_token(create=not address)
    if os.environ.get("RAY_AUTH_MODE") == "disabled":
        log.warning("RAY_AUTH_MODE=disabled: the Ray cluster's ports accept any client that reaches this "
                    "node; leave token authentication on outside a private network")
    env = {"env_vars": {**WORKER_ENV, **{k: v for k, v in os.environ.items()
                                         if k.startswith(("HF_", "WANDB_", "PYTHONPATH", "VLLM_"))}}}
    if address:
        try:
            ray.init(address=address, runtime_env=env, log_to_driver=True)
        except Exception as e:
            if os.environ.get("RAY_AUTH_MODE") == "token":
                raise
            # a head started with a token (`ray start --head` on a node holding ~/.ray/auth_token, or
            # with RAY_AUTH_MODE=token) turns away a driver without one with a bare connection error.
            raise RuntimeError(
                f"could not join the Ray cluster at trainer.ray_address={address!r} ({e}). If it was "
                "started with token authentication, export RAY_AUTH_MODE=token here and on every node that "
                "joins, with the cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN") from e
    else:
        if leftovers := leftover_workers():
            log.warning("worker processes of an earlier run are still alive on this node (PIDs %s; their driver "
                        "was killed?) and may hold GPU memory: `ray stop --force` ends them", leftovers)
        # address="local": a cluster of this run's own. Without an address Ray joins the latest
        # cluster started on the node, e.g. another run's, and this run's workers die when it ends.
        # Ray's node agents (DashboardAgent, RuntimeEnvAgent) start with every raylet whatever the
        # dashboard setting, and Ray has no switch for them: when the driver is killed outright they
        # outlive it for a minute or two, trying to report the raylet's death to the dead GCS.
        ray.init(address="local", runtime_env=env, include_dashboard=False, log_to_driver=True,
                 num_cpus=max(os.cpu_count() or 1, 4))


def private_auth_token(create: bool) -> Path | None:
    """Keep the Ray cluster's token file readable by its owner only.

    Ray writes a new cluster's token (~/.ray/auth_token, or RAY_AUTH_TOKEN_PATH) with the process
    umask, readable by every user of the node under the usual one, and anyone who reads it can run
    code in the cluster. With `create` (a cluster of this run's own) the token is written here first,
    0600, so Ray finds it and writes none; a token file found readable by others is narrowed to 0600.
    Only `create` writes a token: a driver that joins a cluster must use the cluster's."""
    if os.environ.get("RAY_AUTH_MODE") == "disabled" or os.environ.get("RAY_AUTH_TOKEN"):
        return None   # no token, or one from the environment: no file to protect
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if create and not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:   # another run on the node wrote one meanwhile: the check below
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))   # 256 bits, as Ray's own tokens
            return path
    if path.exists() and stat.S_IMODE(path.stat().st_mode) & 0o077:
        try:
            os.chmod(path, 0o600)
            log.warning("the Ray token file %s was readable by other users of this node: narrowed to 0600", path)
        except OSError as e:
            log.warning("the Ray token file %s is readable by other users of this node and could not be "
                        "narrowed (%s): run `chmod 600 %s`", path, e, path)
    return path if path.exists() else None


def leftover_workers(titles: tuple[bytes, ...] = (b"ray::PolicyWorker", b"ray::CriticWorker",
                                                  b"ray::RolloutWorker")) -> list[int]:
    """PIDs of this node's processes that Ray titled as one of our workers (Linux /proc; [] elsewhere)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "cmdline").read_bytes().startswith(titles):
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return sorted(pids)


class WorkerGroup:
    """`world` instances of `cls`, rank i on bundle i of one placement group."""

    def __init__(self, cls, world: int, device: str, gpu_share: float, name: str, *args):
        self.name = name
        resources = {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": 1}
        self.pg = _placement_group(world, resources)
        remote = ray.remote(cls)
        opts = dict(num_gpus=gpu_share if device == "cuda" else 0, num_cpus=0.01)
        self.workers = [
            remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=i), name=f"{name}_{i}_{os.getpid()}", **opts)
            .remote(i, *args) for i in range(world)]
        # Rank 0's node hosts the process group's rendezvous, on a port free there.
        addr, port = self.get([self.workers[0].rendezvous.remote()], "start-up")[0]
        self.get([w.setup.remote(addr, port) for w in self.workers], "setup")

    def get(self, refs, what: str, step: int | None = None):
        """The results of remote calls on this group's workers; a dead worker becomes an error that
        names it, what it was doing and the step."""
        return get_or_name_the_dead(self.name, refs, what, step)


def get_or_name_the_dead(name: str, refs, what: str, step: int | None = None):
    """`ray.get(refs)` of calls on the workers of group `name`, refs[i] on worker i; a dead worker
    (Ray's ActorDiedError) becomes an error that names it, what it was doing and the step."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as e:
        dead = [i for i, r in enumerate(refs) if _failed(r)]
        raise WorkerDied(f"{name} worker(s) {dead or '?'} died during {what}"
                         f"{'' if step is None else f' at step {step}'}: {e}. The next run with "
                         "trainer.resume_mode=auto resumes from the last checkpoint.") from None


_PG_CACHE: dict = {}


def _placement_group(world: int, resources: dict, of: str = "training"):
    """One placement group per size, shared by the groups that colocate on the same GPUs; `of` keeps
    the GPUs of rollout workers of their own apart from the training's."""
    key = (of, world, tuple(sorted(resources.items())))
    if key not in _PG_CACHE:
        pg = placement_group([dict(resources) for _ in range(world)], strategy="PACK")
        ray.get(pg.ready(), timeout=600)
        _PG_CACHE[key] = pg
    return _PG_CACHE[key]


def _failed(ref) -> bool:
    try:
        ray.get(ref, timeout=0)
        return False
    except Exception:
        return True


class _LocalMethod:
    """A method of an object in this process, called as Ray calls an actor's method: `.remote(...)`
    runs it at once and returns its result where Ray would return an object ref."""

    def __init__(self, method):
        self.remote = method


class _LocalHandle:
    """An object in this process behind Ray's actor-handle convention (`handle.method.remote(...)`),
    so the trainer's call sites read the same with and without Ray."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        return _LocalMethod(getattr(self._obj, name))


class LocalWorkerGroup:
    """One worker inside the driver process, with WorkerGroup's calling convention
    (`trainer.single_process=true`, one GPU or CPU worker): no Ray, no process group."""

    def __init__(self, cls, world: int, device: str, gpu_share: float, name: str, *args):
        if world != 1:
            raise ValueError("trainer.single_process=true needs trainer.nnodes × n_gpus_per_node = 1")
        self.name = name
        obj = cls(0, *args)
        obj.setup("127.0.0.1", 0)
        self.workers = [_LocalHandle(obj)]

    def get(self, refs, what: str, step: int | None = None):
        return list(refs)
