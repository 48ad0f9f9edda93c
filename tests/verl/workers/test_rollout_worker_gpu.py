"""Weight pushes to rollout workers of their own on GPUs (trainer.rollout_ahead_steps >= 1), after a
real actor update: CUDA IPC handles to rollout workers on the policy worker's GPU (transformers and
vLLM engines), and an NCCL broadcast to a rollout worker on a GPU of its own. A pushed transformers
engine samples, for the same prompts and seed, what the policy worker's own engine samples after its
weight sync; the vLLM one samples differently than before the push and reports the pushed version.
Skipped without CUDA; the broadcast needs two GPUs. The CPU counterpart: test_rollout_worker.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import vllm_skip_reason
from test_rollout_worker import config

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.e2e]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

ARGS_PROMPTS = ("capital of France?", "who wrote Hamlet?")


@pytest.fixture(scope="module")
def cluster():
    from verl.single_controller.ray_group import start_ray
    start_ray(None, "cuda")
    yield
    ray.shutdown()


def policy_group(model: str, share: float):
    """One policy worker on a GPU, with its own (transformers) engine to compare with."""
    from verl.config.sizes import derive_sizes
    from verl.single_controller.ray_group import WorkerGroup
    from verl.workers.policy_worker import PolicyWorker
    sync = config(model, ahead=0)
    sync.trainer.device = "cuda"
    return WorkerGroup(PolicyWorker, 1, "cuda", share, "policy", sync, derive_sizes(sync), 10, "cuda")


def rollout_group(model: str, placement, transport: str, engine: str = "hf"):
    from verl.single_controller.rollout_group import RolloutGroup
    from verl.workers.rollout_worker import RolloutWorker
    cfg = config(model, ahead=1, transport=transport, own_gpus=0 if placement.shared else 1)
    cfg.trainer.device = "cuda"
    rollout = cfg.actor_rollout_ref.rollout
    rollout.name, rollout.gpu_memory_utilization, rollout.enforce_eager = engine, 0.15, True
    rollout.engine_core = "in_process"
    return RolloutGroup(RolloutWorker, placement, cfg, "cuda")


def update_and_push(policy, groups, args) -> None:
    """A real actor update on the policy's own samples, its weights synced into its own engine and
    pushed to every group."""
    worker = policy.workers[0]
    batch = policy.get([worker.generate.remote(*args)], "rollout")[0]
    batch.advantages_BR = batch.loss_mask_BR * torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    assert policy.get([worker.update_actor.remote(batch)], "update")[0]["grad_norm"] > 0
    policy.get([worker.sync_weights.remote()], "weight sync")
    for group in groups:
        group.push_weights(policy, version=1, step=1)
        group.settle(policy, step=1)


def end(policy, groups) -> None:
    """Stop the engines and free the GPU shares for the next test (the cluster outlives each)."""
    for group in groups:
        group.shutdown(policy)
    for worker in [w for group in (policy, *groups) for w in group.workers]:
        ray.kill(worker)


def sampled(group, args):
    part = group.get([group.workers[0].generate_for_step.remote(*args)], "rollout")[0]
    return part.version, part.batch.info["response_ids"]


def test_cuda_ipc_pushes_reach_rollout_workers_on_the_policy_workers_gpu(cluster, tiny_model_dir):
    from transformers import AutoTokenizer

    from verl.config.schema import RolloutPlacementConfig
    from verl.single_controller.rollout_group import rollout_placement
    from verl.workers.weight_transfer import WeightTransport
    engines = ["hf"] + ([] if vllm_skip_reason() else ["vllm"])
    placement = rollout_placement(RolloutPlacementConfig(), "cuda", 1, critic=False)
    assert placement.transport == WeightTransport.IPC
    # the policy worker and one rollout worker per engine on the one GPU bundle
    share = int(10_000 / (1 + len(engines))) / 10_000
    placement = dataclasses.replace(placement, training_share=share)
    policy = policy_group(tiny_model_dir, share)
    groups = {engine: rollout_group(tiny_model_dir, placement, "ipc", engine) for engine in engines}
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = ([tok(q).input_ids for q in ARGS_PROMPTS] * 2, [0, 1, 0, 1], 1.0, 1.0, 12, 7, True)
    before = {engine: sampled(group, args) for engine, group in groups.items()}
    update_and_push(policy, groups.values(), args)
    own = policy.get([policy.workers[0].generate.remote(*args)], "rollout")[0].info["response_ids"]
    assert sampled(groups["hf"], args) == (1, own) and own != before["hf"][1]
    if "vllm" in groups:
        version, tokens = sampled(groups["vllm"], args)
        assert version == 1 and tokens != before["vllm"][1]
    end(policy, list(groups.values()))


@two_gpus
def test_an_nccl_broadcast_reaches_a_rollout_worker_on_a_gpu_of_its_own(cluster, tiny_model_dir):
    from transformers import AutoTokenizer

    from verl.config.schema import RolloutPlacementConfig
    from verl.single_controller.rollout_group import rollout_placement
    from verl.workers.weight_transfer import WeightTransport
    placement = rollout_placement(RolloutPlacementConfig(n_gpus_per_node=1), "cuda", 1, critic=False)
    assert placement.transport == WeightTransport.BROADCAST and not placement.shared
    policy = policy_group(tiny_model_dir, placement.training_share)
    group = rollout_group(tiny_model_dir, placement, "broadcast")
    group.connect(policy)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = ([tok(q).input_ids for q in ARGS_PROMPTS] * 2, [0, 1, 0, 1], 1.0, 1.0, 12, 7, True)
    before = sampled(group, args)
    update_and_push(policy, [group], args)
    own = policy.get([policy.workers[0].generate.remote(*args)], "rollout")[0].info["response_ids"]
    assert sampled(group, args) == (1, own) and own != before[1]
    end(policy, [group])
