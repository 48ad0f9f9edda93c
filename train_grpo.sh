#!/usr/bin/env bash
# GRPO in the paper's setting (configs/search_r1_grpo.yaml): Qwen2.5-3B, NQ + HotpotQA, e5 top-3
# retrieval, 8 GPUs. Start the retrieval server first (bash retrieval_launch.sh). Any key can be
# overridden:   bash train_grpo.sh trainer.n_gpus_per_node=4 data.train_batch_size=256
set -euo pipefail
ALGORITHM=${ALGORITHM:-grpo}
DATA_DIR=${DATA_DIR:-data/nq_hotpotqa}
BASE_MODEL=${BASE_MODEL:-Qwen/Qwen2.5-3B}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-nq_hotpotqa-$ALGORITHM-qwen2.5-3b}
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}

exec "${PYTHON:-python3}" -m verl.trainer.main_ppo --config-name "search_r1_$ALGORITHM" \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    actor_rollout_ref.model.path="$BASE_MODEL" \
    trainer.experiment_name="$EXPERIMENT_NAME" \
    trainer.default_local_dir="checkpoints/$EXPERIMENT_NAME" \
    "$@"
