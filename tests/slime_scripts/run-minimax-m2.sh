#!/bin/bash
# slime's scripts/run-minimax-m2.sh (THUDM/slime 624b824) ported as a user would: the paths
# point at the test stand-ins (a tiny MiniMax-M2 for MiniMax-M2.5, its flags in
# models/tiny-minimax-m2.sh; the arithmetic set for dapo-math and aime; the pkill lines are
# dropped). Sizes and parallelism that do not fit the 2-rank CPU stand-in say so where they
# change. The test launches it as 2 ranks.

set -ex

export PYTHONBUFFERED=16

NVLINK_COUNT=$(nvidia-smi topo -m 2>/dev/null | grep -o 'NV[0-9][0-9]*' | wc -l)
if [ "$NVLINK_COUNT" -gt 0 ]; then
    HAS_NVLINK=1
else
    HAS_NVLINK=0
fi
echo "HAS_NVLINK: $HAS_NVLINK (detected $NVLINK_COUNT NVLink references)"

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/tiny-minimax-m2.sh"

# ---- Paths (modify according to your environment) ----
BASE_DIR=${BASE_DIR:-"/root"}

CKPT_ARGS=(
   --hf-checkpoint ${MINIMAX_DIR}
   --ref-load ${MINIMAX_DIR}  # slime's torch_dist conversion: vime loads the HF weights
   --load ${RUN_DIR}/ckpt/
   --save ${RUN_DIR}/ckpt/
   --save-interval 20
   --model-name minimax_m2
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
   --rollout-temperature 1

   --over-sampling-batch-size 256
   --dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std

   --num-steps-per-rollout 4
   --balance-data
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime ${DATA_DIR}/eval.jsonl
   --n-samples-per-eval-prompt 8
   --eval-max-response-len 8  # 32768 in slime
   --eval-top-p 1
)

# ---- Parallelism Strategy ----
# 229B MoE, 256 experts -> requires many GPUs
# Typical config: TP=2, PP=2, EP=4, training side 16 GPUs (2 nodes x 8 GPUs)
# Inference side: SGLang on separate GPUs, EP=16+
PERF_ARGS=(
   --tensor-model-parallel-size 1  # 2 in slime: MoE under TP needs sequence parallelism (TE)
   --sequence-parallel
   --pipeline-model-parallel-size 1  # 2 in slime
   --context-parallel-size 1
   --expert-model-parallel-size 2  # 4 in slime
   --expert-tensor-parallel-size 1

   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1

   --use-dynamic-batch-size
   --max-tokens-per-gpu 8192
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98

   # --optimizer-cpu-offload  (CUDA-only, as is --overlap-cpu-optimizer-d2h-h2d: the CPU
   # --overlap-cpu-optimizer-d2h-h2d   stand-in drops them)
   --use-precision-aware-optimizer
)

WANDB_ARGS=(
   # --use-wandb
   # --wandb-project slime-dev
   # --wandb-group minimax-m2-rl
   # --wandb-key ${WANDB_KEY}
)

TB_ARGS=(
   --use-tensorboard
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 1  # 16 in slime
   --sglang-mem-fraction-static 0.7
   --sglang-ep-size 16
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

# launch the master node of ray in container
export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
export no_proxy="127.0.0.1,${MASTER_ADDR}"
ray start --head --node-ip-address ${MASTER_ADDR} --num-gpus 2 --disable-usage-stats --dashboard-host=0.0.0.0 --dashboard-port=8265

RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"no_proxy\": \"localhost,127.0.0.1,0.0.0.0,${MASTER_ADDR}\",
    \"MASTER_ADDR\": \"${MASTER_ADDR}\",
    \"PYTHONPATH\": \"/root/Megatron-LM/\",
    \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\",
    \"NCCL_NVLS_ENABLE\": \"${HAS_NVLINK}\"
  }
}"

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json="${RUNTIME_ENV_JSON}" \
   -- python3 train.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 2 \
   --run-dir ${RUN_DIR}/logs \
   --colocate \
   ${MODEL_ARGS[@]} \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${OPTIMIZER_ARGS[@]} \
   ${GRPO_ARGS[@]} \
   ${WANDB_ARGS[@]} \
   ${TB_ARGS[@]} \
   ${PERF_ARGS[@]} \
   ${EVAL_ARGS[@]} \
   ${SGLANG_ARGS[@]} \
   ${MISC_ARGS[@]}
