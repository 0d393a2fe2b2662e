# Megatron architecture flags of a tiny Moonlight-shaped DeepSeek-V3 (vime_shell.models.
# tiny_model's deepseek_v3 without a query low-rank projection), written the way slime's
# scripts/models/moonlight.sh writes them (the layer-pattern loop too)
MOE_SHARED_EXPERTS=1
MOE_FFN_HIDDEN=32
MOE_SHARED_EXPERT_INTERMEDIATE_SIZE=$(($MOE_FFN_HIDDEN * $MOE_SHARED_EXPERTS))
MOE_ROUTER_TOPK_SCALING_FACTOR=2.5
NLAYERS=2
FIRST_K_DENSE_REPLACE=1

arr=()
for ((i=0; i<NLAYERS; i++)); do
  if (( i < FIRST_K_DENSE_REPLACE )); then
    arr+=(0)
  else
    arr+=(1)
  fi
done

printf -v MOE_LAYER_FREQ "[%s]" "$(IFS=', '; echo "${arr[*]}")"

# moonlight
MODEL_ARGS=(
    --disable-bias-linear
    --num-layers ${NLAYERS}
    --hidden-size 64
    --ffn-hidden-size 128
    --num-attention-heads 4
    --kv-channels 16
    --normalization RMSNorm
    --position-embedding-type rope
    --norm-epsilon 1e-6
    --rotary-percent 1.0
    --swiglu
    --untie-embeddings-and-output-weights
    --no-masked-softmax-fusion
    --vocab-size 128

    --multi-latent-attention
    --kv-lora-rank 16
    --qk-head-dim 16
    --qk-pos-emb-head-dim 8
    --v-head-dim 16
    --qk-layernorm
    --rotary-scaling-factor 1
    --rotary-base 10000
    --mscale 1.0
    --mscale-all-dim 1.0
    --attention-softmax-in-fp32
    --no-rope-fusion

    # moe
    --num-experts 4
    --moe-layer-freq "$MOE_LAYER_FREQ"
    --moe-ffn-hidden-size $MOE_FFN_HIDDEN
    --moe-router-topk 2
    --moe-shared-expert-intermediate-size $MOE_SHARED_EXPERT_INTERMEDIATE_SIZE
    --moe-router-pre-softmax
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-load-balancing-type seq_aux_loss
    --moe-token-dispatcher-type alltoall
    --moe-aux-loss-coeff 0
    --moe-router-bias-update-rate 0
    --moe-router-group-topk 1
    --moe-router-num-groups 1
    # --moe-grouped-gemm  (CUDA-only, as is --moe-permute-fusion: the CPU stand-in drops them)
    --moe-router-topk-scaling-factor $MOE_ROUTER_TOPK_SCALING_FACTOR
    --moe-token-drop-policy probs
    --moe-router-dtype fp32
    # --moe-permute-fusion
)
