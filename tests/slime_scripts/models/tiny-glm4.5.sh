# Megatron architecture flags of a tiny GLM-4.5 MoE (vime_shell.models.tiny_model's glm4_moe),
# written the way slime's scripts/models/glm4.5-355B-A32B.sh writes them (its arithmetic too)
N_DENSE_LAYERS=1
N_MOE_LAYERS=1

# glm4.5-355B-A32B
MODEL_ARGS=(
    --disable-bias-linear
    --qk-layernorm
    --group-query-attention
    --num-attention-heads 4
    --num-query-groups 2
    --kv-channels 16
    --num-layers $((N_DENSE_LAYERS + N_MOE_LAYERS))
    --hidden-size 64
    --ffn-hidden-size 128

    --add-qkv-bias
     --normalization RMSNorm
    --position-embedding-type rope
    --rotary-percent 0.5
    --swiglu
    --untie-embeddings-and-output-weights
    --vocab-size 20

    --rotary-base 10000

    # moe
    --moe-ffn-hidden-size 32
    --moe-shared-expert-intermediate-size 32
    --moe-router-pre-softmax
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 0
    --moe-router-load-balancing-type seq_aux_loss
    --moe-token-dispatcher-type alltoall
    --moe-router-topk 2
    --moe-router-topk-scaling-factor 2.5
    --moe-layer-freq [0]*$N_DENSE_LAYERS+[1]*$N_MOE_LAYERS
    --num-experts 4
    # --moe-grouped-gemm  (CUDA-only, as is --moe-permute-fusion: the CPU stand-in drops them)
    --moe-router-dtype fp32
    --moe-aux-loss-coeff 0
)
