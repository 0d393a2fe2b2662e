# Megatron architecture flags of a tiny MiniMax-M2 (vime_shell.models.tiny_model's minimax_m2),
# written the way slime's scripts/models/minimax-m2.sh writes them for MiniMax-M2.5
MODEL_ARGS=(
    --spec "slime_plugins.models.minimax_m2" "get_minimax_m2_layer_spec"
    --disable-bias-linear
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 32
    --num-attention-heads 4
    --kv-channels 16
    --num-query-groups 2
    --normalization RMSNorm
    --position-embedding-type rope
    --norm-epsilon 1e-6
    --swiglu
    --untie-embeddings-and-output-weights
    --vocab-size 20
    --group-query-attention

    --rotary-percent 0.5
    --rotary-base 10000
    --qk-layernorm
    --no-rope-fusion
    --attention-softmax-in-fp32

    # MoE
    --num-experts 4
    --moe-ffn-hidden-size 32
    --moe-router-topk 2
    --moe-layer-freq "[1]*2"
    --moe-router-pre-softmax
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-load-balancing-type none
    --moe-token-dispatcher-type alltoall
    --moe-router-dtype fp32
    --moe-aux-loss-coeff 0
    # --moe-grouped-gemm  (CUDA-only, as is --moe-permute-fusion: the CPU stand-in drops them)
)
