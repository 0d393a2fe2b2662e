"""MiniMax-M2 (slime's ``--spec slime_plugins.models.minimax_m2``,
``vime_shell.megatron.minimax_m2_bridge``): q/k norms over all heads, half of each head
rotated, sigmoid routing with a fixed expert bias, Mixtral's names.

Asserted on a tiny random MiniMax-M2: the HF -> Megatron -> HF round trip is exact and the
logits equal transformers' (1e-5, fp32); log-probs match transformers' at DP2 and EP2, which
train to the same losses and weights; the q/k norm split over TP2 (an all-reduce of the
partial sums) gives the whole norm's outputs and gradients; ``vime train`` on it (HF engine)
passes the gap check after each sync and its ``--save-hf`` export loads in transformers with
every trained weight moved and the expert bias unchanged; the HF engine reports the experts the
biased router picked (routing replay).
"""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.shell.minimax_m2_workers import minimax_m2_worker
from tests.shell.train_cli import (assert_transformers_loads, train_and_export,
                                   with_embedded_tokenizer)
from vime_shell.megatron.spawn import spawn
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def minimax_runs(tmp_path_factory):
    model = build_tiny_hf_model(tmp_path_factory.mktemp("minimax_m2") / "m2",
                                TinyModelSpec(arch="minimax_m2", num_layers=2))
    return spawn(minimax_m2_worker, 2, str(model))


def _delta(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in b)


def test_the_round_trip_is_exact_and_logits_match_transformers(minimax_runs):
    run = minimax_runs[0]["conversion"]
    assert run["roundtrip_keys_equal"] and run["roundtrip_max"] == 0.0
    assert run["logit_max"] <= 1e-5


@pytest.mark.parametrize("name", ["dp2", "ep2"])
def test_training_log_probs_match_transformers(minimax_runs, name):
    for run in (r[name] for r in minimax_runs):
        assert run["hf_logprob_max"] <= 1e-5 and run["logit_max"] <= 1e-5
        assert len(run["losses"]) == 4 and all(np.isfinite(run["losses"]))


def test_expert_parallelism_trains_to_the_same_weights(minimax_runs):
    ref, run = minimax_runs[0]["dp2"], minimax_runs[0]["ep2"]
    assert run["export_keys"] == ref["export_keys"]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= 1e-6
    assert _delta(run["final"], ref["final"]) <= 1e-5


def test_the_all_heads_norm_split_over_tp_equals_the_whole(minimax_runs):
    for run in (r["norm_tp2"] for r in minimax_runs):
        assert run["output_max"] <= 1e-6
        assert run["input_grad_max"] <= 1e-6 and run["weight_grad_max"] <= 1e-5


def test_vime_train_syncs_and_exports_a_minimax_m2(tmp_path):
    model = with_embedded_tokenizer(build_tiny_hf_model(
        tmp_path / "m2", TinyModelSpec(arch="minimax_m2", vocab_size=20)))
    trained = train_and_export(model, tmp_path)
    base = load_file(model / "model.safetensors")
    assert set(trained) == set(base)
    moved = [k for k in base if not torch.equal(trained[k], base[k])]
    assert any("q_norm" in k for k in moved) and any(".experts." in k for k in moved)
    assert not any("e_score_correction_bias" in k for k in moved)  # a fixed bias
    assert assert_transformers_loads(tmp_path / "hf", trained, moved) == "MiniMaxM2ForCausalLM"


def test_the_hf_engine_routes_as_the_biased_router_picks(tmp_path):
    """Routing replay: the engine reports the experts the router chose (its sigmoid scores
    plus the expert bias), not the top-k of its logits. With a bias of +10 on experts 0 and
    1 every token goes to them, whatever the logits say."""
    from safetensors.torch import save_file

    from vime_shell.engines.base import SamplingParams
    from vime_shell.engines.hf import HfEngine

    model = build_tiny_hf_model(tmp_path / "m2", TinyModelSpec(arch="minimax_m2"))
    tensors = load_file(model / "model.safetensors")
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.tensor([-10.0, 10.0, -10.0, 10.0])
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    engine = HfEngine(model, return_routed_experts=True)
    out = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=3, seed=0))
    for generation in out:
        assert generation.routed_experts.shape[1:] == (2, 2)  # layers, top-k
        assert set(np.unique(generation.routed_experts)) == {1, 3}
