"""Qwen3.5 (dense and MoE; ``model_type`` ``qwen3_5`` / ``qwen3_5_moe`` and their text models;
slime's ``--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec``) and Qwen3-Next
(``qwen3_next``, ``--spec slime_plugins.models.qwen3_next get_qwen3_next_spec``): Megatron's
GPT layers with linear attention in three of every four layers, and the HF mapping.

No kept library maps it (mbridge 0.15 has no Qwen3.5; Megatron's own gated delta-net needs
fla's Triton kernels, :mod:`vime_shell.megatron.linear_attention`), so vime writes the lines
that differ from Qwen3, whose bridge it extends:

- **Layer pattern**: HF ``layer_types``; a ``linear_attention`` layer's attention slot is
  :class:`~vime_shell.megatron.linear_attention.LinearAttention` (transformers' module), a
  ``full_attention`` layer's is Megatron's ``SelfAttention`` with q/k norms.
- **Gated attention** (slime's ``--attention-output-gate``): Megatron's
  ``attention_output_gate`` (the attention output times ``sigmoid(gate)``). HF's ``q_proj``
  holds each head's query then its gate; Megatron's ``linear_qkv`` holds, per KV group, the
  group's queries, then their gates, then the key and the value.
- **(1 + w) norms** (slime's ``--apply-layernorm-1p``): every norm multiplies by ``1 + w``
  (``layernorm_zero_centered_gamma``). TransformerEngine's norms have it; the local spec's
  torch norm refuses it, so :class:`OnePlusRMSNorm` takes each norm slot there. On
  TransformerEngine's spec the attention's input norm is fused into ``linear_qkv``, so a
  linear-attention layer gets a ``TENorm`` of its own.
- **RoPE** on the first ``partial_rotary_factor`` of each head (Qwen3.5's text positions are
  one-dimensional, where its multimodal RoPE is this).
- **Names**: transformers writes Qwen3.5's text model under ``model.language_model.`` (the
  multimodal checkpoint's layout, which ``Qwen3_5ForCausalLM`` writes too); the vision tower
  (``model.visual.*``) is neither loaded nor trained, and ``--save-hf`` copies it unchanged
  (``vime_shell.storage.untrained``). Qwen3-Next is text only.
- **MoE** (Qwen3.5-MoE, Qwen3-Next): Megatron's MoE layer with a softmax router and a shared
  expert behind a sigmoid gate, in mbridge's Qwen2-MoE names.

Example: ``Qwen3_5(text_config, dtype=torch.float32)`` is the bridge of a Qwen3.5 checkpoint
(``bridge.make_bridge`` picks it by ``model_type``).
"""

import copy
from collections.abc import Callable

import torch
from mbridge.models.qwen2moe import Qwen2MoEBridge
from mbridge.models.qwen3 import Qwen3Bridge
from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from vime_shell.megatron.linear_attention import linear_attention_spec

_TEXT_PREFIX = "model.language_model."  # where transformers writes Qwen3.5's language model


