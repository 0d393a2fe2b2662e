"""GLM-4.5 / 4.6 / 4.7 MoE (``model_type`` ``glm4_moe``, mbridge's bridge with
``vime_shell.megatron.moe_bridge``'s adjustments): half of each head rotated, QKV bias, q/k
norms (not on GLM-4.5-Air), dense first layers, DeepSeek-style MoE (a shared expert, sigmoid
routing with an expert bias, group-limited routing).

Asserted on tiny random GLM-4.5s: the HF -> Megatron -> HF round trip is exact and the logits
equal transformers' own GLM class's (1e-5, fp32), with q/k norms and without them, two expert
groups and a shared expert two experts wide (without vime's adjustments mbridge's bridge was
0.046 off on the groups, measured once, and fails on the width); log-probs match transformers' at DP2 and EP2, which train to the same losses
(1e-6) and weights (1e-5); ``vime train`` on it (HF engine) passes the gap check after each sync and its ``--save-hf`` export loads in transformers
with the attention, the experts and the shared expert moved and the expert bias fixed.
"""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.shell.glm4_moe_workers import glm4_moe_worker
from tests.shell.train_cli import train_and_export, with_embedded_tokenizer
from vime_shell.megatron.spawn import spawn
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model


@pytest.fixture(scope="module")
def glm4_moe_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4_moe")
    dirs = {"glm45": str(build_tiny_hf_model(root / "glm45", TinyModelSpec(
                arch="glm4_moe", num_layers=3))),
            "air_groups": str(build_tiny_hf_model(root / "air", TinyModelSpec(
                arch="glm4_moe", num_layers=3, use_qk_norm=False, n_group=2, topk_group=1,
                n_shared_experts=2, seed=1)))}
    return spawn(glm4_moe_worker, 2, dirs)


def _delta(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in b)


@pytest.mark.parametrize("name", ["glm45", "air_groups"])
def test_the_round_trip_is_exact_and_logits_match_transformers(glm4_moe_runs, name):
    run = glm4_moe_runs[0]["conversion"][name]
    assert run["roundtrip_keys_equal"] and run["roundtrip_max"] == 0.0
    assert run["logit_max"] <= 1e-5


@pytest.mark.parametrize("name", ["dp2", "ep2", "air_groups"])
def test_training_log_probs_match_transformers(glm4_moe_runs, name):
    for run in (r[name] for r in glm4_moe_runs):
        assert run["hf_logprob_max"] <= 1e-5 and run["logit_max"] <= 1e-5
        assert len(run["losses"]) == 4 and all(np.isfinite(run["losses"]))


def test_expert_parallelism_trains_to_the_same_weights(glm4_moe_runs):
    ref, run = glm4_moe_runs[0]["dp2"], glm4_moe_runs[0]["ep2"]
    assert run["export_keys"] == ref["export_keys"]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= 1e-6
    assert _delta(run["final"], ref["final"]) <= 1e-5


def test_vime_train_syncs_and_exports_a_glm4_moe(tmp_path):
    model = with_embedded_tokenizer(build_tiny_hf_model(
        tmp_path / "glm45", TinyModelSpec(arch="glm4_moe", vocab_size=20)))
    trained = train_and_export(model, tmp_path)
    base = load_file(model / "model.safetensors")
    assert set(trained) == set(base)
    moved = [k for k in base if not torch.equal(trained[k], base[k])]
    assert any("q_norm" in k for k in moved) and any("shared_experts" in k for k in moved)
    assert any(".experts." in k for k in moved)
    assert not any("e_score_correction_bias" in k for k in moved)  # a fixed bias
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(native).__name__ == "Glm4MoeForCausalLM"
