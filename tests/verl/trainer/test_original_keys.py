"""The original Search-R1 `train_grpo.sh` / `train_ppo.sh` overrides, key by key: each composes and
means what it meant there, or stops the run at start-up naming what to use instead."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from verl.config.load import check_agent_keys, load_config
from verl.config.schema import ConfigError
from verl.config.sizes import derive_sizes
from verl.trainer.main_ppo import accept_plus_on_existing_keys
from verl.trainer.metrics import load_reward_fn, reward_kwargs_for

ROOT = Path(__file__).resolve().parents[3]

# The overrides of the original train_grpo.sh (values as given there, paths made local).
ORIGINAL_GRPO = [
    "data.train_files=data/nq_search/train.parquet", "data.val_files=data/nq_search/test.parquet",
    "data.train_data_num=null", "data.val_data_num=null", "data.train_batch_size=512", "data.val_batch_size=256",
    "data.max_prompt_length=4096", "data.max_response_length=500", "data.max_start_length=2048",
    "data.max_obs_length=500", "data.shuffle_train_dataloader=True", "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285", "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size=64",
    "actor_rollout_ref.actor.fsdp_config.param_offload=true", "actor_rollout_ref.actor.fsdp_config.grad_offload=true",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size=128", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.ref.log_prob_micro_batch_size=128", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "algorithm.no_think_rl=false", "actor_rollout_ref.rollout.n_agent=5", "actor_rollout_ref.rollout.temperature=1",
    "actor_rollout_ref.actor.state_masking=true", "trainer.logger=['wandb']", "+trainer.val_only=false",
    "+trainer.val_before_train=true", "trainer.default_hdfs_dir=null", "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1", "trainer.save_freq=100", "trainer.test_freq=50", "trainer.project_name=Search-R1",
    "trainer.experiment_name=nq-search-r1-grpo", "trainer.total_epochs=15", "trainer.total_training_steps=1005",
    "trainer.default_local_dir=verl_checkpoints/nq-search-r1-grpo", "max_turns=2",
    "retriever.url=http://127.0.0.1:8000/retrieve", "retriever.topk=3",
]
# What the original train_ppo.sh sets beyond (or instead of) the GRPO overrides.
ORIGINAL_PPO = [o for o in ORIGINAL_GRPO if not o.startswith(("algorithm.adv_estimator", "actor_rollout_ref.actor.use_kl_loss",
                                                              "actor_rollout_ref.rollout.n_agent", "trainer.n_gpus_per_node"))] + [
    "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n_agent=1", "trainer.n_gpus_per_node=4",
    "critic.optim.lr=1e-5", "critic.model.use_remove_padding=True", "critic.optim.lr_warmup_steps_ratio=0.05",
    "critic.model.path=Qwen/Qwen2.5-3B", "critic.model.enable_gradient_checkpointing=true",
    "critic.ppo_micro_batch_size=8", "critic.model.fsdp_config.param_offload=true",
    "critic.model.fsdp_config.grad_offload=true", "critic.model.fsdp_config.optimizer_offload=true",
    "algorithm.kl_ctrl.kl_coef=0.001", "trainer.critic_warmup=0",
]
SEARCH = ["actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop",
          "reward.function=search_r1.rewards:score_for"]


def load(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return load_config(compose("ppo_trainer", overrides=accept_plus_on_existing_keys(overrides)))


def test_original_grpo_overrides_mean_what_they_meant():
    cfg = load(ORIGINAL_GRPO + SEARCH)
    sizes = derive_sizes(cfg)
    # 512 prompts × 5 = 2,560 trajectories, mini-batches of 256 trajectories: 10 optimizer steps a step
    assert sizes.trajectories_per_step == 2560
    assert sizes.trajectories_per_step // (sizes.mini_batch_trajectories_per_worker * sizes.world) == 10
    assert sizes.micro_batch_trajectories_per_worker == 8  # 64 over 8 GPUs
    # GRPO with the KL loss: no KL penalty in the reward as well
    assert cfg.actor_rollout_ref.actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward
    assert cfg.trainer.val_before_train and not cfg.trainer.val_only
    fsdp = cfg.actor_rollout_ref.actor.fsdp_config
    assert fsdp.param_offload and fsdp.grad_offload and fsdp.optimizer_offload
    # the original's defaults for keys the scripts leave alone
    assert cfg.actor_rollout_ref.rollout.top_p == 0.95 and cfg.actor_rollout_ref.actor.entropy_coeff == 0.001


def test_original_ppo_overrides_compose_and_put_kl_in_the_reward():
    cfg = load(ORIGINAL_PPO + SEARCH)
    assert cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.use_kl_in_reward
    assert cfg.critic.model.fsdp_config.grad_offload and cfg.trainer.critic_warmup == 0
    # the original PPO script's re-ranking service is refused, naming the server's own re-ranker
    with pytest.raises(ConfigError, match="--reranker_model"):
        load(ORIGINAL_PPO + SEARCH + ["reranker.do_rerank=true", "reranker.url=http://10.0.0.1:6980/rerank",
                                      "reranker.topk=3"])


def test_both_kl_terms_only_when_asked_for():
    cfg = load(ORIGINAL_GRPO + SEARCH + ["algorithm.use_kl_in_reward=true"])
    assert cfg.algorithm.use_kl_in_reward and cfg.actor_rollout_ref.actor.use_kl_loss


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.fsdp_config.param_offload=false", "param_offload=true as well"),
    ("algorithm.no_think_rl=true", "no_think_rl"),
    ("trainer.default_hdfs_dir=hdfs://x/y", "default_local_dir"),
    ("actor_rollout_ref.rollout.n=5", "n_agent"),
])
def test_values_with_another_meaning_here_stop_at_start_up(override, message):
    with pytest.raises(ConfigError, match=message):
        load(ORIGINAL_GRPO + SEARCH + [override])


def test_the_original_format_reward_keys_reach_the_reward_function():
    """What the original's v0.3 train_grpo_format.sh adds: the search reward's keyword arguments
    (search_r1.compat reads them into reward.reward_kwargs)."""
    cfg = load(ORIGINAL_GRPO + SEARCH + ["reward_model.structure_format_score=0.2",
                                         "reward_model.final_format_score=0.1", "reward_model.retrieval_score=0"])
    kwargs = reward_kwargs_for(load_reward_fn(cfg.reward.function), cfg.reward.reward_kwargs)
    assert kwargs == {"format_score": 0.2, "final_format_score": 0.1, "retrieval_score": 0.0, "search_cost": 0.0,
                      "format_needs_search": False}
    plain = load(ORIGINAL_GRPO + SEARCH)   # the paper's plain EM: every term at 0
    assert not any(reward_kwargs_for(load_reward_fn(plain.reward.function), plain.reward.reward_kwargs).values())


def test_a_model_based_reward_stops_at_start_up():
    with pytest.raises(ConfigError, match="model-based reward is not offered"):
        load(ORIGINAL_GRPO + SEARCH + ["reward_model.enable=true"])


def test_the_original_command_line_alone_selects_the_search_agent_and_the_em_reward():
    """The original never named an agent loop or a reward: its max_turns and retriever.* keys run the
    search agent with the data-source EM reward here too (search_r1.compat)."""
    from verl.workers.rollout.loop_from_config import agent_loop_settings
    cfg = load(ORIGINAL_GRPO)
    assert cfg.actor_rollout_ref.rollout.agent_loop == "search_r1.agent.loop:SearchAgentLoop"
    assert cfg.reward.function == "search_r1.rewards:score_for"
    options = agent_loop_settings(cfg, "cpu").options
    assert (options.max_turns, options.retriever.url, options.retriever.topk) == (2, "http://127.0.0.1:8000/retrieve", 3)
    check_agent_keys(cfg, {"max_turns", "retriever.url", "data.train_files"})


def test_the_original_command_line_composes_through_hydra():
    """`+key=` on a key we have, as the original scripts write it, passes Hydra (printed with --cfg job)."""
    r = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "--cfg", "job", *ORIGINAL_GRPO, *SEARCH],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "max_start_length: 2048" in r.stdout and "val_before_train: true" in r.stdout


@pytest.mark.e2e  # launches the trainer
def test_a_missing_reward_function_stops_before_any_worker_starts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", f"data.train_files={tmp_path / 'none.parquet'}",
                        "actor_rollout_ref.model.path=unused", "trainer.device=cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "reward.function" in r.stderr, r.stderr[-2000:]


@pytest.mark.e2e  # launches the trainer
def test_the_original_command_line_runs_the_search_agent_and_says_so(tmp_path):
    """The original train_grpo.sh line with only sizes, paths and the device changed gets past the
    config checks (agent loop and reward chosen as the original ran, logged) to the retriever's
    check: nothing listens at the original's URL here, so that check stops it."""
    from conftest import free_port
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    # its trainer.logger=['wandb'] too: the wandb package is not among the test dependencies, and a
    # missing tracker package stops the run before the retriever's check (tests/verl/utils/test_tracking.py)
    line = [o for o in ORIGINAL_GRPO
            if not o.startswith(("retriever.url", "trainer.n_gpus_per_node", "trainer.logger"))]
    r = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *line, f"retriever.url={url}",
                        "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.logger=[console]",
                        f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "which ran with actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop and " \
           "reward.function=search_r1.rewards:score_for" in r.stdout + r.stderr   # Hydra's log: stdout
    assert "start-up check failed" in r.stderr and url in r.stderr
