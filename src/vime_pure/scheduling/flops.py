"""Per-sample forward FLOPs of a decoder: ``a*L + b*L**2`` from an HF-style config.

Purpose: give FLOPs packing and balancing a workload estimate per sample. For a sequence of
``L`` tokens, counting 2 FLOPs per multiply-accumulate:

- linear term ``a`` (per token): per layer the Q/K/V/O projections
  ``2*h*(q + 2*kv) + 2*q*h`` (``q = heads*head_dim``, ``kv = kv_heads*head_dim``) plus the gated
  MLP ``6*h*ffn`` (MoE layers: ``6*h*moe_ffn*top_k``, shared experts, and the router ``2*h*E``);
  once, the LM head ``2*h*vocab``;
- quadratic term ``b``: causal attention scores and weighted values, ``2*heads*head_dim`` per
  layer (``QK^T`` and ``AV`` cost ``2*L**2*head_dim`` each per head, halved by the causal mask).
- linear-attention layers (``layer_types`` ``linear_attention``: Qwen3.5's gated delta net)
  cost no quadratic term: per token their projections (query, key, value, gate, the two
  per-head scalars, output) and the state update and read-out, ``4*v_heads*k_dim*v_dim``.

Invariants the tests assert: the dense ~8B example below, MoE counting only routed top-k
experts, ``a`` and ``b`` positive, per-sample FLOPs increasing in ``L``.

Example: hidden 4096, 32 heads, 8 KV heads, head dim 128, FFN 12288, 36 layers, vocab 151936
gives ``a = 1.5137e10`` and ``b = 2.949e5``: a 4096-token sample costs 6.70e13 forward FLOPs.
``proxy_flops`` uses that model's ratio ``b/a`` (normalised to ``a = 1``) when the caller passes
no estimate.
"""

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
from jaxtyping import Float64, Int

from vime_pure.errors import FlopsModelError, field_error

# b / a of the dense 8B decoder above.
PROXY_QUADRATIC_PER_LINEAR = 2.949e5 / 1.514e10

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def proxy_flops(lengths: Int[np.ndarray, " n"]) -> Float64[np.ndarray, " n"]:
    """Relative forward cost ``L + (b/a) * L**2``; e.g. L=4096 gives 4096 * 1.0798 = 4422.8."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths + PROXY_QUADRATIC_PER_LINEAR * lengths * lengths


def _coefficient(name: str, value: object) -> float:
    """A real number as float; a string or a complex is a typed error, not a bare one."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise field_error(FlopsModelError, name, value, "is not a number",
                          "build the model with FlopsModel.from_hf_config(config)")
    return float(value)


