#!/bin/bash
# slime's examples/delta_weight_sync/run-glm4.7-30B-A3B-delta.sh (THUDM/slime 624b824) ported as
# a user would: the paths point at the test stand-ins (a tiny GLM-4.7-Flash, its flags in
# models/tiny-glm4.7-flash.sh; the arithmetic set for dapo-math), and the layout fits the
# 2-rank CPU stand-in (slime's TP2 x PP2 x CP2 x EP8 over 16 GPUs is EP2 here: context
# parallelism needs TransformerEngine, and MLA under TP needs sequence parallelism on it).
# The delta disk sync is accepted with a note: vime syncs in-process.

# Disk delta weight-sync demo on GLM-4.7-Flash (30B-A3B), non-colocated, 2 nodes x 8 GPU.
# The trainer publishes per-tensor deltas to --update-weight-disk-dir as a canonical HF directory;
# each engine's /pull_weights applies them into --update-weight-local-checkpoint-dir on every host
# it spans, and the engine reloads via the vanilla update_weights_from_disk path.
#
# Prerequisites:
#   - A 2-node (16-GPU) Ray cluster, this script run on the head node.
#   - GLM-4.7-Flash HF checkpoint + its torch_dist conversion (tools/convert_hf_to_torch_dist.py).
#   - dapo-math-17k.jsonl.
#   - --update-weight-disk-dir on a filesystem both nodes share. On an object-store-backed volume
#     that needs an explicit commit/refresh to surface writes across hosts, also pass
#     --custom-update-weight-post-write-path / --sglang-custom-pull-weights-pre-read-hook (see the doc).

set -ex
export PYTHONUNBUFFERED=1

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/tiny-glm4.7-flash.sh"

MODEL_DIR=${GLM47_DIR}
DATA_PATH=${DATA_DIR}/train.jsonl

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --ref-load "${MODEL_DIR}"
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_PATH}"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3
   --rollout-batch-size 32
   --n-samples-per-prompt 4
   --rollout-max-response-len 8  # 8192 in slime: the stand-in's context
   --global-batch-size 128
)

# Disk delta weight sync (the point of this example).
WEIGHT_SYNC_ARGS=(
   --update-weight-mode delta
   --update-weight-transport disk
   --update-weight-disk-dir ${RUN_DIR}/glm47-delta-updates
   --update-weight-local-checkpoint-dir ${RUN_DIR}/glm47-rollout-ckpt
   --update-weight-delta-encoding xor
   --update-weight-delta-checksum xxh3-128
)

PERF_ARGS=(
   --tensor-model-parallel-size 1  # 2 in slime
   --pipeline-model-parallel-size 1  # 2 in slime
   --context-parallel-size 1  # 2 in slime
   --expert-model-parallel-size 2  # 8 in slime
   --expert-tensor-parallel-size 1
   --sequence-parallel
   --use-dynamic-batch-size
   --max-tokens-per-gpu 32768
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   # --optimizer-cpu-offload  (CUDA-only, as is --overlap-cpu-optimizer-d2h-h2d: the CPU
   # --overlap-cpu-optimizer-d2h-h2d   stand-in drops them)
   --use-precision-aware-optimizer
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.0
   --kl-loss-type low_var_kl
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 1  # 8 in slime
   --sglang-mem-fraction-static 0.8
   --sglang-enable-dp-attention
   --sglang-dp-size 1  # 8 in slime
)

RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"PYTHONPATH\": \"/root/Megatron-LM/:${SCRIPT_DIR}\",
    \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\"
  }
}"

# Non-colocated: 16 actor GPUs (2 x 8) train while a 16-GPU rollout pool generates (delta mode
# requires non-colocation).
ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json="${RUNTIME_ENV_JSON}" \
   -- python3 train.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 2 \
   --rollout-num-gpus 2 \
   --run-dir ${RUN_DIR}/logs \
   ${MODEL_ARGS[@]} \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${WEIGHT_SYNC_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${SGLANG_ARGS[@]}"
