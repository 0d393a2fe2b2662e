# Megatron architecture flags of a tiny MiMo (a tiny Qwen2 whose last layer became MTP layer 0
# under MiMo's names, tests/shell/mtp_workers.as_mimo), written the way slime's
# scripts/models/mimo-7B-rl.sh writes them
MODEL_ARGS=(
    --swiglu
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 128
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --use-rotary-position-embeddings
    --disable-bias-linear
    --add-qkv-bias
    --normalization "RMSNorm"
    --norm-epsilon 1e-06
    --rotary-base 10000
    --vocab-size 128
    --kv-channels 16
    --untie-embeddings-and-output-weights
    --max-position-embeddings 512
    --mtp-num-layers 1
)
