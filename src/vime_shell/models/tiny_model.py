"""Tiny random Hugging Face decoder models built from a config, for tests and the CPU demo.

Purpose: every shell test needs a real HF model directory (config + safetensors) without a
download. :func:`build_tiny_hf_model` writes a randomly initialised Qwen2 or Llama model with
``save_pretrained``; the same seed gives the same weights.

Example: ``build_tiny_hf_model(tmp / "m", TinyModelSpec(num_layers=2))`` writes a 2-layer Qwen2
with hidden 64, 4 heads of 16 and vocabulary 128: about 0.1M parameters, fp32.
``TinyModelSpec(arch="qwen3_moe", num_experts=4)`` gives a Qwen3-MoE with 4 experts of width
``moe_intermediate_size`` (top-2, normalised top-k probabilities); ``arch="qwen2_moe"`` adds
Qwen2-MoE's gated shared expert. ``rope_scaling={"rope_type": "llama3", ...}`` on a Llama
gives a Llama-3.x RoPE. ``arch="deepseek_v3"`` is a DeepSeek-V3 (multi-latent attention with
``q_lora_rank`` / ``kv_lora_rank``, its first ``first_k_dense_replace`` layers dense, the rest
MoE with a shared expert, sigmoid routing with an expert bias, drawn non-zero here, and
``n_group`` expert groups), with the router keys DeepSeek's own config.json has
(``topk_method: noaux_tc``, ``scoring_func: sigmoid``). ``arch="glm4"`` is a dense GLM-4
(post-norms, QKV bias, half of each head rotated in interleaved pairs).
``arch="glm4_moe"`` is a GLM-4.5 / 4.6 / 4.7 MoE (half-rotated heads, QKV bias, q/k norms
unless ``use_qk_norm`` is off as on GLM-4.5-Air, DeepSeek-style MoE). ``arch="glm4_moe_lite"``
is a GLM-4.7-Flash: DeepSeek-V3's model under GLM's config
(``mlp_layer_types`` and ``first_k_dense_replace``, routed scaling 1.8); ``arch="glm_moe_dsa"``
a GLM-5: that model with DeepSeek sparse attention (``index_topk`` keys per query, chosen by
an indexer on the ``"full"`` layers of ``indexer_types`` and reused by the ``"shared"`` ones). ``arch="qwen3_5"`` is
a dense Qwen3.5, written as the released checkpoints are (multimodal, with a one-block vision
tower): linear attention in three of every four layers (as many linear heads as attention
heads), gated attention, (1 + w) norms drawn non-zero, a quarter of each head rotated;
``arch="qwen3_5_moe"`` the same with MoE layers (a shared expert of
``shared_expert_intermediate_size`` behind a sigmoid gate); ``arch="qwen3_next"`` is
Qwen3-Next, those MoE layers in a text-only checkpoint. ``arch="minimax_m2"`` is MiniMax-M2:
q/k norms over all heads, half of each head rotated, sigmoid routing with an expert bias
(drawn non-zero), experts ``intermediate_size`` wide, in Mixtral's names. ``arch="gpt_oss"`` is
gpt-oss: attention sinks, a ``sliding_window``-token window on every other layer (the first
sliding, as the release alternates them), biases on every projection and on the router,
experts ``moe_intermediate_size`` wide with the clamped SwiGLU, fused on disk, YaRN RoPE (the
release's factor 32 over 4096 positions); its router and expert biases and sinks are drawn
non-zero here.
"""

from pathlib import Path
from typing import Any

import attrs
import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Glm4Config, Glm4MoeConfig,
                          GptOssConfig,
                          Glm4MoeLiteConfig, GlmMoeDsaConfig, LlamaConfig, Qwen2Config, Qwen2MoeConfig,
                          Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForConditionalGeneration, Qwen3MoeConfig,
                          MiniMaxM2Config, Qwen3NextConfig)

from vime_pure.errors import VimeError, field_error

ARCHITECTURES: tuple[str, ...] = ("qwen2", "llama", "qwen2_moe", "qwen3_moe", "deepseek_v3",
                                  "glm4", "glm4_moe_lite", "glm4_moe", "qwen3_5", "qwen3_5_moe",
                                  "qwen3_next", "minimax_m2", "glm_moe_dsa", "gpt_oss")
MOE_ARCHITECTURES: tuple[str, ...] = ("qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe_lite",
                                      "glm4_moe", "qwen3_5_moe", "qwen3_next", "minimax_m2",
                                      "glm_moe_dsa", "gpt_oss")