class OnePlusRMSNorm(torch.nn.Module):
    """RMSNorm scaled by ``1 + w``, in fp32, as transformers' Qwen3.5 norms (``w`` starts at
    0); the local spec's norm for ``--apply-layernorm-1p``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)  # TP all-reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def hybrid_spec(spec, hf_config, *, transformer_engine: bool, offset: int, gdn_class: type):
    """``spec`` (this stage's decoder block spec) with the layer pattern of ``hf_config`` (its
    ``layer_types``; ``offset``: the stage's first layer) and (1 + w) norms (module docstring)."""
    spec = copy.copy(spec)
    # a copy per layer: the layers of a block spec may share one record
    spec.layer_specs = [copy.deepcopy(layer) for layer in spec.layer_specs]
    if not transformer_engine:
        spec.layer_norm = OnePlusRMSNorm
    for i, layer in enumerate(spec.layer_specs):
        parts = layer.submodules
        if not transformer_engine:
            parts.input_layernorm = parts.pre_mlp_layernorm = OnePlusRMSNorm
        if hf_config.layer_types[offset + i] == "linear_attention":
            parts.self_attention = linear_attention_spec(hf_config, gdn_class)
            if transformer_engine:  # the fused norm went with linear_qkv
                parts.input_layernorm = TENorm
        elif not transformer_engine:
            parts.self_attention.submodules.q_layernorm = OnePlusRMSNorm
            parts.self_attention.submodules.k_layernorm = OnePlusRMSNorm
    return spec


def text_name(name: str) -> str:
    """An HF text-model name as transformers writes Qwen3.5's (``lm_head`` stays)."""
    return _TEXT_PREFIX + name.removeprefix("model.") if name.startswith("model.") else name


class Qwen3_5(Qwen3Bridge):
    """mbridge's Qwen3 bridge with Qwen3.5's layers, gated QKV, norms and names."""

    GDN_CLASS: type = Qwen3_5GatedDeltaNet
    HF_NAME: Callable[[str], str] | None = staticmethod(text_name)  # names' prefix (make_bridge)

    def adapt_layer_spec(self, spec, *, transformer_engine: bool, vp_stage=None):
        offset = get_transformer_layer_offset(self.config, vp_stage)
        return hybrid_spec(spec, self.hf_config, transformer_engine=transformer_engine,
                           offset=offset, gdn_class=self.GDN_CLASS)

    def _build_config(self):
        return self._build_base_config(**self._fields())

    def _fields(self) -> dict:
        """The ``TransformerConfig`` fields of Qwen3.5's layers (the run's options override)."""
        # linear_attention_freq (1: linear attention) only tells Megatron's checkpointing that
        # the layers differ, so each saves under its own key: the layers here come from
        # hybrid_spec, not from Megatron's experimental spec that also reads it
        pattern = [int(t == "linear_attention") for t in self.hf_config.layer_types]
        return dict(qk_layernorm=True, attention_output_gate=True,
                    layernorm_zero_centered_gamma=True, kv_channels=self.hf_config.head_dim,
                    linear_attention_freq=pattern)


    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        if ".linear_attn." in mcore_weights_name:  # transformers' module: its own names
            layer, rest = mcore_weights_name.split(".self_attention.")
            return [f"model.layers.{layer.split('.')[2]}.{rest}"]
        return super()._weight_name_mapping_mcore_to_hf(mcore_weights_name)

    def _weight_to_hf_format(self, mcore_weights_name, mcore_weights):
        if mcore_weights_name.endswith("self_attention.linear_qkv.weight"):
            names = self._weight_name_mapping_mcore_to_hf(mcore_weights_name)
            return names, list(split_gated_qkv(mcore_weights, self.hf_config))
        return super()._weight_to_hf_format(mcore_weights_name, mcore_weights)

    def _weight_to_mcore_format(self, mcore_weights_name, hf_weights):
        if mcore_weights_name.endswith("self_attention.linear_qkv.weight"):
            return merge_gated_qkv(*hf_weights, self.hf_config).to(self.dtype)
        return super()._weight_to_mcore_format(mcore_weights_name, hf_weights)


class Qwen3_5Moe(Qwen3_5):
    """Qwen3.5's MoE (``qwen3_5_moe``): every layer's MLP is a softmax top-k router whose
    top-k weights are renormalised, routed experts and a shared expert behind a sigmoid gate,
    which Megatron's MoE layer has (Qwen2-MoE's names, mbridge's mapping)."""

    GDN_CLASS: type = Qwen3_5MoeGatedDeltaNet
    # no dense MLP, so no intermediate_size: Megatron's default stands in for a width no
    # layer uses
    _CONFIG_MAPPING = {**Qwen3Bridge._CONFIG_MAPPING, "ffn_hidden_size": ("intermediate_size",
                                                                          None)}
    _MLP_MAPPING = Qwen2MoEBridge._MLP_MAPPING
    _weight_name_mapping_mlp = Qwen2MoEBridge._weight_name_mapping_mlp

    def _fields(self) -> dict:
        hf = self.hf_config
        return {**super()._fields(),
                "num_moe_experts": hf.num_experts, "moe_router_topk": hf.num_experts_per_tok,
                "moe_ffn_hidden_size": hf.moe_intermediate_size,
                "moe_shared_expert_intermediate_size": hf.shared_expert_intermediate_size,
                "moe_shared_expert_gate": True, "moe_router_score_function": "softmax",
                "moe_router_pre_softmax": False,  # the top-k of the softmax, renormalised
                "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0}


class Qwen3Next(Qwen3_5Moe):
    """Qwen3-Next (``qwen3_next``), Qwen3.5-MoE's forerunner: the same layers (its delta net
    projects queries, keys, values and gates in two grouped matrices, which transformers'
    module holds), a router that renormalises its top-k only under ``norm_topk_prob`` (the
    MoE adjustments read it), and a text-only checkpoint with transformers' plain names."""

    GDN_CLASS: type = Qwen3NextGatedDeltaNet
    HF_NAME = None  # model.layers.*, as the checkpoint has them


def merge_gated_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf) -> torch.Tensor:
    """HF ``q_proj`` (per head: query, gate), ``k_proj``, ``v_proj`` as Megatron's gated
    ``linear_qkv`` (per KV group: queries, gates, key, value). Example: 4 heads over 2 groups
    of head size 16 give rows ``[q0 q1 g0 g1 k0 v0 q2 q3 g2 g3 k1 v1]`` of 16 each."""
    groups, heads, dim = hf.num_key_value_heads, hf.num_attention_heads, hf.head_dim
    q = q.reshape(groups, heads // groups, 2, dim, -1).transpose(1, 2).flatten(1, 3)
    return torch.cat([q, k.reshape(groups, dim, -1), v.reshape(groups, dim, -1)],
                     1).reshape(-1, q.shape[-1])


def split_gated_qkv(qkv: torch.Tensor, hf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`merge_gated_qkv`."""
    groups, heads, dim = hf.num_key_value_heads, hf.num_attention_heads, hf.head_dim
    per = heads // groups
    rows = qkv.reshape(groups, 2 * per + 2, dim, -1)
    q = rows[:, :2 * per].reshape(groups, 2, per, dim, -1).transpose(1, 2)
    return (q.reshape(heads * 2 * dim, -1), rows[:, 2 * per].reshape(groups * dim, -1),
            rows[:, 2 * per + 1].reshape(groups * dim, -1))
