"""train_grpo.sh and train_ppo.sh are thin wrappers over the config presets configs/search_r1_*.yaml:
each composes (Hydra's `--cfg job`: print the config, run nothing) to the keys of the paper's
setting, and command-line keys still override the preset."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]

# The paper's setting, key by key, as the scripts spelled it out before the presets existed.
PAPER = {
    "data.train_files": "data/nq_hotpotqa/train.parquet", "data.val_files": "data/nq_hotpotqa/test.parquet",
    "data.train_batch_size": 512, "data.max_prompt_length": 4096, "data.max_response_length": 500,
    "data.max_obs_length": 500, "actor_rollout_ref.model.path": "Qwen/Qwen2.5-3B",
    "actor_rollout_ref.model.enable_gradient_checkpointing": True, "actor_rollout_ref.model.use_torch_compile": True,
    "actor_rollout_ref.actor.optim.lr": 1e-6, "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.285,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256, "actor_rollout_ref.actor.ppo_micro_batch_size": 64,
    "actor_rollout_ref.actor.state_masking": True, "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.temperature": 1.0, "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
    "actor_rollout_ref.rollout.agent_loop": "search_r1.agent.loop:SearchAgentLoop",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": 128, "reward.function": "search_r1.rewards:score_for",
    "max_turns": 2, "retriever.url": "http://127.0.0.1:8000/retrieve", "retriever.topk": 3,
    "trainer.logger": ["console", "jsonl", "wandb"], "trainer.n_gpus_per_node": 8, "trainer.nnodes": 1,
    "trainer.save_freq": 100, "trainer.test_freq": 50, "trainer.total_training_steps": 1005,
    "trainer.project_name": "search_r1",
}
GRPO = {"algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False,
        "actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.kl_loss_coef": 0.001,
        "actor_rollout_ref.actor.kl_loss_type": "low_var_kl", "actor_rollout_ref.rollout.n_agent": 5,
        "trainer.experiment_name": "nq_hotpotqa-grpo-qwen2.5-3b",
        "trainer.default_local_dir": "checkpoints/nq_hotpotqa-grpo-qwen2.5-3b"}
PPO = {"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True,
       "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.rollout.n_agent": 1,
       "critic.optim.lr": 1e-5, "critic.optim.lr_warmup_steps_ratio": 0.015, "critic.ppo_micro_batch_size": 64,
       "trainer.experiment_name": "nq_hotpotqa-ppo-qwen2.5-3b",
       "trainer.default_local_dir": "checkpoints/nq_hotpotqa-ppo-qwen2.5-3b"}


def composed(script: str, *overrides: str) -> dict:
    out = subprocess.run(["bash", str(ROOT / script), *overrides, "--cfg", "job"], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}).stdout
    return yaml.safe_load(out)


def get(cfg: dict, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


@pytest.mark.parametrize("script, keys", [("train_grpo.sh", PAPER | GRPO), ("train_ppo.sh", PAPER | PPO)])
def test_scripts_compose_the_papers_setting(script, keys):
    cfg = composed(script)
    assert {k: get(cfg, k) for k in keys} == keys


def test_command_line_keys_override_the_preset():
    cfg = composed("train_grpo.sh", "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n_agent=3")
    assert cfg["trainer"]["n_gpus_per_node"] == 4 and cfg["actor_rollout_ref"]["rollout"]["n_agent"] == 3