# gated delta-net models: their (1 + w) norms start at 0, so the tiny ones draw them
_ONE_PLUS_NORMS: tuple[str, ...] = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# gpt-oss parameters transformers starts at 0 or near it: drawn, so their paths are tested
_GPT_OSS_DRAWN: tuple[str, ...] = ("sinks", "router.bias", "gate_up_proj_bias",
                                   "down_proj_bias", "_proj.bias")


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
    shared_expert_intermediate_size: int = 48  # qwen2_moe, qwen3_5_moe
    # deepseek_v3 (multi-latent attention); its heads are these, not head_dim / num_kv_heads
    q_lora_rank: int | None = 24
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    use_qk_norm: bool = True  # glm4_moe (GLM-4.5 / 4.6 / 4.7 have it, GLM-4.5-Air not)
    n_shared_experts: int = 1  # glm4_moe: the shared expert's width in experts
    # glm_moe_dsa (GLM-5's sparse attention): keys per query, the indexer's heads, and which
    # layers run their own indexer ("full") or reuse the last full layer's ("shared")
    index_topk: int = 4
    index_n_heads: int = 4
    index_head_dim: int = 16
    indexer_types: tuple[str, ...] | None = None
    sliding_window: int = 4  # gpt_oss: tokens a sliding layer's query sees (itself included)
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
    if spec.arch in ("deepseek_v3", "glm4_moe_lite", "glm_moe_dsa"):
        return _deepseek_v3(spec, common)
    if spec.arch == "glm4_moe":
        return _glm4_moe(spec, common)
    if spec.arch in _ONE_PLUS_NORMS:
        return _qwen3_5(spec, common)
    if spec.arch == "minimax_m2":
        return MiniMaxM2Config(**{
            **common, "intermediate_size": spec.moe_intermediate_size,
            "rope_parameters": {"partial_rotary_factor": 0.5, **common["rope_parameters"]},
            "num_local_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
            "router_aux_loss_coef": 0.0, "pad_token_id": None, "bos_token_id": None,
            "eos_token_id": 1,
            # keys the release's config.json states (vLLM reads them)
            "rotary_dim": spec.head_dim // 2, "scoring_func": "sigmoid",
            "use_routing_bias": True})
    if spec.arch == "gpt_oss":
        return _gpt_oss(spec, common)
    if spec.arch == "glm4":  # half of each head rotated, in interleaved pairs (GLM-4-9B's)
        common["rope_parameters"] = {"partial_rotary_factor": 0.5, **common["rope_parameters"]}
        # GLM-4's default token ids lie beyond a tiny vocabulary (None means them here): id 1
        # is the embedded tokenizer's <eos>
        return Glm4Config(**{"attention_bias": True, "pad_token_id": None, "eos_token_id": 1,
                             **common})
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(norm_topk_prob=True, attention_bias=False, **moe, **common)
    if spec.arch == "qwen2_moe":
        return Qwen2MoeConfig(norm_topk_prob=False, use_sliding_window=False,
                              shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                              **moe, **common)
    return LlamaConfig(attention_bias=False, mlp_bias=False, **common)


# DeepSeek-V3's config.json keys for its router, which transformers' config class does not
# declare (it routes this way always) but keeps, and vLLM reads
_DEEPSEEK_ROUTER_KEYS: dict[str, Any] = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def _deepseek_v3(spec: TinyModelSpec, common: dict[str, Any]):
    """DeepSeek-V3, or GLM-4.7-Flash: the same model under GLM's config (its dense layers in
    ``mlp_layer_types``, GLM's routed scaling 1.8, no router keys in its config.json)."""
    common = {k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}
    shared = dict(
        q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim, num_key_value_heads=spec.num_heads,
        n_routed_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size, n_shared_experts=1,
        n_group=spec.n_group, topk_group=spec.topk_group, norm_topk_prob=True, **common)
    if spec.arch == "glm_moe_dsa":
        k = spec.first_k_dense_replace
        types = list(spec.indexer_types or ["full"] * spec.num_layers)
        return GlmMoeDsaConfig(mlp_layer_types=["dense"] * k + ["sparse"] * (spec.num_layers - k),
                               first_k_dense_replace=k, routed_scaling_factor=2.5,
                               index_topk=spec.index_topk, index_n_heads=spec.index_n_heads,
                               index_head_dim=spec.index_head_dim, indexer_types=types,
                               pad_token_id=None, eos_token_id=1, **shared)
    if spec.arch == "glm4_moe_lite":
        k = spec.first_k_dense_replace
        # a real config.json states the dense layers both ways (vLLM reads the count)
        extra: dict[str, Any] = {"first_k_dense_replace": k}  # kept, though undeclared
        return Glm4MoeLiteConfig(mlp_layer_types=["dense"] * k + ["sparse"] * (
            spec.num_layers - k), routed_scaling_factor=1.8, **shared, **extra)
    return DeepseekV3Config(first_k_dense_replace=spec.first_k_dense_replace,
                            routed_scaling_factor=2.5, num_mtp_layers=0, **shared,
                            **_DEEPSEEK_ROUTER_KEYS)


