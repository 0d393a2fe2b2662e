#!/bin/bash
# A slime-style DAPO launch: dict rewards through --reward-key, dynamic sampling with slime's
# filter signature, dual clip, static micro-batches, eval without --eval-interval.
set -ex

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/tiny-qwen2.sh"

CKPT_ARGS=(
   --hf-checkpoint ${MODEL_DIR}
   --save ${RUN_DIR}/ckpt
)

ROLLOUT_ARGS=(
   --prompt-data ${DATA_DIR}/train.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rm-type dapo
   --reward-key score
   --num-rollout 100
   --rollout-batch-size 4
   --n-samples-per-prompt 8
   --rollout-max-response-len 16
   --over-sampling-batch-size 8
   --dynamic-sampling-filter-path slime_plugins.check_reward_nonzero_std
   --custom-rollout-log-function-path slime_plugins.log_rollout_data
   --num-steps-per-rollout 2
)

EVAL_ARGS=(
   --eval-prompt-data arith ${DATA_DIR}/eval.jsonl
   --skip-eval-before-train
)

PERF_ARGS=(
   --micro-batch-size 4
   --max-tokens-per-gpu 4096
)

DAPO_ARGS=(
   --advantage-estimator grpo
   --kl-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
   --eps-clip-c 3.0
)

ray job submit --address="http://127.0.0.1:8265" -- python3 train.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 1 \
   --run-dir ${RUN_DIR}/logs \
   ${MODEL_ARGS[@]} \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${EVAL_ARGS[@]} \
   ${PERF_ARGS[@]} \
   ${DAPO_ARGS[@]} \
   --optimizer adam --lr 1e-6 \
   --sglang-enable-deterministic-inference \
   --sglang-ep-size 1
