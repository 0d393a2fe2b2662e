"""``FlopsModel``: forward FLOPs ``a*L + b*L**2`` from HF-style configs (dense, MoE, errors)."""

import types

import numpy as np
import pytest

from vime_pure.errors import VimeError
from vime_pure.scheduling.flops import PROXY_QUADRATIC_PER_LINEAR, FlopsModel, proxy_flops

DENSE_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
            "vocab_size": 151936}


def test_dense_8b_matches_the_issue_example():
    model = FlopsModel.from_hf_config(DENSE_8B)
    assert model.linear == pytest.approx(1.514e10, rel=1e-3)
    assert model.quadratic == pytest.approx(2.949e5, rel=1e-3)
    assert model.per_sample(np.array([4096]))[0] == pytest.approx(6.70e13, rel=1e-3)
    assert model.quadratic / model.linear == pytest.approx(PROXY_QUADRATIC_PER_LINEAR, rel=1e-3)


def test_attribute_config_and_nested_text_config_read_the_same():
    plain = FlopsModel.from_hf_config(DENSE_8B)
    assert FlopsModel.from_hf_config(types.SimpleNamespace(**DENSE_8B)) == plain
    assert FlopsModel.from_hf_config({"text_config": DENSE_8B, "vision_config": {}}) == plain


def test_defaults_for_kv_heads_and_head_dim():
    cfg = {k: v for k, v in DENSE_8B.items() if k not in ("num_key_value_heads", "head_dim")}
    mha = FlopsModel.from_hf_config(cfg)
    # Without GQA the K/V projections are as wide as Q: 2*h*(3q) + 2*q*h per layer.
    h, layers = 4096, 36
    expected = layers * (8 * h * h + 6 * h * 12288) + 2 * h * 151936
    assert mha.linear == expected and mha.quadratic == 2 * h * layers


def test_moe_counts_routed_top_k_shared_experts_router_and_dense_layers():
    moe = {**DENSE_8B, "num_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [0]}
    model = FlopsModel.from_hf_config(moe)
    h = 4096
    attention = 2 * h * (4096 + 2 * 1024) + 2 * 4096 * h
    sparse_mlp = 6 * h * 768 * 8 + 2 * h * 128
    expected = 36 * attention + 35 * sparse_mlp + 6 * h * 12288 + 2 * h * 151936
    assert model.linear == expected
    top2 = FlopsModel.from_hf_config(moe, experts_per_token=2)  # --moe-router-topk 2
    assert model.linear - top2.linear == 35 * 6 * h * 768 * (8 - 2)
    shared = FlopsModel.from_hf_config({**moe, "shared_expert_intermediate_size": 1024})
    assert shared.linear - model.linear == 35 * 6 * h * 1024
    # Mixtral names: num_local_experts, and the expert FFN is intermediate_size.
    mixtral = FlopsModel.from_hf_config({**DENSE_8B, "num_local_experts": 8,
                                         "num_experts_per_tok": 2})
    assert mixtral.linear == 36 * (attention + 6 * h * 12288 * 2 + 2 * h * 8) + 2 * h * 151936


def test_flops_grow_with_length_and_proxy_is_relative():
    model = FlopsModel.from_hf_config(DENSE_8B)
    lengths = np.array([1, 100, 4096, 32768])
    assert np.all(np.diff(model.per_sample(lengths)) > 0)
    np.testing.assert_allclose(proxy_flops(lengths) * model.linear, model.per_sample(lengths),
                               rtol=1e-3)


@pytest.mark.parametrize("cfg, field", [
    ({k: v for k, v in DENSE_8B.items() if k != "vocab_size"}, "vocab_size"),
    ({**DENSE_8B, "hidden_size": 0}, "hidden_size"),
    ({**DENSE_8B, "num_attention_heads": "32"}, "num_attention_heads"),
    ({**DENSE_8B, "kv_lora_rank": 512}, "qk_rope_head_dim"),  # MLA needs its head dims
    ({**DENSE_8B, "num_experts": 8}, "num_experts_per_tok"),
])
def test_bad_configs_name_the_field_and_the_fix(cfg, field):
    with pytest.raises(VimeError, match=f"{field}=.*Fix:"):
        FlopsModel.from_hf_config(cfg)


def test_negative_coefficients_are_rejected():
    with pytest.raises(VimeError, match="linear=-1.0"):
        FlopsModel(linear=-1, quadratic=1)


MLA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "intermediate_size": 128, "vocab_size": 20, "kv_lora_rank": 16, "q_lora_rank": 24,
       "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}


def test_multi_latent_attention_counts_its_low_rank_projections():
    """DeepSeek-V3's attention (the docstring example of ``_mla_attention``): per layer
    23040 linear FLOPs per token and QK + AV pair terms of 4 x 24 + 4 x 16."""
    model = FlopsModel.from_hf_config(MLA)
    assert model.linear == 2 * (23040 + 6 * 64 * 128) + 2 * 64 * 20
    assert model.quadratic == 2 * 160
    without_q_lora = FlopsModel.from_hf_config({**MLA, "q_lora_rank": None})
    assert without_q_lora.linear - model.linear == 2 * (2 * 64 * 4 * 24 - 7680)


def test_mla_with_equal_head_dims_has_the_dense_pair_term():
    """With QK and V heads of one width d, the pair term is the dense ``2 * heads * d``."""
    equal = {**MLA, "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 16}
    dense = {k: MLA[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "intermediate_size", "vocab_size")}
    assert FlopsModel.from_hf_config(equal).quadratic == FlopsModel.from_hf_config(
        {**dense, "head_dim": 16}).quadratic


def test_linear_attention_layers_cost_no_quadratic_term():
    """Qwen3.5: three of four layers are gated delta nets, the MoE text model has no dense
    width at all."""
    hybrid = {**DENSE_8B, "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
              "vocab_size": 20, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    model = FlopsModel.from_hf_config(hybrid)
    attention = 2 * 64 * (64 + 2 * 32) + 2 * 64 * 64
    assert model.quadratic == 2 * 64 * 1
    assert model.linear == 3 * 37888 + attention + 4 * 6 * 64 * 128 + 2 * 64 * 20
    moe = {k: v for k, v in hybrid.items() if k != "intermediate_size"}
    moe.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert FlopsModel.from_hf_config(moe).linear == \
        model.linear - 4 * 6 * 64 * 128 + 4 * (6 * 64 * 32 * 2 + 2 * 64 * 4)
