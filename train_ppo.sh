#!/usr/bin/env bash
# PPO (GAE with a critic) in the paper's setting: Qwen2.5-3B, NQ + HotpotQA, e5 top-3 retrieval, 8 GPUs.
# Start the retrieval server first (bash retrieval_launch.sh). Any key can be overridden:
#   bash train_ppo.sh trainer.n_gpus_per_node=4 data.train_batch_size=256
set -euo pipefail
DATA_DIR=${DATA_DIR:-data/nq_hotpotqa}
BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-3B}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-nq_hotpotqa-ppo-qwen2.5-3b}
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}

exec "${PYTHON:-python3}" -m verl.trainer.main_ppo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=512 \
    data.val_batch_size=256 \
    data.max_prompt_length=4096 \
    data.max_response_length=500 \
    data.max_obs_length=500 \
    algorithm.adv_estimator=gae \
    algorithm.use_kl_in_reward=true \
    actor_rollout_ref.model.path="$BASE_MODEL" \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.model.use_torch_compile=true \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285 \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size=64 \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.state_masking=true \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n_agent=1 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=128 \
    actor_rollout_ref.rollout.agent_loop=search_r1.agent.loop:SearchAgentLoop \
    actor_rollout_ref.ref.log_prob_micro_batch_size=128 \
    critic.optim.lr=1e-5 \
    critic.optim.lr_warmup_steps_ratio=0.015 \
    critic.ppo_micro_batch_size=64 \
    reward.function=search_r1.rewards:score_for \
    max_turns=2 \
    retriever.url="http://127.0.0.1:8000/retrieve" \
    retriever.topk=3 \
    trainer.logger=[console,jsonl,wandb] \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=100 \
    trainer.test_freq=50 \
    trainer.total_training_steps=1005 \
    trainer.project_name=search_r1 \
    trainer.experiment_name="$EXPERIMENT_NAME" \
    trainer.default_local_dir="checkpoints/$EXPERIMENT_NAME" \
    "$@"
