# Megatron architecture flags of the embedded tiny Qwen2 (vime checks them against its config.json)
MODEL_ARGS=(
   --swiglu
   --num-layers 2
   --hidden-size 128
   --ffn-hidden-size 256
   --num-attention-heads 2
   --group-query-attention
   --num-query-groups 2
   --use-rotary-position-embeddings
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base "${MODEL_ARGS_ROTARY_BASE:-10000}"
   --vocab-size 20
   --kv-channels 64
   --untie-embeddings-and-output-weights
)
