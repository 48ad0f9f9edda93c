"""The rollout workers of trainer.rollout_ahead_steps >= 1: where they run and how the actor's
weights reach them.

Placement (the top-level rollout.* keys, verl's one-step-off names): with rollout.n_gpus_per_node = 0
one rollout worker shares each policy worker's GPU bundle (the GPU's share of every role on it
shrinks to make room); with n_gpus_per_node = N > 0 the rollout workers get nnodes × N bundles of
their own, one whole GPU each, beside the training's.

Pushes (verl.workers.weight_transfer) are made right after each update: each rollout worker takes
its push after the generations asked of it before (Ray runs an actor's calls in order), never in the
middle of one. Through the object store or CUDA IPC the driver goes on at once and checks the pushes
the rollout workers have loaded at the next push, where their errors surface; with ipc the policy
workers then drop the copies they held for them, and a push waits for the one k before it, so that
at most k copies are held. A broadcast is waited for: the policy workers are in it until the rollout
workers join.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl.config.schema import ConfigError, RolloutPlacementConfig
from verl.single_controller.ray_group import _placement_group, get_or_name_the_dead
from verl.workers.weight_transfer import WeightTransport, torch_dtype

_GROUP_IDS = itertools.count()   # actor names are unique per cluster: a driver may build more than one group


@dataclass
class RolloutPlacement:
    workers: int                 # rollout workers, one engine each
    shared: bool                 # rollout worker i on the bundle (GPU) of policy worker i
    bundle: dict                 # the resources of one bundle of their placement group
    training_share: float        # the share of a training GPU each role on it asks for (policy, critic, rollout)
    transport: WeightTransport
    cuda: bool

    def bundles(self) -> list[dict]:
        """The bundles of the rollout workers' placement group (shared: the training's)."""
        return [dict(self.bundle) for _ in range(self.workers)]

    def actor_options(self, rank: int) -> dict:
        """What rollout worker `rank` asks Ray for, inside bundle `rank` of its placement group."""
        gpus = (self.training_share if self.shared else 1.0) if self.cuda else 0.0
        return {"num_gpus": gpus, "num_cpus": 0.01, "bundle_index": rank}


def rollout_placement(place: RolloutPlacementConfig, device: str, training_workers: int,
                      critic: bool) -> RolloutPlacement:
    """Where the rollout workers go, with `training_workers` policy workers (and as many critic
    workers with `critic`) on the training GPUs, and the transport of the pushes."""
    cuda = device == "cuda"
    shared = place.n_gpus_per_node == 0
    roles = 1 + critic + shared   # processes on each training GPU
    transport = place.weight_transport
    if transport == "auto":
        transport = "ipc" if shared and cuda else "broadcast" if cuda else "object_store"
    if transport == "ipc" and not (shared and cuda):
        raise ConfigError("rollout.weight_transport=ipc hands CUDA IPC handles to the rollout worker on the same GPU: "
                          f"it needs rollout.n_gpus_per_node=0 on GPUs (here {device}, n_gpus_per_node="
                          f"{place.n_gpus_per_node}); use broadcast or object_store (or auto)")
    return RolloutPlacement(workers=training_workers if shared else place.nnodes * place.n_gpus_per_node,
                            shared=shared, bundle={"GPU": 1, "CPU": 1} if cuda else {"CPU": 1},
                            training_share=int(10_000 / roles) / 10_000,   # Ray counts GPU shares to 1e-4
                            transport=WeightTransport(transport), cuda=cuda)


@dataclass
class Push:
    """A weight push not yet known to be loaded by every rollout worker."""
    version: int
    loads: list                                 # the rollout workers' load calls, worker i's at i
    sends: list = field(default_factory=list)   # broadcast: the policy workers' side


class RolloutGroup:
    """`placement.workers` instances of `cls` (RolloutWorker), built with (rank, cfg, device)."""
    name = "rollout"

    def __init__(self, cls, placement: RolloutPlacement, cfg, device: str):
        self.placement, self.ahead_steps = placement, cfg.trainer.rollout_ahead_steps
        self.pg = _placement_group(placement.workers, placement.bundle, "training" if placement.shared else "rollout")
        remote, group_id = ray.remote(cls), next(_GROUP_IDS)
        self.workers = []
        for rank in range(placement.workers):
            options = placement.actor_options(rank)
            strategy = PlacementGroupSchedulingStrategy(self.pg,
                                                        placement_group_bundle_index=options.pop("bundle_index"))
            self.workers.append(remote.options(scheduling_strategy=strategy,
                                               name=f"rollout{group_id}_{rank}_{os.getpid()}", **options)
                                .remote(rank, cfg, device))
        self.get([w.setup.remote() for w in self.workers], "setup")
        self.dtype = self.get([self.workers[0].engine_dtype.remote()], "setup")[0]
        self.meta = None             # broadcast: what a push sends (name, shape, dtype), in order
        self.inflight: list[Push] = []

    def get(self, refs, what: str, step: int | None = None):
        return get_or_name_the_dead(self.name, refs, what, step)

    def held_weight_bytes(self, n_params: int) -> float:
        """GPU memory each policy worker holds for pushes not yet loaded: with ipc up to k full copies
        of the weights in the engine's dtype; none otherwise."""
        if self.placement.transport != WeightTransport.IPC:
            return 0.0
        return float(self.ahead_steps * n_params * torch_dtype(self.dtype).itemsize)

    def connect(self, policy) -> None:
        """broadcast: the first policy worker and the rollout workers join a process group of their own,
        and the first lists what a push sends."""
        if self.placement.transport != WeightTransport.BROADCAST:
            return
        first = policy.workers[0]
        addr, port = policy.get([first.weight_rendezvous.remote()], "weight group")[0]
        world = 1 + len(self.workers)
        # the rollout workers' side first: a policy group in the driver's process (single_process)
        # runs its call at once, and the group forms only once every rank has joined
        joined = [w.join_weight_group.remote(addr, port, world) for w in self.workers]
        policy.get([first.join_weight_group.remote(addr, port, world)], "weight group")
        self.get(joined, "weight group")
        self.meta = policy.get([w.weight_meta.remote(self.dtype) for w in policy.workers], "weight group")[0]

    def push_weights(self, policy, version: int, step: int) -> None:
        """The actor's weights after update `version` to every rollout worker, behind the calls made to
        it before; returns once the policy workers have handed them over (broadcast: once received)."""
        self.settle(policy, step, wait_up_to=version - self.ahead_steps)
        transport = self.placement.transport
        if transport == WeightTransport.OBJECT_STORE:
            exported = policy.get([w.export_weights.remote(self.dtype) for w in policy.workers], "weight export", step)
            # rank 0's answer holds the ref: each rollout worker reads the object; the driver never does
            push = Push(version, [w.load_weights.remote(exported[0][0], version) for w in self.workers])
        elif transport == WeightTransport.IPC:
            handles = policy.get([w.export_weights_ipc.remote(version, self.dtype) for w in policy.workers],
                                 "weight export", step)
            push = Push(version, [w.load_shared_weights.remote(h, version) for w, h in zip(self.workers, handles)])
        else:   # the receiving side first, as in `connect`
            loads = [w.receive_weights.remote(self.meta, version) for w in self.workers]
            push = Push(version, loads, [w.broadcast_weights.remote(self.dtype) for w in policy.workers])
        self.inflight.append(push)
        if transport == WeightTransport.BROADCAST:
            # The policy workers are in the broadcast until the rollout workers join it, and anything the
            # driver asks of them next waits for that: wait here, on the rollout workers' side first, so
            # that one dying fails the run now instead of leaving the policy workers waiting for it.
            self.settle(policy, step)

    def settle(self, policy, step: int | None, wait_up_to: float = float("inf")) -> None:
        """Check the pushes every rollout worker has loaded, oldest first (a failure surfaces here,
        naming the worker), waiting for those of versions up to `wait_up_to`; with ipc the policy
        workers then drop their copies."""
        loaded = 0
        for push in self.inflight:
            if push.version > wait_up_to and len(ray.wait(push.loads, num_returns=len(push.loads), timeout=0)[0]) \
                    < len(push.loads):
                break
            self.get(push.loads, "weight push", step)
            policy.get(push.sends, "weight push", step)
            loaded += 1
        if loaded and self.placement.transport == WeightTransport.IPC:
            newest = self.inflight[loaded - 1].version
            policy.get([w.release_weights.remote(newest) for w in policy.workers], "weight release", step)
        del self.inflight[:loaded]

    def shutdown(self, policy) -> None:
        """End of training: the pushes still on their way are loaded (or fail), then the engines stop,
        after the generations asked of them."""
        self.settle(policy, None)
        self.get([w.shutdown.remote() for w in self.workers], "shutdown")
