#!/bin/bash
# A miles-style launch with a remote reward model and a slime async custom reward.
set -ex

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/tiny-qwen2.sh"

ROLLOUT_ARGS=(
   --prompt-data ${DATA_DIR}/train.jsonl
   --input-key prompt
   --label-key label
   --custom-rm-path slime_plugins.async_rm
   --rm-url http://127.0.0.1:9/reward
   --num-rollout 10
   --rollout-batch-size 4
   --n-samples-per-prompt 4
   --rollout-max-response-len 8
   --global-batch-size 16
)

ray job submit --address="http://127.0.0.1:8265" -- python3 train.py \
   --hf-checkpoint ${MODEL_DIR} \
   --run-dir ${RUN_DIR}/logs \
   ${MODEL_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   --vllm-max-num-seqs 64 \
   --sglang-chunked-prefill-size 4096
