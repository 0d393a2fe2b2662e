"""Multi-latent attention models (DeepSeek-V3/R1, Kimi-K2, Moonlight): the adjustments mbridge
0.15's DeepSeek-V3 bridge needs on megatron-core 0.16 and on CPU, measured here.

1. Config names: mbridge passes ``max_position_embeddings`` where megatron-core 0.16's
   ``MLATransformerConfig`` calls the YaRN field ``original_max_position_embeddings`` (a
   ``TypeError`` before this), and reads RoPE scaling from ``rope_scaling``, which transformers
   5 moved into ``rope_parameters`` (a YaRN checkpoint would silently run plain RoPE).
2. Multi-token prediction: mbridge builds ``num_nextn_predict_layers`` MTP layers with
   TransformerEngine hard-coded, for DeepSeek-V3's 61 layers only. Without
   ``--enable-mtp-training`` none is built (as slime's DeepSeek scripts run; ``--save-hf``
   copies the checkpoint's unchanged, ``vime_shell.storage.untrained``); with it
   :mod:`vime_shell.megatron.mtp` builds, maps and trains them.
3. Routing as the HF model routes: group-limited top-k (``n_group`` / ``topk_group``, which
   mbridge drops) and a fixed expert bias (``moe_router_bias_update_rate=0``, as slime's
   scripts pass: an RL step must not move the routing the engine used).
4. Core attention: MLA's query/key heads (``qk_head_dim + qk_pos_emb_head_dim``) are wider
   than its value heads (``v_head_dim``), which Megatron's local ``DotProductAttention`` cannot
   hold; :class:`MLACoreAttention` is the local spec's core attention for it (scaled dot
   product over the record's mask), and the local norm names map to HF's.

Example: ``DeepseekV3(hf_config, dtype=torch.float32)`` is the bridge of a ``deepseek_v3``
checkpoint (``bridge.make_bridge`` picks it by ``model_type``).
"""

import math

import torch
from mbridge.core.bridge import Bridge
from mbridge.core.llm_bridge import LLMBridge
from mbridge.models.deepseek_v3 import DeepseekV3Bridge
from megatron.core.transformer.module import MegatronModule

from vime_shell.megatron.attention import causal_mask, softmax_attention
from vime_shell.models.hf_config import MLA_MODEL_TYPES, ModelLoadError


# the local spec's MLA norms -> HF names (TransformerEngine fuses them into the projections)
MLA_LOCAL_NORM_NAMES = {
    "self_attention.q_layernorm.weight": "model.layers.{n}.self_attn.q_a_layernorm.weight",
    "self_attention.kv_layernorm.weight": "model.layers.{n}.self_attn.kv_a_layernorm.weight",
}


def is_mla(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) in MLA_MODEL_TYPES


class DeepseekV3(DeepseekV3Bridge):
    """mbridge's DeepSeek-V3 bridge with adjustments 1-4 (module docstring)."""

    EXTRA_NORM_NAMES = MLA_LOCAL_NORM_NAMES  # the local spec's norms (bridge.make_bridge)

    def adapt_layer_spec(self, spec, *, transformer_engine: bool, vp_stage=None):
        """The block spec with :class:`MLACoreAttention` on the local spec (adjustment 4)."""
        if not transformer_engine:
            for layer in spec.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = MLACoreAttention
        return spec

    def _build_base_config(self, text_config_key=None, **kwargs):
        hf = self.hf_config
        kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
        kwargs.pop("mtp_num_layers", None)
        kwargs.pop("mtp_loss_scaling_factor", None)
        kwargs.update(_yarn_fields(getattr(hf, "rope_parameters", None) or {}))
        groups = int(getattr(hf, "n_group", 1) or 1)
        if groups > 1:
            kwargs.update(moe_router_num_groups=groups,
                          moe_router_group_topk=int(hf.topk_group))
        kwargs["moe_router_bias_update_rate"] = 0.0
        return super()._build_base_config(text_config_key, **kwargs)

    # mbridge's DeepSeek-V3 provider builds any MTP block with TransformerEngine hard-coded;
    # the plain provider takes the block spec bridge.make_bridge gives (megatron/mtp.py)
    _model_provider = LLMBridge._model_provider

    def _get_safetensor_io(self, weights_path: str):
        # mbridge reads DeepSeek's FP8 release dequantised to bf16 and raises for any other
        # dtype; an fp32 (CPU) or unquantised checkpoint is plain safetensors
        if self.dtype == torch.bfloat16:
            return super()._get_safetensor_io(weights_path)
        return Bridge._get_safetensor_io(self, weights_path)


def _yarn_fields(rope: dict) -> dict:
    """Megatron's YaRN fields from transformers 5's ``rope_parameters`` (empty for plain RoPE);
    MLA in Megatron has no other scaling."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return {}
    if kind != "yarn":
        raise ModelLoadError(f"rope_parameters.rope_type={kind!r}: Megatron's multi-latent "
                             "attention applies plain RoPE or YaRN only. Fix: use a checkpoint "
                             "with one of those, as DeepSeek-V3, Kimi-K2 and Moonlight have.")
    return {"rope_type": "yarn", "rotary_scaling_factor": float(rope["factor"]),
            "mscale": float(rope.get("mscale", 1.0)),
            "mscale_all_dim": float(rope.get("mscale_all_dim", 0.0)),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast", 32)),
            "beta_slow": float(rope.get("beta_slow", 1))}


class MLACoreAttention(MegatronModule):
    """Softmax attention for MLA on the local spec: queries and keys ``[s, b, h, dk]``, values
    ``[s, b, h, dv]`` (``dv`` may differ), the mask ``[b or 1, 1, s, s]`` with True where a
    token may not look (the record's block-diagonal causal mask), or causal when None.
    Returns ``[s, b, h * dv]``, as ``DotProductAttention`` does."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout=None, softmax_scale=None, k_channels=None,
                 v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale if softmax_scale is not None \
            else 1.0 / math.sqrt(k_channels or config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_mask is None:
            attention_mask = causal_mask(query.shape[0], query.device)
        return softmax_attention(query, key, value, attention_mask, self.softmax_scale)
