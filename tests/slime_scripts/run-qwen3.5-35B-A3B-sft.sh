#!/bin/bash
# slime's scripts/run-qwen3.5-35B-A3B-sft.sh (THUDM/slime 624b824) ported as a user would: the
# paths point at the test stand-ins (a tiny Qwen3.5-MoE with a character-level tokenizer and a
# Qwen3.5-shaped chat template, its flags in models/tiny-qwen3.5-moe.sh; a JSONL of
# conversations for openhermes2_5.parquet; the pkill lines, the BASE_FOLDER check and the
# multi-node worker start are dropped). Sizes and parallelism that do not fit the 2-rank CPU
# stand-in say so where they change. The test launches it as 2 ranks.

set -ex


MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}  # required in slime
if [ -z "${MASTER_ADDR}" ]; then
  echo "MASTER_ADDR is not set. Please set it to the master node address."
  exit 1
fi
# export MASTER_ADDR="127.0.0.1"

# will prevent ray from buffering stdout/stderr
export PYTHONUNBUFFERED=1

NVLINK_COUNT=$(nvidia-smi topo -m 2>/dev/null | grep -o 'NV[0-9][0-9]*' | wc -l)
if [ "$NVLINK_COUNT" -gt 0 ]; then
    HAS_NVLINK=1
else
    HAS_NVLINK=0
fi
echo "HAS_NVLINK: $HAS_NVLINK (detected $NVLINK_COUNT NVLink references)"

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/tiny-qwen3.5-moe.sh"

CKPT_ARGS=(
   --hf-checkpoint ${QWEN35_MOE_DIR}
   --ref-load ${QWEN35_MOE_DIR}  # slime's torch_dist conversion: vime loads the HF weights
   --load ${RUN_DIR}/ckpt/
   --save ${RUN_DIR}/ckpt/
   --save-interval 20
)

SFT_ARGS=(
   --rollout-function-path slime.rollout.sft_rollout.generate_rollout
   --prompt-data ${DATA_DIR}/qwen35_conversations.jsonl
   --input-key messages
   --rollout-shuffle
   --num-epoch 3
   --rollout-batch-size 16  # 128 in slime: the stand-in set has 16 conversations
   --global-batch-size 16

   --loss-type sft_loss
   --loss-mask-type qwen3_5
   --calculate-per-token-loss
   --disable-compute-advantages-and-returns
   --debug-train-only
)

PERF_ARGS=(
   --tensor-model-parallel-size 1  # 2 in slime: MoE under TP needs sequence parallelism (TE)
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 2  # 8 in slime
   --expert-tensor-parallel-size 1

   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1

   # --micro-batch-size 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 8192
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-5
   --lr-decay-style cosine
   --min-lr 1e-6
   --lr-warmup-fraction 0.1
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
   
   --use-distributed-optimizer
   # --optimizer-cpu-offload  (CUDA-only, as is --overlap-cpu-optimizer-d2h-h2d: the CPU
   # --overlap-cpu-optimizer-d2h-h2d   stand-in drops them)
   --use-precision-aware-optimizer
)

WANDB_ARGS=(
   # --use-wandb
   # --wandb-project slime-dev
   # --wandb-group qwen3.5-35B-sft
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

   # --moe-token-dispatcher-type flex  (DeepEP is CUDA-only: the CPU stand-in drops both)
   # --moe-enable-deepep
)

SPEC_ARGS=(
#    --mtp-num-layers 1
#    --enable-mtp-training
#    --mtp-loss-scaling-factor 0.1
)

# launch the master node of ray in container
export no_proxy="127.0.0.1,${MASTER_ADDR}"
ray start --head --node-ip-address ${MASTER_ADDR} --num-gpus 2 --disable-usage-stats --dashboard-host=0.0.0.0 --dashboard-port=8265


# Build the runtime environment JSON with proper variable substitution
RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"PYTHONPATH\": \"/root/Megatron-LM/\",
    \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\",
    \"NVSHMEM_DISABLE_NCCL\": \"1\",
    \"NCCL_NVLS_ENABLE\": \"${HAS_NVLINK}\",
    \"no_proxy\": \"${no_proxy}\",
    \"MASTER_ADDR\": \"${MASTER_ADDR}\",
    \"PYTORCH_CUDA_ALLOC_CONF\": \"expandable_segments:True\"
  }
}"

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json="${RUNTIME_ENV_JSON}" \
   -- python3 train_async.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 2 \
   --run-dir ${RUN_DIR}/logs \
   ${MODEL_ARGS[@]} \
   ${CKPT_ARGS[@]} \
   ${SFT_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${WANDB_ARGS[@]} \
   ${PERF_ARGS[@]} \
   ${EVAL_ARGS[@]} \
   ${MISC_ARGS[@]} \
   ${SPEC_ARGS[@]}