def _gpt_oss(spec: TinyModelSpec, common: dict[str, Any]):
    # the release's YaRN (factor 32 over 4096 positions), its default when none is given
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096,
            "rope_theta": spec.rope_theta}
    return GptOssConfig(**{
        **common, "intermediate_size": spec.moe_intermediate_size, "rope_parameters": yarn,
        "max_position_embeddings": 4096 * 32, "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok, "sliding_window": spec.sliding_window,
        "router_aux_loss_coef": 0.0, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": 1})


def _glm4_moe(spec: TinyModelSpec, common: dict[str, Any]):
    """GLM-4.5's MoE: half of each head rotated (not interleaved), QKV bias, optional q/k
    norms, its first ``first_k_dense_replace`` layers dense, the rest DeepSeek-style MoE (a
    shared expert, sigmoid routing with an expert bias, ``n_group`` groups)."""
    common = {**common, "rope_parameters": {"partial_rotary_factor": 0.5,
                                            **common["rope_parameters"]}}
    return Glm4MoeConfig(
        attention_bias=True, use_qk_norm=spec.use_qk_norm, n_routed_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok, n_shared_experts=spec.n_shared_experts,
        moe_intermediate_size=spec.moe_intermediate_size,
        first_k_dense_replace=spec.first_k_dense_replace, n_group=spec.n_group,
        topk_group=spec.topk_group, norm_topk_prob=True, routed_scaling_factor=2.5,
        **{"pad_token_id": None, "eos_token_id": 1, **common})


def _qwen3_5(spec: TinyModelSpec, common: dict[str, Any]):
    """Qwen3.5 (dense or MoE) as released, a multimodal config whose ``text_config`` is the
    language model; Qwen3-Next's text-only config."""
    text = {**common, "rope_parameters": {"partial_rotary_factor": 0.25,
                                          **common["rope_parameters"]},
            "linear_num_key_heads": spec.num_kv_heads, "linear_num_value_heads": spec.num_heads,
            "linear_key_head_dim": spec.head_dim, "linear_value_head_dim": spec.head_dim,
            "pad_token_id": None, "eos_token_id": 1}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=spec.hidden_size)
    moe: dict[str, Any] = dict(
        num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size, router_aux_loss_coef=0.0,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
    if spec.arch == "qwen3_next":
        return Qwen3NextConfig(**text, **moe, norm_topk_prob=True, decoder_sparse_step=1,
                               mlp_only_layers=[])
    if spec.arch == "qwen3_5_moe":
        text = {k: v for k, v in text.items() if k != "intermediate_size"}
        return Qwen3_5MoeConfig(text_config={**text, **moe}, vision_config=vision,
                                tie_word_embeddings=spec.tie_word_embeddings)
    return Qwen3_5Config(text_config=text, vision_config=vision,
                         tie_word_embeddings=spec.tie_word_embeddings)


def random_hf_model(spec: TinyModelSpec, **config_extra):
    """A randomly initialised fp32 model of ``spec``, seeded by ``spec.seed`` without touching
    the global RNG. A DeepSeek-V3's expert bias and Qwen3.5's norms are drawn too
    (transformers starts them at 0, which would leave their paths untested)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        config = hf_config(spec, **config_extra)
        multimodal = {"qwen3_5": Qwen3_5ForConditionalGeneration,
                      "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration}.get(spec.arch)
        model = multimodal(config) if multimodal else \
            AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.1)
            for name, param in model.named_parameters():
                if spec.arch in _ONE_PLUS_NORMS and name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param), alpha=0.1)
                if spec.arch == "gpt_oss" and name.endswith(_GPT_OSS_DRAWN):
                    param.normal_(0.0, 0.5)
        return model


def build_tiny_hf_model(path: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a random model of ``spec`` (default: ``TinyModelSpec()``) to ``path``; returns it."""
    spec = spec or TinyModelSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    random_hf_model(spec).save_pretrained(out, safe_serialization=True)
    return out
