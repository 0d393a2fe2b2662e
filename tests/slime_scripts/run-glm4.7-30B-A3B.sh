#!/bin/bash
# slime's scripts/run-glm4.7-30B-A3B.sh (THUDM/slime 624b824) ported as a user would: the paths
# point at the test stand-ins (a tiny GLM-4.7-Flash with one DeepSeek-V3-style MTP layer, its
# flags in models/tiny-glm4.7-flash.sh; the arithmetic set for dapo-math and aime-2024), and
# the layout fits the 2-rank CPU stand-in (slime's TP2 x PP2 x CP2 x EP8 over 8 GPUs is PP2
# here, the MTP layer on the last stage: context parallelism needs TransformerEngine, MLA under
# TP needs sequence parallelism on it, and the stand-in has 4 experts); DeepEP's dispatcher is
# CUDA-only (alltoall here), as is the CPU optimizer offload. The pkill lines are dropped (they would end the test); the
# proxy unset and the NVLink probe stay. The test launches it as 2 ranks.

set -ex

# will prevent ray from buffering stdout/stderr
export PYTHONUNBUFFERED=1

unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY

NVLINK_COUNT=$(nvidia-smi topo -m 2>/dev/null | grep -o 'NV[0-9][0-9]*' | wc -l)
if [ "$NVLINK_COUNT" -gt 0 ]; then
    HAS_NVLINK=1
else
    HAS_NVLINK=0
fi
echo "HAS_NVLINK: $HAS_NVLINK (detected $NVLINK_COUNT NVLink references)"

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/tiny-glm4.7-flash.sh"

CKPT_ARGS=(
   --hf-checkpoint ${GLM47_MTP_DIR}
   --ref-load ${GLM47_MTP_DIR}
)

ROLLOUT_ARGS=(
   --prompt-data ${DATA_DIR}/train.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle

   --rm-type deepscaler

   --num-rollout 3000
   --rollout-batch-size 128
   --n-samples-per-prompt 8
   --rollout-max-response-len 8  # 32768 in slime: the stand-in's context
   --rollout-temperature 1.0

   --global-batch-size 1024
   #--balance-data
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime24 ${DATA_DIR}/eval.jsonl
   --n-samples-per-eval-prompt 2
   --eval-max-response-len 8  # 32768 in slime
   --eval-temperature 1.0
   --eval-top-p 0.95
)

PERF_ARGS=(
   --tensor-model-parallel-size 1  # 2 in slime
   --sequence-parallel
   --pipeline-model-parallel-size 2
   --context-parallel-size 1  # 2 in slime
   --expert-model-parallel-size 1  # 8 in slime
   --expert-tensor-parallel-size 1
   --decoder-last-pipeline-num-layers 1  # 23 of 47 in slime

   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1

   --use-dynamic-batch-size
   --max-tokens-per-gpu 32768
)

MTP_ARGS=(
   --mtp-num-layers 1
   --enable-mtp-training
   --mtp-loss-scaling-factor 0.2
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --kl-coef 0.00
   --entropy-coef 0.00
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98

   # --optimizer-cpu-offload and --overlap-cpu-optimizer-d2h-h2d: CUDA-only (the stand-in)
   --use-precision-aware-optimizer
)

WANDB_ARGS=(
   # --use-wandb
   # --wandb-project slime-dev
   # --wandb-group glm4.7-flash
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 2  # 8 in slime: the test world has 2 ranks
   --sglang-mem-fraction-static 0.8
   --sglang-enable-dp-attention
   --sglang-dp-size 8
   --sglang-enable-dp-lm-head
   --sglang-moe-dense-tp-size 1

   # mtp
   --sglang-speculative-algorithm EAGLE
   --sglang-speculative-num-steps 3
   --sglang-speculative-eagle-topk 1
   --sglang-speculative-num-draft-tokens 4

   --sglang-cuda-graph-max-bs 64

   --sglang-max-running-requests 512
)

MISC_ARGS=(
   # default dropout in megatron is 0.1
   --attention-dropout 0.0
   --hidden-dropout 0.0
   # should be good for model performance
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   # need to comment this when using model with MLA
   --attention-backend flash

   --moe-token-dispatcher-type alltoall  # flex with --moe-enable-deepep in slime
)

# launch the master node of ray in container
export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
ray start --head --node-ip-address ${MASTER_ADDR} --num-gpus 8 --disable-usage-stats --dashboard-host=0.0.0.0 --dashboard-port=8265

# Build the runtime environment JSON with proper variable substitution
RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"PYTHONPATH\": \"/root/Megatron-LM/\",
    \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\",
    \"NVSHMEM_DISABLE_NCCL\": \"1\",
    \"NCCL_NVLS_ENABLE\": \"${HAS_NVLINK}\"
  }
}"

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json="${RUNTIME_ENV_JSON}" \
   -- python3 train.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node ${NUM_GPUS:-2} \
   --colocate \
   --run-dir ${RUN_DIR}/logs \
   ${MODEL_ARGS[@]} \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${GRPO_ARGS[@]} \
   ${WANDB_ARGS[@]} \
   ${PERF_ARGS[@]} \
   ${EVAL_ARGS[@]} \
   ${SGLANG_ARGS[@]} \
   ${MISC_ARGS[@]} \
   ${MTP_ARGS[@]}
