#!/usr/bin/env bash
# PPO in the paper's setting (configs/search_r1_ppo.yaml): train_grpo.sh with the PPO preset.
#   bash train_ppo.sh trainer.n_gpus_per_node=4 data.train_batch_size=256
ALGORITHM=ppo exec bash "$(dirname "$0")/train_grpo.sh" "$@"
