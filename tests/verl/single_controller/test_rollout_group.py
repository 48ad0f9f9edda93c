"""Where the rollout workers of trainer.rollout_ahead_steps >= 1 go: what each asks Ray for, the share
of a training GPU every role on it takes, and the weight transport `auto` picks."""
import pytest

from verl.config.schema import ConfigError, RolloutPlacementConfig
from verl.single_controller.rollout_group import rollout_placement
from verl.workers.weight_transfer import WeightTransport


def test_beside_the_policy_workers_each_rollout_worker_shares_a_policy_workers_gpu():
    placement = rollout_placement(RolloutPlacementConfig(), "cuda", training_workers=4, critic=False)
    assert placement.shared and placement.workers == 4 and placement.transport == WeightTransport.IPC
    assert placement.bundles() == [{"GPU": 1, "CPU": 1}] * 4   # the training's own bundles, one per GPU
    assert [placement.actor_options(i) for i in range(4)] == [
        {"num_gpus": 0.5, "num_cpus": 0.01, "bundle_index": i} for i in range(4)]
    assert placement.training_share == 0.5   # what the policy workers ask for beside them


def test_with_a_critic_three_roles_share_each_training_gpu_within_its_whole():
    placement = rollout_placement(RolloutPlacementConfig(), "cuda", training_workers=2, critic=True)
    assert placement.training_share == 0.3333 and placement.actor_options(1)["num_gpus"] == 0.3333
    assert 3 * placement.training_share <= 1.0


def test_on_gpus_of_their_own_each_rollout_worker_takes_a_whole_gpu_and_the_training_keeps_its_own():
    place = RolloutPlacementConfig(nnodes=2, n_gpus_per_node=3)
    placement = rollout_placement(place, "cuda", training_workers=8, critic=True)
    assert not placement.shared and placement.workers == 6 and placement.transport == WeightTransport.BROADCAST
    assert placement.bundles() == [{"GPU": 1, "CPU": 1}] * 6
    assert placement.actor_options(5) == {"num_gpus": 1.0, "num_cpus": 0.01, "bundle_index": 5}
    assert placement.training_share == 0.5   # policy and critic, as without rollout workers


@pytest.mark.parametrize("gpus", [0, 2])
def test_on_cpu_rollout_workers_are_processes_and_weights_go_through_the_object_store(gpus):
    placement = rollout_placement(RolloutPlacementConfig(n_gpus_per_node=gpus), "cpu", training_workers=2,
                                  critic=False)
    assert placement.workers == 2 and placement.bundles() == [{"CPU": 1}] * 2
    assert placement.actor_options(0)["num_gpus"] == 0.0 and placement.transport == WeightTransport.OBJECT_STORE
    explicit = rollout_placement(RolloutPlacementConfig(n_gpus_per_node=gpus, weight_transport="broadcast"), "cpu",
                                 training_workers=2, critic=False)
    assert explicit.transport == WeightTransport.BROADCAST   # over Gloo


@pytest.mark.parametrize("device, gpus", [("cpu", 0), ("cuda", 1)])
def test_cuda_ipc_is_refused_where_no_rollout_worker_shares_a_gpu_with_a_policy_worker(device, gpus):
    with pytest.raises(ConfigError, match="rollout.weight_transport=ipc"):
        rollout_placement(RolloutPlacementConfig(n_gpus_per_node=gpus, weight_transport="ipc"), device, 1, False)
