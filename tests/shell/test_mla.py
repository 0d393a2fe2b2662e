"""Multi-latent attention models (DeepSeek-V3 / R1, Moonlight; ``vime_shell.megatron.mla_bridge``)
on CPU: tiny random DeepSeek-V3s with a query low-rank projection, a dense first layer, MoE
layers with a shared expert, sigmoid routing with a non-zero expert bias, and, in variants,
no query low-rank with 2 expert groups, YaRN RoPE, every layer dense, one whose
config.json says ``kimi_k2`` as Kimi-K2's does (DeepSeek-V3's classes under its own name), and
a GLM-4.7-Flash (``glm4_moe_lite``: the same model under GLM's config, checked against
transformers' own GLM class).

Asserted: the HF -> Megatron -> HF round trip is exact and Megatron's logits and log-probs
equal transformers' (1e-5, fp32), for all five; DP2, EP2 and PP2 train the two rollouts to
the same losses (1e-6) and weights (1e-5); an EP2 checkpoint resumes to the same weights
(the fixed expert bias included); TP2 without sequence parallelism (the local spec
has none) is refused with the reason, as megatron-core 0.16 then trains on a partial RoPE-key
gradient (measured before the refusal: TP2 weights 6.7e-4 off DP2, logits exact); ``vime train`` on the model (HF engine) syncs
the trained weights each rollout within the gap check, and its ``--save-hf`` export loads in
transformers with the trainer's weights.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.shell.mla_workers import mla_worker
from tests.shell.train_cli import train_and_export, with_embedded_tokenizer
from vime_shell.megatron.spawn import spawn
from vime_shell.models.auto_config import auto_config
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
SPECS = {"dsv3": TinyModelSpec(arch="deepseek_v3", num_layers=4),
         "no_q_lora_groups": TinyModelSpec(arch="deepseek_v3", q_lora_rank=None, n_group=2,
                                           topk_group=1, seed=1),
         "yarn": TinyModelSpec(arch="deepseek_v3", rope_scaling=YARN, seed=2),
         "dense": TinyModelSpec(arch="deepseek_v3", first_k_dense_replace=2, seed=3)}


# Kimi-K2's config.json names its own model_type and remote code for DeepSeek-V3's classes
KIMI_K2 = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
           "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}


def as_kimi_k2(model: Path) -> Path:
    """A DeepSeek-V3 directory whose config.json says what Kimi-K2's says."""
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **KIMI_K2}, indent=1))
    return model


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    dirs = {name: str(build_tiny_hf_model(root / name, spec)) for name, spec in SPECS.items()}
    dirs["kimi_k2"] = str(as_kimi_k2(build_tiny_hf_model(root / "kimi_k2", TinyModelSpec(
        arch="deepseek_v3", rope_scaling=YARN, seed=4))))
    dirs["glm47_flash"] = str(build_tiny_hf_model(root / "glm47_flash", TinyModelSpec(
        arch="glm4_moe_lite", num_layers=3, seed=5)))
    return spawn(mla_worker, 2, dirs, str(root / "ckpt"))


def test_glm_4_7_flash_read_as_deepseek_v3_gives_transformers_own_logits(tmp_path):
    """auto_config hands GLM-4.7-Flash on as DeepSeek-V3 (the HF engine and the bridge read
    it so): on the same weights transformers' two classes give the same logits, exactly."""
    model = build_tiny_hf_model(tmp_path / "glm47", TinyModelSpec(arch="glm4_moe_lite",
                                                                  num_layers=3))
    native = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    as_dsv3 = AutoModelForCausalLM.from_pretrained(model, config=auto_config(model),
                                                   dtype=torch.float32).eval()
    assert type(as_dsv3).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(native(ids).logits, as_dsv3(ids).logits)


def _delta(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in b)


@pytest.mark.parametrize("name", [*SPECS, "kimi_k2", "glm47_flash"])
def test_the_round_trip_is_exact_and_logits_match_transformers(mla_runs, name):
    run = mla_runs[0]["conversion"][name]
    assert run["roundtrip_keys_equal"] and run["roundtrip_max"] == 0.0
    assert run["logit_max"] <= 1e-5


@pytest.mark.parametrize("name", ["dp2", "ep2", "no_q_lora_groups", "yarn", "dense",
                                  "glm47_flash"])
def test_training_log_probs_match_transformers(mla_runs, name):
    for run in (r[name] for r in mla_runs):
        assert run["logit_max"] <= 1e-5 and run["hf_logprob_max"] <= 1e-5
        assert len(run["losses"]) == 4 and all(np.isfinite(run["losses"]))


@pytest.mark.parametrize("name", ["ep2", "pp2"])
def test_layouts_train_to_the_same_weights(mla_runs, name):
    ref, run = mla_runs[0]["dp2"], mla_runs[0][name]
    assert run["export_keys"] == ref["export_keys"]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= 1e-6
    assert _delta(run["final"], ref["final"]) <= 1e-5


def test_a_checkpoint_resumes_to_the_same_weights(mla_runs):
    run = mla_runs[0]["resume_ep2"]
    assert _delta(run["resumed"], run["straight"]) == 0.0


def test_tensor_parallelism_without_sequence_parallelism_is_refused(mla_runs):
    assert "tensor_model_parallel_size=2: multi-latent attention under TP without sequence " \
        "parallelism trains on a partial RoPE-key gradient" in mla_runs[0]["tp2_error"]


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_k2", "glm4_moe_lite"])
def test_vime_train_syncs_and_exports_an_mla_model(tmp_path, model_type):
    """The reverse task on a tiny DeepSeek-V3 (or Kimi-K2's config of it, or GLM-4.7-Flash's)
    with the embedded model's tokenizer: 3 rollouts, the HF engine following each sync (the
    loop's gap check), and the export reloaded."""
    arch = "glm4_moe_lite" if model_type == "glm4_moe_lite" else "deepseek_v3"
    model = build_tiny_hf_model(tmp_path / "dsv3", TinyModelSpec(arch=arch, vocab_size=20))
    if model_type == "kimi_k2":
        as_kimi_k2(model)
    with_embedded_tokenizer(model)
    trained = train_and_export(model, tmp_path)
    base = load_file(model / "model.safetensors")
    assert set(trained) == set(base)
    moved = [k for k in base if not torch.equal(trained[k], base[k])]
    assert any("kv_b_proj" in k for k in moved) and any("experts" in k for k in moved)
    assert not any("e_score_correction_bias" in k for k in moved)  # a fixed bias
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf", config=auto_config(tmp_path / "hf"),
                                         dtype=torch.float32)  # loads
    if model_type == "glm4_moe_lite":  # the export keeps GLM's config: transformers' own class
        native = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
        assert type(native).__name__ == "Glm4MoeLiteForCausalLM"
