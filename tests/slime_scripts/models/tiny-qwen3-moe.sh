# Megatron architecture flags of a tiny Qwen3-MoE (vime_shell.models.tiny_model's qwen3_moe),
# written the way slime's scripts/models/qwen3-30B-A3B.sh writes them (the layer-pattern loop too)
NLAYERS=2
FIRST_K_DENSE_REPLACE=0

arr=()
for ((i=0; i<NLAYERS; i++)); do
  if (( i < FIRST_K_DENSE_REPLACE )); then
    arr+=(0)
  else
    arr+=(1)
  fi
done

printf -v MOE_LAYER_FREQ "[%s]" "$(IFS=', '; echo "${arr[*]}")"

MODEL_ARGS=(
   --disable-bias-linear
   --qk-layernorm
   --group-query-attention
   --num-attention-heads 4
   --num-query-groups 2
   --kv-channels 16
   --num-layers ${NLAYERS}
   --hidden-size 64
   --ffn-hidden-size 128

   --normalization RMSNorm
   --position-embedding-type rope
   --norm-epsilon 1e-6
   --rotary-percent 1.0
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 128

   --rotary-base "${MODEL_ARGS_ROTARY_BASE:-10000}"

   # moe
   --moe-ffn-hidden-size 32
   --moe-router-score-function softmax
   --moe-token-dispatcher-type alltoall
   --moe-router-topk 2
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --num-experts 4
   --moe-token-drop-policy probs
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
)
