"""Rollout workers in processes of their own (trainer.rollout_ahead_steps >= 1) on CPU: after a real
actor update, a weight push through Ray's object store and one broadcast over a process group of
their own (Gloo here, NCCL on GPUs: test_rollout_worker_gpu.py) make each rollout worker write, for
the same prompts and seed, the tokens the policy worker's own engine writes after its weight sync."""
from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.e2e   # starts a Ray cluster


def config(model: str, ahead: int, transport: str = "auto", own_gpus: int | None = None):
    """A trainer config of one worker and the transformers engine; `own_gpus`: rollout.n_gpus_per_node
    (default: 1 where running ahead)."""
    from omegaconf import OmegaConf

    from verl.config.load import load_config
    return load_config(OmegaConf.create({
        "data": {"train_files": "unused.parquet", "train_batch_size": 2, "max_prompt_length": 64,
                 "max_response_length": 12},
        "actor_rollout_ref": {"model": {"path": model, "enable_gradient_checkpointing": False},
                              "rollout": {"name": "hf", "n_agent": 2},
                              "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size": 2,
                                        "optim": {"lr": 1e-2}, "use_kl_loss": False}},
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "reward": {"function": "search_r1.rewards:score_for"},
        "trainer": {"device": "cpu", "n_gpus_per_node": 1, "rollout_ahead_steps": ahead},
        "rollout": {"n_gpus_per_node": (1 if ahead else 0) if own_gpus is None else own_gpus,
                    "weight_transport": transport}}))


@pytest.fixture(scope="module")
def cluster():
    from verl.single_controller.ray_group import start_ray
    start_ray(None, "cpu")
    yield
    ray.shutdown()


def test_pushed_weights_make_the_rollout_workers_sample_what_the_policys_own_engine_samples(cluster, tiny_model_dir):
    from verl.config.sizes import derive_sizes
    from verl.single_controller.ray_group import LocalWorkerGroup
    from verl.single_controller.rollout_group import RolloutGroup, rollout_placement
    from verl.workers.policy_worker import PolicyWorker
    from verl.workers.rollout_worker import RolloutWorker
    from verl.workers.weight_transfer import WeightTransport

    sync = config(tiny_model_dir, ahead=0)
    policy = LocalWorkerGroup(PolicyWorker, 1, "cpu", 1.0, "policy", sync, derive_sizes(sync), 10, "cpu")
    groups = {}
    for transport in ("object_store", "broadcast"):
        ahead = config(tiny_model_dir, ahead=1, transport=transport)
        placement = rollout_placement(ahead.rollout, "cpu", 1, critic=False)
        assert placement.transport == WeightTransport(transport) and not placement.shared
        groups[transport] = RolloutGroup(RolloutWorker, placement, ahead, "cpu")
        groups[transport].connect(policy)
    worker = policy.workers[0]._obj
    prompts = [worker.tokenizer(q).input_ids for q in ("capital of France?", "who wrote Hamlet?")] * 2
    args = (prompts, [0, 1, 0, 1], 1.0, 1.0, 12, 7, True)

    def rollouts() -> dict[str, list]:
        out = {"policy": worker.generate(*args).info["response_ids"]}
        for name, group in groups.items():
            part = group.get([group.workers[0].generate_for_step.remote(*args)], "rollout")[0]
            out[name] = (part.version, part.batch.info["response_ids"])
        return out

    before = rollouts()
    assert before["object_store"] == before["broadcast"] == (0, before["policy"])   # the same start, same seed
    # a real update: the trajectories' own tokens, half of them rewarded
    batch = worker.generate(*args)
    batch.advantages_BR = batch.loss_mask_BR * torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    assert worker.update_actor(batch)["grad_norm"] > 0
    worker.sync_weights()
    for group in groups.values():
        group.push_weights(policy, version=1, step=1)
        group.settle(policy, step=1)
    after = rollouts()
    assert after["policy"] != before["policy"]   # the update changed what the engine samples
    assert after["object_store"] == after["broadcast"] == (1, after["policy"])
    for group in groups.values():
        group.shutdown(policy)
