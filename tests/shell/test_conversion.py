"""HF <-> Megatron conversion through mbridge with vime's CPU adjustments.

Round trip HF -> Megatron -> HF is bit-exact at TP1, TP2, PP2 and PP2xVPP2 (Qwen2) and TP1
(Llama); Megatron logits equal transformers' to 1e-5 in fp32 (TP gathered), and log-probs of
the trainer's log-prob step equal transformers' on every layout.
"""

import json

import pytest

from vime_shell.megatron.bridge import ModelLoadError, read_hf_config

TOL = 1e-5
ROUNDTRIP_LAYOUTS = ["dp1", "tp2", "pp2", "pp2_vpp2", "pp2_uneven"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ROUNDTRIP_LAYOUTS)
def test_roundtrip_is_exact(megatron_runs, name):
    run = megatron_runs["per_rank"][0][name]
    assert run["roundtrip_keys_equal"]
    assert run["roundtrip_max"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp1", "dp2", "tp2"])
def test_logits_match_transformers(megatron_runs, name):
    assert megatron_runs["per_rank"][0][name]["logit_max"] <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp1", "dp2", "tp2", "pp2", "pp2_vpp2", "pp2_uneven"])
def test_log_probs_match_transformers_on_every_rank(megatron_runs, name):
    for rank in ((0,) if name == "dp1" else (0, 1)):
        assert megatron_runs["per_rank"][rank][name]["hf_logprob_max"] <= TOL


@pytest.mark.slow
def test_llama_roundtrip_and_logits(megatron_runs):
    run = megatron_runs["per_rank"][0]["llama_conversion"]
    assert run["roundtrip_keys_equal"] and run["roundtrip_max"] == 0.0
    assert run["logit_max"] <= TOL


def test_missing_config_is_a_typed_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        read_hf_config(tmp_path)


@pytest.mark.slow
def test_uneven_pipeline_stages_hold_the_requested_layers(megatron_runs):
    # 4 layers, --decoder-first-pipeline-num-layers 1: stage 0 holds 1, stage 1 the other 3.
    assert [megatron_runs["per_rank"][r]["pp2_uneven"]["stage_layers"] for r in (0, 1)] == [1, 3]


def test_unsupported_rope_is_rejected_with_the_fix(tmp_path):
    from vime_shell.models.tiny_model import hf_config, TinyModelSpec

    config = hf_config(TinyModelSpec())
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                               "original_max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="rope_type='yarn'"):
        read_hf_config(tmp_path)
    data["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        read_hf_config(tmp_path)
    data["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert read_hf_config(tmp_path).rope_theta == 10000.0


def test_rope_theta_is_read_from_rope_parameters(tmp_path):
    from vime_shell.models.tiny_model import hf_config, TinyModelSpec

    hf_config(TinyModelSpec(rope_theta=5000.0)).save_pretrained(tmp_path)
    assert read_hf_config(tmp_path).rope_theta == 5000.0
