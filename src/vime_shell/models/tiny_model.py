"""Tiny random Hugging Face decoder models built from a config, for tests and the CPU demo.

Purpose: every shell test needs a real HF model directory (config + safetensors) without a
download. :func:`build_tiny_hf_model` writes a randomly initialised Qwen2 or Llama model with
``save_pretrained``; the same seed gives the same weights.

Example: ``build_tiny_hf_model(tmp / "m", TinyModelSpec(num_layers=2))`` writes a 2-layer Qwen2
with hidden 64, 4 heads of 16 and vocabulary 128: about 0.1M parameters, fp32.
``TinyModelSpec(arch="qwen3_moe", num_experts=4)`` gives a Qwen3-MoE with 4 experts of width
``moe_intermediate_size`` (top-2, normalised top-k probabilities); ``arch="qwen2_moe"`` adds
Qwen2-MoE's gated shared expert. ``rope_scaling={"rope_type": "llama3", ...}`` on a Llama
gives a Llama-3.x RoPE.
"""

from pathlib import Path
from typing import Any

import attrs
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen2MoeConfig,
                          Qwen3MoeConfig)

from vime_pure.errors import VimeError, field_error

ARCHITECTURES: tuple[str, ...] = ("qwen2", "llama", "qwen2_moe", "qwen3_moe")
MOE_ARCHITECTURES: tuple[str, ...] = ("qwen2_moe", "qwen3_moe")


@attrs.frozen(kw_only=True)
class TinyModelSpec:
    """Shape of a tiny decoder. ``num_kv_heads < num_heads`` gives grouped-query attention."""

    arch: str = "qwen2"
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # extra rope_parameters, e.g. {"rope_type": "llama3", ...}
    num_experts: int = 4  # MoE architectures only
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 48  # qwen2_moe
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise field_error(VimeError, "arch", self.arch, "is not a supported architecture",
                              f"use one of {ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise field_error(VimeError, name, value, "must be a positive integer",
                                  "pass a positive size")
        if self.num_heads % self.num_kv_heads:
            raise field_error(VimeError, "num_kv_heads", self.num_kv_heads,
                              f"must divide num_heads={self.num_heads}",
                              "use a divisor of num_heads, e.g. 1, 2 or num_heads")


def hf_config(spec: TinyModelSpec, **extra):
    """The transformers config object of ``spec`` (fp32, no dropout); ``extra`` adds fields
    such as token ids."""
    # Keyword arguments of several transformers config classes, each typed field by field.
    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, rms_norm_eps=1e-6,
        attention_dropout=0.0, torch_dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         **(spec.rope_scaling or {})}, **extra,
    )
    moe: dict[str, Any] = dict(
        num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.0)
    if spec.arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(norm_topk_prob=True, attention_bias=False, **moe, **common)
    if spec.arch == "qwen2_moe":
        return Qwen2MoeConfig(norm_topk_prob=False, use_sliding_window=False,
                              shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                              **moe, **common)
    return LlamaConfig(attention_bias=False, mlp_bias=False, **common)


def random_hf_model(spec: TinyModelSpec, **config_extra):
    """A randomly initialised fp32 model of ``spec``, seeded by ``spec.seed`` without touching
    the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return AutoModelForCausalLM.from_config(hf_config(spec, **config_extra),
                                                dtype=torch.float32)


def build_tiny_hf_model(path: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a random model of ``spec`` (default: ``TinyModelSpec()``) to ``path``; returns it."""
    spec = spec or TinyModelSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    random_hf_model(spec).save_pretrained(out, safe_serialization=True)
    return out
