"""Activation recompute, Llama-3 RoPE, uneven pipelines (with virtual stages) and MoE with expert
parallelism on CPU.

All read the shared 2-process spawn (``megatron_runs``; runs in ``model_workers``). Each run
trains two synthetic rollouts (4 Adam steps, lr 1e-4, fp32) from one HF checkpoint.

Tolerances are the measured ones (``stack-facts.md``, "MoE, expert parallelism and
recompute"): full and selective core_attn / mlp recompute are bit-identical to none; layernorm
recompute reorders one sum (~5e-8 in losses and gradients, up to ~1e-6 in Adam-updated
weights); EP2 vs EP1 weights within 1e-5 (Adam turns round-off in
near-zero gradients into +-lr updates).
"""

import numpy as np
import pytest

from tests.shell.model_workers import MOE_TWO_RANKS

pytestmark = pytest.mark.slow


def _delta(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.fixture(scope="module")
def one(megatron_runs):
    return megatron_runs["per_rank"][0]["features_1"]


@pytest.fixture(scope="module")
def two(megatron_runs):
    return [megatron_runs["per_rank"][rank]["features_2"] for rank in (0, 1)]


@pytest.mark.parametrize("name,tol", [("full_uniform", 0.0), ("full_block", 0.0),
                                      ("selective", 1e-6)])
def test_recompute_gives_the_same_losses_gradients_and_weights(one, name, tol):
    ref, run = one["dense_none"], one[f"dense_{name}"]
    assert run["transformer"]["recompute_granularity"] == name.split("_")[0]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= tol
    assert float(np.max(np.abs(run["grad"] - ref["grad"]))) <= tol
    # Adam turns a reordered sum's round-off in near-zero gradients into lr-sized updates:
    # the weights get the layout tests' 1e-5 where recompute is not bit-identical.
    assert _delta(run["final"], ref["final"]) <= (1e-5 if tol else 0.0)


def test_recompute_loss_function_gives_the_same_training(one):
    ref, run = one["dense_none"], one["dense_recompute_loss"]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= 1e-7
    assert float(np.max(np.abs(run["grad"] - ref["grad"]))) <= 1e-7
    assert _delta(run["final"], ref["final"]) <= 1e-6


def test_recompute_runs_the_recomputed_modules_again_in_the_backward(one):
    layers, k = 4, one["dense_none"]["microbatches"]
    # Per rollout: K micro-batches x 4 layers forwards, plus the log-prob pass (forward only).
    base = one["dense_none"]["forwards"][-1]
    assert base["mlp"] == base["core_attention"] == layers * k
    # uniform, 1 layer per chunk: every layer again; block, 1 layer: the first layer again.
    assert one["dense_full_uniform"]["forwards"][-1]["mlp"] == 2 * layers * k
    assert one["dense_full_block"]["forwards"][-1]["mlp"] == layers * k + k
    selective = one["dense_selective"]["forwards"][-1]
    assert selective["mlp"] == selective["core_attention"] == 2 * layers * k


def test_moe_recompute_matches_no_recompute(one, two):
    ref = one["moe_ep1"]
    run = one["moe_ep1_recompute_moe"]
    assert run["forwards"][-1]["mlp"] == 2 * ref["forwards"][-1]["mlp"]
    assert _delta(run["final"], ref["final"]) == 0.0
    assert _delta(two[0]["ep2_recompute"]["final"], two[0]["ep2"]["final"]) == 0.0


def test_llama3_rope_scaling_matches_transformers_and_trains(one):
    run = one["llama3"]
    assert run["scaled_dims"] > 0  # the checkpoint's scaling changes some frequencies
    assert run["inv_freq_max"] <= 1e-12
    assert run["logit_max"] <= 1e-5
    assert len(run["losses"]) == 4 and all(np.isfinite(run["losses"]))


@pytest.mark.parametrize("name", ["moe_ep1", "qwen2_moe"])
def test_moe_models_match_transformers(one, name):
    run = one[name]
    assert run["logit_max"] <= 1e-5 and run["hf_logprob_max"] <= 1e-5
    assert run["transformer"]["num_moe_experts"] == 4
    # Qwen3-MoE normalises the top-k probabilities; Qwen2-MoE does not, and gates its shared
    # expert (the MoE adjustments of vime_shell.megatron.moe_bridge).
    assert run["transformer"]["moe_router_pre_softmax"] is (name == "qwen2_moe")
    assert run["transformer"]["moe_shared_expert_gate"] is (name == "qwen2_moe")
    assert any(".mlp.experts.3." in k for k in run["export_keys"])


def test_expert_parallel_training_equals_ep1(one, two):
    ref, run = one["moe_ep1"], two[0]["ep2"]
    assert run["transformer"]["expert_model_parallel_size"] == 2
    assert run["export_keys"] == ref["export_keys"]  # every expert exported, once
    assert run["logit_max"] <= 1e-5
    delta = _delta(run["final"], ref["final"])
    print(f"EP2 vs EP1: max |param delta| {delta:.2e}")
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= 1e-6
    assert delta <= 1e-5
    assert _delta(two[0]["ep2"]["final"], two[1]["ep2"]["final"]) == 0.0


def test_expert_parallel_aux_loss_equals_dp2(two):
    # The load-balancing loss is a per-micro-batch statistic, so it is compared on the same
    # schedule (DP2); EP changes only where the experts run.
    assert _delta(two[0]["ep2_aux"]["final"], two[0]["dp2_aux"]["final"]) <= 1e-5
    assert _delta(two[0]["ep2_aux"]["final"], two[0]["ep2"]["final"]) > 1e-6  # the loss acts
    assert [name for name, _, _ in MOE_TWO_RANKS] == ["ep2", "ep2_recompute", "ep2_aux",
                                                       "dp2_aux"]


def test_offload_train_frees_every_storage_and_comes_back_exactly(one):
    run, ref = one["dense_offload"], one["dense_none"]
    info = run["offload"]
    assert info["param_bytes_left"] == 0  # every parameter's storage was emptied
    # weights (fp32) + DDP grad buffer + Adam's two moments, at least
    assert info["bytes"] >= 4 * info["param_bytes"]
    assert info["roundtrip_max"] == 0.0
    assert _delta(run["final"], ref["final"]) == 0.0  # training continues as if never offloaded
    assert run["losses"] == ref["losses"]


def test_streaming_save_hf_holds_about_one_shard_not_the_model(one):
    run = one["streaming_export"]
    assert run["keys_equal"] and run["max_diff"] == 0.0
    assert run["dtypes"] == ["torch.bfloat16"]  # the requested export dtype, not the trained fp32
    assert run["shards"] >= 5
    # the writer's shard, the bucket being handed over, and one tensor of look-ahead
    assert run["peak"] <= 2 * run["limit"] + run["largest"]
    assert run["peak"] < run["model_bytes"] / 2


@pytest.mark.parametrize("name", ["uneven", "uneven_vpp"])
def test_uneven_pipeline_with_virtual_stages_equals_dp1(one, two, name):
    ref, runs = one["dense6"], [two[rank][name] for rank in (0, 1)]
    # --decoder-first-pipeline-num-layers 4 of 6; --num-virtual-stages-per-pipeline-rank 2
    assert [run["chunk_layers"] for run in runs] == ([[4], [2]] if name == "uneven"
                                                     else [[2, 2], [1, 1]])
    assert max(abs(a - b) for a, b in zip(runs[0]["losses"], ref["losses"])) <= 1e-6
    assert _delta(runs[0]["final"], ref["final"]) <= 1e-5
    assert _delta(runs[0]["final"], runs[1]["final"]) == 0.0
