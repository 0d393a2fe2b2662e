# Megatron architecture flags of a tiny Qwen3.5-MoE (vime_shell.models.tiny_model's
# qwen3_5_moe, 4 layers), written the way slime's scripts/models/qwen3.5-35B-A3B.sh writes them
NLAYERS=4
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
   --spec "slime_plugins.models.qwen3_5" "get_qwen3_5_spec"

   --disable-bias-linear
   --qk-layernorm
   --group-query-attention
   --num-attention-heads 4
   --num-query-groups 2
   --kv-channels 16
   --num-layers 4
   --hidden-size 64
   --ffn-hidden-size 32
   --use-gated-attention

   --normalization RMSNorm
   --apply-layernorm-1p
   --position-embedding-type rope
   --norm-epsilon 1e-6
   --rotary-percent 0.25
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 128

   --rotary-base 10000

   # moe
   --moe-ffn-hidden-size 32
   --moe-shared-expert-intermediate-size 48
   --moe-router-score-function softmax
   --moe-token-dispatcher-type alltoall
   --moe-router-topk 2
   --moe-layer-freq "$MOE_LAYER_FREQ"
   --num-experts 4
   # --moe-grouped-gemm  (CUDA-only, as is --moe-permute-fusion: the CPU stand-in drops them)
   --moe-token-drop-policy probs
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0

   # qwen3.5 specific
   --attention-output-gate
   --moe-shared-expert-gate
)
