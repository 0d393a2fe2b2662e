# Megatron architecture flags of a tiny dense Qwen3.5 (vime_shell.models.tiny_model's qwen3_5,
# 4 layers), written the way slime's scripts/models/qwen3.5-27B.sh writes them
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
   --ffn-hidden-size 128
   --use-gated-attention

   --normalization RMSNorm
   --apply-layernorm-1p
   --position-embedding-type rope
   --norm-epsilon 1e-6
   --rotary-percent 0.25
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 20

   --rotary-base 10000

   # qwen3.5 specific
   --attention-output-gate
)
