"""The critic's worker process, one per GPU when the advantage estimator needs values (GAE). The
driver calls it through Ray, as the policy's (verl.workers.policy_worker)."""
from __future__ import annotations

import dataclasses
import os

import torch

from verl.batch import RolloutBatch
from verl.config.load import agent_loop_spec
from verl.config.schema import TrainerConfig
from verl.config.sizes import Sizes
from verl.utils.profiling import phase
from verl.workers.rollout.loop_from_config import agent_loop_settings, load_agent_loop
from verl.workers.worker_process import (ProfiledWorker, expandable_segments, join_process_group, release_cached_memory,
                                         rendezvous)


class CriticWorker(ProfiledWorker):
    def __init__(self, rank: int, cfg: TrainerConfig, sizes: Sizes, total_steps: int, device: str):
        self.rank, self.cfg, self.sizes, self.total_steps, self.device = rank, cfg, sizes, total_steps, device

    def rendezvous(self) -> tuple[str, int]:
        return rendezvous()

    def setup(self, master_addr: str, master_port: int) -> None:
        from verl.workers.critic import Critic
        cfg = self.cfg
        join_process_group(self.rank, self.sizes.world, master_addr, master_port, self.device)
        c = cfg.critic
        c = dataclasses.replace(c, model=dataclasses.replace(c.model, path=c.model.path or
                                                              cfg.actor_rollout_ref.model.path))
        if self.device == "cuda":  # no engine in this process: expandable blocks throughout
            expandable_segments(True)
        self.critic = Critic(c, cfg.actor_rollout_ref.actor, micro_batch_size=self.sizes.critic_micro_trajectories_per_worker,
                             total_steps=self.total_steps, seed=cfg.trainer.seed)
        agent_cls = load_agent_loop(agent_loop_spec(cfg))
        settings = agent_loop_settings(cfg, self.device)
        self.longest_row = cfg.data.max_prompt_length + agent_cls.max_response_tokens(settings)

    def pending_bytes(self) -> float:
        return self.critic.pending_bytes()

    def plan_memory(self, others_pending: float) -> list[str]:
        return self.critic.plan_memory(self.longest_row, others_pending)

    @phase
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        return self.critic.compute_values(batch).cpu()

    @phase
    def update_critic(self, batch: RolloutBatch) -> dict:
        metrics = self.critic.update(batch, self.sizes.mini_batch_trajectories_per_worker)
        if self.device == "cuda":
            metrics |= release_cached_memory()
        return metrics

    def save(self, root: str, step: int, trainer_state: dict, keep_last: int) -> None:
        from verl.checkpoint.store import save_checkpoint
        from verl.workers.lora import adapter_config
        c = self.critic.cfg.model
        adapters = {"critic": adapter_config(self.critic.model, c.path)} if c.lora_rank else None
        save_checkpoint(os.path.join(root, "critic"), step,
                        {"critic": (self.critic.model, self.critic.optimizer, self.critic.scheduler)},
                        trainer_state, keep_last, adapters)

    def load(self, root: str, step: int) -> dict:
        from verl.checkpoint.store import load_checkpoint
        return load_checkpoint(os.path.join(root, "critic"), step,
                               {"critic": (self.critic.model, self.critic.optimizer, self.critic.scheduler)},
                               self.cfg.trainer.allow_unverified_checkpoint)

    def set_lr_scale(self, scale: float) -> None:
        self.critic.set_lr_scale(scale)
