# Megatron architecture flags of a tiny GLM-5 (vime_shell.models.tiny_model's glm_moe_dsa:
# DeepSeek-V3's model with DeepSeek sparse attention), written the way slime's
# scripts/models/glm5-744B-A40B.sh writes them (its arithmetic too)
MOE_ROUTED_EXPERTS=4
MOE_ACTIVE_ROUTED_EXPERTS=2
MOE_SHARED_EXPERTS=1

NHIDDEN=64
MOE_FFN_HIDDEN=32
MOE_SHARED_EXPERT_INTERMEDIATE_SIZE=$(($MOE_FFN_HIDDEN * $MOE_SHARED_EXPERTS))
FFN_HIDDEN=128
N_DENSE_LAYERS=1
N_MOE_LAYERS=3
NHEADS=4

MODEL_ARGS=(
   --spec "slime_plugins.models.glm5.glm5" "get_glm5_spec"
    --moe-layer-freq [0]*$N_DENSE_LAYERS+[1]*$N_MOE_LAYERS
    --num-experts $MOE_ROUTED_EXPERTS
    --moe-shared-expert-intermediate-size $MOE_SHARED_EXPERT_INTERMEDIATE_SIZE
    --moe-router-topk $MOE_ACTIVE_ROUTED_EXPERTS
    # --moe-grouped-gemm  (CUDA-only, as is --moe-permute-fusion: the CPU stand-in drops them)
    --moe-ffn-hidden-size $MOE_FFN_HIDDEN
    --moe-router-score-function sigmoid
    --moe-router-pre-softmax
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 0
    --moe-router-load-balancing-type seq_aux_loss
    --moe-router-topk-scaling-factor 2.5
    --moe-aux-loss-coeff 0
    --moe-router-dtype fp32
    --make-vocab-size-divisible-by 16
    --num-layers $((N_DENSE_LAYERS + N_MOE_LAYERS))
    --hidden-size $NHIDDEN
    --ffn-hidden-size $FFN_HIDDEN
    --num-attention-heads $NHEADS
    --disable-bias-linear
    --swiglu
    --untie-embeddings-and-output-weights
    --position-embedding-type rope
    --no-position-embedding
    --normalization RMSNorm
    --qk-layernorm
    --multi-latent-attention
    --q-lora-rank 24
    --kv-lora-rank 16
    --qk-head-dim 16
    --v-head-dim 16
    --kv-channels 16
    --qk-pos-emb-head-dim 8
    --vocab-size 128
    --rotary-base 10000
    --enable-experimental

    # slime specific args
    --allgather-cp
)
