"""Batch sizes derived from the config once, with divisibility checked at start-up: every error
names the keys to change."""
from __future__ import annotations

from dataclasses import dataclass

from verl.config.schema import ConfigError, TrainerConfig


@dataclass
class Sizes:
    """Batch sizes derived once; every unit is in the name."""
    world: int                           # worker processes (GPUs)
    prompts_per_step: int
    trajectories_per_step: int
    trajectories_per_worker: int
    mini_batch_trajectories_per_worker: int
    micro_batch_trajectories_per_worker: int
    logprob_micro_trajectories_per_worker: int
    critic_micro_trajectories_per_worker: int


def derive_sizes(cfg: TrainerConfig) -> Sizes:
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    n = cfg.actor_rollout_ref.rollout.n_agent
    actor = cfg.actor_rollout_ref.actor
    per_step = cfg.data.train_batch_size * n
    mini = actor.ppo_mini_batch_size

    def require(condition, message):   # else the run stops at start-up with the message
        if not condition:
            raise ConfigError(message)

    require(per_step % world == 0,
            f"data.train_batch_size × rollout.n_agent = {per_step} trajectories per step is not divisible "
            f"by trainer.nnodes × trainer.n_gpus_per_node = {world} workers")
    require(per_step % mini == 0,
            f"data.train_batch_size × rollout.n_agent = {per_step} trajectories per step is not divisible "
            f"by actor.ppo_mini_batch_size = {mini} trajectories")
    require(mini % world == 0,
            f"actor.ppo_mini_batch_size = {mini} trajectories is not divisible by {world} workers")
    for key, value in (("actor_rollout_ref.actor.ppo_micro_batch_size", actor.ppo_micro_batch_size),
                       ("actor_rollout_ref.rollout.log_prob_micro_batch_size",
                        cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size),
                       ("critic.ppo_micro_batch_size", cfg.critic.ppo_micro_batch_size)):
        require(value % world == 0 and value >= world,
                f"{key} = {value} trajectories must be a positive multiple of the {world} workers")
    micro = actor.ppo_micro_batch_size // world
    require(actor.use_dynamic_bsz or (mini // world) % micro == 0,
            f"actor.ppo_mini_batch_size / workers = {mini // world} trajectories is not divisible "
            f"by actor.ppo_micro_batch_size / workers = {micro}")
    critic_micro = cfg.critic.ppo_micro_batch_size // world
    critic_dynamic = actor.use_dynamic_bsz if cfg.critic.use_dynamic_bsz is None else cfg.critic.use_dynamic_bsz
    require(cfg.algorithm.adv_estimator != "gae" or critic_dynamic or (mini // world) % critic_micro == 0,
            f"the critic updates on the actor's mini-batches: actor.ppo_mini_batch_size / workers = "
            f"{mini // world} trajectories is not divisible by critic.ppo_micro_batch_size / workers = {critic_micro}")
    return Sizes(world, cfg.data.train_batch_size, per_step, per_step // world, mini // world, micro,
                 cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size // world,
                 cfg.critic.ppo_micro_batch_size // world)