@attrs.frozen(kw_only=True)
class FlopsModel:
    """Forward FLOPs of one sample of ``L`` tokens: ``linear * L + quadratic * L**2``."""

    linear: float = attrs.field(converter=lambda v: _coefficient("linear", v))
    quadratic: float = attrs.field(converter=lambda v: _coefficient("quadratic", v))

    def __attrs_post_init__(self) -> None:
        for name in ("linear", "quadratic"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise field_error(FlopsModelError, name, value, "must be finite and non-negative",
                                  "build the model with FlopsModel.from_hf_config(config)")

    def per_sample(self, lengths: Int[np.ndarray, " n"]) -> Float64[np.ndarray, " n"]:
        """FLOPs of every sample; e.g. the 8B model gives 6.70e13 for L=4096."""
        length = np.asarray(lengths, dtype=np.float64)
        return self.linear * length + self.quadratic * length * length

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any,
                       experts_per_token: int | None = None) -> "FlopsModel":
        """Read a HF ``config.json`` dict or a ``PretrainedConfig``-like object (a nested
        ``text_config`` is used when present, as in multimodal configs).
        ``experts_per_token`` overrides the config's ``num_experts_per_tok``
        (``--moe-router-topk``): only the active experts cost FLOPs."""
        cfg = ConfigFields(config)
        if cfg.get("text_config") is not None:
            cfg = ConfigFields(cfg.get("text_config"))
        hidden, layers = cfg.int("hidden_size"), cfg.int("num_hidden_layers")
        heads = cfg.int("num_attention_heads")
        if cfg.get("kv_lora_rank") is not None:
            attention, pair = _mla_attention(cfg, hidden, heads)
        else:
            kv_heads = cfg.int("num_key_value_heads", heads)
            head_dim = cfg.int("head_dim", hidden // heads)
            q, kv = heads * head_dim, kv_heads * head_dim
            attention, pair = 2 * hidden * (q + 2 * kv) + 2 * q * hidden, 2 * q
        sparse = sparse_layers(cfg, layers)
        # a model whose every layer is MoE need not state a dense width
        dense_mlp = 6 * hidden * cfg.int("intermediate_size") if len(sparse) < layers else 0
        moe_mlp = _moe_mlp(cfg, hidden, experts_per_token) if sparse else 0
        linear_layers = {i for i, t in enumerate(cfg.get("layer_types") or [])
                         if t == "linear_attention" and i < layers}
        mixer = _linear_attention(cfg, hidden) if linear_layers else 0
        per_layer = [(mixer if i in linear_layers else attention)
                     + (moe_mlp if i in sparse else dense_mlp) for i in range(layers)]
        linear = sum(per_layer) + 2 * hidden * cfg.int("vocab_size")
        return cls(linear=linear, quadratic=pair * (layers - len(linear_layers)))


def _linear_attention(cfg: "ConfigFields", hidden: int) -> int:
    """Per-token FLOPs of a gated delta-net layer (module docstring). Example: hidden 64, 2 key
    heads and 4 value heads of 16: 2*64*(2*32 + 2*64 + 8) + 2*64*64 + 4*4*16*16 = 37888."""
    k_heads, v_heads = cfg.int("linear_num_key_heads"), cfg.int("linear_num_value_heads")
    k_dim, v_dim = cfg.int("linear_key_head_dim"), cfg.int("linear_value_head_dim")
    keys, values = k_heads * k_dim, v_heads * v_dim
    return (2 * hidden * (2 * keys + 2 * values + 2 * v_heads) + 2 * values * hidden
            + 4 * v_heads * k_dim * v_dim)


def _mla_attention(cfg: "ConfigFields", hidden: int, heads: int) -> tuple[int, int]:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): ``(linear FLOPs per token, pair
    coefficient)`` of one layer, in the dense formula's convention (2 per multiply-add; the
    pair term counts QK and AV once each). Queries go through a ``q_lora_rank`` bottleneck when
    the config has one; keys and values through ``kv_lora_rank`` plus a shared RoPE key of
    ``qk_rope_head_dim``; each head scores with ``qk_nope_head_dim + qk_rope_head_dim`` and
    returns ``v_head_dim``. With ``qk = v = d`` the pair term is the dense ``2 * heads * d``.
    Example: hidden 64, 4 heads, q_lora 24, kv_lora 16, nope 16, rope 8, v 16: linear
    2*(64*24 + 24*96) + 2*64*24 + 2*16*128 + 2*64*64 = 23040, pair 4*24 + 4*16 = 160."""
    kv_lora, rope = cfg.int("kv_lora_rank"), cfg.int("qk_rope_head_dim")
    nope, v = cfg.int("qk_nope_head_dim"), cfg.int("v_head_dim")
    qk = nope + rope
    if cfg.get("q_lora_rank") is None:
        query = 2 * hidden * heads * qk
    else:
        q_lora = cfg.int("q_lora_rank")
        query = 2 * (hidden * q_lora + q_lora * heads * qk)
    key_value = 2 * hidden * (kv_lora + rope) + 2 * kv_lora * heads * (nope + v)
    return query + key_value + 2 * heads * v * hidden, heads * qk + heads * v


class ConfigFields:
    """Uniform read access to a dict or attribute-style config, with typed errors (shared
    with the memory estimator, ``vime_pure.memory``)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def get(self, name: str, default: Any = None) -> Any:
        if isinstance(self.config, Mapping):
            value = self.config.get(name, default)
        else:
            value = getattr(self.config, name, default)
        return default if value is None else value

    def int(self, name: str, default: int | None = None) -> int:
        value = self.get(name, default)
        if value is None:
            raise field_error(FlopsModelError, name, None, "is missing from the model config",
                              f"add {name} to the config (see the model's config.json)")
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise field_error(FlopsModelError, name, value, "must be a positive integer",
                              "fix the model config")
        return int(value)


def num_experts(cfg: ConfigFields) -> int:
    """Routed experts of a config (0 for a dense model)."""
    return next((cfg.int(f) for f in _EXPERT_FIELDS if cfg.get(f)), 0)


def sparse_layers(cfg: ConfigFields, layers: int) -> set[int]:
    """Indices of MoE layers (Qwen's decoder_sparse_step / mlp_only_layers, DeepSeek's
    first_k_dense_replace, GLM-4.7-Flash's mlp_layer_types); none for a dense model."""
    if not num_experts(cfg):
        return set()
    types = cfg.get("mlp_layer_types")  # GLM-4.7-Flash: "dense" / "sparse" per layer
    if isinstance(types, list):
        return {i for i, t in enumerate(types[:layers]) if t == "sparse"}
    step = cfg.int("decoder_sparse_step", 1)
    dense_only = set(cfg.get("mlp_only_layers", []) or [])
    first_dense = cfg.get("first_k_dense_replace", 0) or 0
    return {i for i in range(layers)
            if (i + 1) % step == 0 and i not in dense_only and i >= first_dense}


def _moe_mlp(cfg: ConfigFields, hidden: int, top_k: int | None = None) -> int:
    """Per-token FLOPs of a MoE MLP: top-k routed experts, shared experts, and the router."""
    experts = num_experts(cfg)
    expert_ffn = cfg.int("moe_intermediate_size" if cfg.get("moe_intermediate_size") is not None
                         else "intermediate_size")  # Mixtral's experts are intermediate_size
    routed = 6 * hidden * expert_ffn * (top_k or cfg.int("num_experts_per_tok"))
    shared_ffn = cfg.get("shared_expert_intermediate_size", 0) or 0
    shared_ffn += (cfg.get("n_shared_experts", 0) or 0) * expert_ffn
    return routed + 6 * hidden * int(shared_ffn) + 2 * hidden * experts
