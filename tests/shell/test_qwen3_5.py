"""Qwen3.5 (dense; slime's ``--spec slime_plugins.models.qwen3_5``,
``vime_shell.megatron.qwen3_5_bridge``): linear attention (transformers' gated delta-net in
Megatron's attention slot) in three of every four layers, gated attention, (1 + w) norms, a
quarter of each head rotated, the checkpoint written multimodal as released.

Asserted on a tiny random Qwen3.5: the HF -> Megatron -> HF round trip of the language model
is exact (the vision tower is left out, and said so) and the logits equal transformers'
``Qwen3_5ForCausalLM`` (1e-5, fp32); log-probs match transformers' at DP2, TP2 and PP2, which
train to the same losses and weights; the linear-attention layer split by sequence
parallelism or by context parallelism's zigzag chunks gives the whole layer's outputs and
gradients; ``vime train`` on it (HF engine) passes the gap check after each sync, and its
``--save-hf`` export loads in transformers with every trained weight moved.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.metric_keys import without_timing
from tests.shell.qwen3_5_workers import fuse_experts, qwen3_5_worker
from tests.shell.train_cli import (assert_transformers_loads, train_and_export, vime,
                                   with_embedded_tokenizer)
from vime_shell.megatron.spawn import spawn
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen3_5_model(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("qwen3_5") / "qwen3_5",
                               TinyModelSpec(arch="qwen3_5", num_layers=4))


@pytest.fixture(scope="module")
def qwen3_5_runs(qwen3_5_model, tmp_path_factory):
    moe = build_tiny_hf_model(tmp_path_factory.mktemp("qwen3_5_moe") / "moe",
                              TinyModelSpec(arch="qwen3_5_moe", num_layers=4))
    fused = fuse_experts(moe, moe.parent / "fused")
    nxt = build_tiny_hf_model(moe.parent / "next", TinyModelSpec(arch="qwen3_next", num_layers=4))
    return spawn(qwen3_5_worker, 2, {"dense": str(qwen3_5_model), "moe": str(moe),
                                     "moe_fused": str(fused), "next": str(nxt)})


def _delta(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in b)


@pytest.mark.parametrize("name, hf_class", [("dense", "Qwen3_5ForCausalLM"),
                                             ("moe", "Qwen3_5MoeForCausalLM"),
                                             ("moe_fused", "Qwen3_5MoeForCausalLM"),
                                             ("next", "Qwen3NextForCausalLM")])
def test_the_language_model_round_trip_is_exact_and_logits_match_transformers(
        qwen3_5_runs, name, hf_class):
    """A fused checkpoint (Qwen3.5-MoE's release) loads and exports its experts one by one;
    Qwen3-Next's checkpoint is text only (no vision tower)."""
    run = qwen3_5_runs[0]["conversion"][name]
    assert run["hf_class"] == hf_class
    assert run["keys_equal"] and run["roundtrip_max"] == 0.0
    assert (run["visual"] == 0) == (name == "next")
    assert run["logit_max"] <= 1e-5


@pytest.mark.parametrize("name", ["dp2", "tp2", "pp2"])
def test_training_log_probs_match_transformers(qwen3_5_runs, name):
    for run in (r[name] for r in qwen3_5_runs):
        assert run["hf_logprob_max"] <= 1e-5
        assert run["logit_max"] is None or run["logit_max"] <= 1e-5  # None under PP
        assert len(run["losses"]) == 4 and all(np.isfinite(run["losses"]))


@pytest.mark.parametrize("model", ["moe", "next"])
@pytest.mark.parametrize("name", ["dp2", "ep2"])
def test_moe_log_probs_match_transformers_and_ep2_trains_as_dp2(qwen3_5_runs, model, name):
    for run in (r[model][name] for r in qwen3_5_runs):
        assert run["hf_logprob_max"] <= 1e-5 and run["logit_max"] <= 1e-5
        assert run["transformer"]["moe_shared_expert_gate"]
    ref, run = qwen3_5_runs[0][model]["dp2"], qwen3_5_runs[0][model][name]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= 1e-6
    assert _delta(run["final"], ref["final"]) <= 1e-5


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_layouts_train_to_the_same_weights(qwen3_5_runs, name):
    """TP2's embedding rows sum their gradient in another order (see test_glm4.py)."""
    ref, run = qwen3_5_runs[0]["dp2"], qwen3_5_runs[0][name]
    assert run["export_keys"] == ref["export_keys"]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= 1e-6
    assert _delta({k: v for k, v in run["final"].items() if "embed" not in k},
                  {k: v for k, v in ref["final"].items() if "embed" not in k}) <= 1e-5


@pytest.mark.parametrize("name", ["sp", "cp"])
def test_the_split_linear_attention_layer_equals_the_whole(qwen3_5_runs, name):
    for run in (r["split"][name] for r in qwen3_5_runs):
        assert run["output_max"] <= 1e-6
        # CP sums each position's gradient over the ranks in another order (measured 1.1e-6
        # on the input, 7.6e-6 on the weights)
        assert run["input_grad_max"] <= 1e-5 and run["weight_grad_max"] <= 1e-4


@pytest.mark.parametrize("arch, hf_class", [("qwen3_5", "Qwen3_5ForCausalLM"),
                                             ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
                                             ("qwen3_next", "Qwen3NextForCausalLM")])
def test_vime_train_syncs_and_exports_a_qwen3_5(tmp_path, arch, hf_class):
    """The export holds the trained language model under the checkpoint's names beside the
    checkpoint's config.json, and the tensors vime does not train as they were: the vision
    tower and the MTP layer (``--mtp-num-layers 1``, checked against config.json);
    transformers loads the language model from it."""
    model = with_embedded_tokenizer(build_tiny_hf_model(
        tmp_path / arch, TinyModelSpec(arch=arch, num_layers=4, vocab_size=20)))
    with_mtp_layer(model)
    trained = train_and_export(model, tmp_path, "--mtp-num-layers", "1")
    base = load_file(model / "model.safetensors")
    assert set(trained) == set(base)
    untrained = [k for k in base if k.startswith(("mtp.", "model.visual."))]
    assert any(k.startswith("mtp.") for k in untrained)
    assert all(torch.equal(trained[k], base[k]) for k in untrained)
    moved = [k for k in trained if not torch.equal(trained[k], base[k])]
    assert not set(moved) & set(untrained) and any(".linear_attn.A_log" in k for k in moved)
    assert any(".self_attn.q_proj" in k for k in moved) and any("q_norm" in k for k in moved)
    if arch != "qwen3_5":
        assert any(".experts.0." in k for k in moved) and any("shared_expert_gate" in k
                                                               for k in moved)
    assert assert_transformers_loads(tmp_path / "hf", trained, moved) == hf_class


def with_mtp_layer(model: Path) -> Path:
    """``model`` with one multi-token prediction layer's tensors, named as Qwen3.5's and
    Qwen3-Next's checkpoints name them, and its count in config.json."""
    import json

    from safetensors.torch import save_file

    tensors = load_file(model / "model.safetensors")
    hidden = next(v for k, v in tensors.items() if k.endswith("embed_tokens.weight")).shape[1]
    tensors.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden),
                    "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden),
                    "mtp.pre_fc_norm_hidden.weight": torch.randn(hidden),
                    "mtp.layers.0.mlp.down_proj.weight": torch.randn(hidden, 8),
                    "mtp.norm.weight": torch.randn(hidden)})
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_the_layer_pattern_and_norms_of_either_spec(qwen3_5_model):
    """Linear attention where ``layer_types`` says so (from the stage's first layer on); the
    local spec's norms are all (1 + w); TransformerEngine's spec, whose input norm is fused
    into the QKV projection, gives each linear-attention layer a ``TENorm`` of its own."""
    import copy

    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from vime_shell.megatron.linear_attention import LinearAttention
    from vime_shell.megatron.qwen3_5_bridge import OnePlusRMSNorm, Qwen3_5, hybrid_spec
    from vime_shell.models.auto_config import auto_config

    text = auto_config(qwen3_5_model)
    local = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    fused = copy.deepcopy(local)  # TransformerEngine's layer: its input norm fused away
    fused.submodules.input_layernorm = IdentityOp
    for te, layer in ((False, local), (True, fused)):
        base = TransformerBlockSubmodules(layer_specs=[layer, layer], layer_norm=TENorm)
        spec = hybrid_spec(base, text, transformer_engine=te, offset=2,  # layers 2 and 3
                           gdn_class=Qwen3_5.GDN_CLASS)
        linear, full = (layer.submodules for layer in spec.layer_specs)
        assert linear.self_attention.module is LinearAttention
        assert full.self_attention.module is not LinearAttention
        if te:
            assert linear.input_layernorm is TENorm and full.input_layernorm is IdentityOp
        else:
            assert spec.layer_norm is OnePlusRMSNorm
            assert {linear.input_layernorm, full.input_layernorm, full.pre_mlp_layernorm,
                    full.self_attention.submodules.q_layernorm} == {OnePlusRMSNorm}


def test_qwen3_5_flags_on_another_model_fail_naming_both(tmp_path):
    model = build_tiny_hf_model(tmp_path / "qwen2", TinyModelSpec())
    done = vime("train", "--hf-checkpoint", str(model), "--apply-layernorm-1p", "--dry-run",
                "--run-dir", str(tmp_path / "run"), home=tmp_path, timeout=300)
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert "--apply-layernorm-1p" in line and '"model_type": \'qwen2\'' in line, line


def test_a_resumed_run_ends_where_the_uninterrupted_one_ends(tmp_path):
    """The checkpoint holds transformers' modules inside Megatron's layers: every layer is
    saved under its own key (the layers differ), and ``--load`` brings back the same run."""
    model = with_embedded_tokenizer(build_tiny_hf_model(
        tmp_path / "qwen3_5", TinyModelSpec(arch="qwen3_5", num_layers=4, vocab_size=20)))

    def run(name: str, rollouts: int, *extra: str) -> list[dict]:
        done = vime("train", "--hf-checkpoint", str(model), "--run-dir", str(tmp_path / name),
                    "--num-rollout", str(rollouts), "--rollout-batch-size", "8",
                    "--n-samples-per-prompt", "4", "--global-batch-size", "32", "--lr", "1e-3",
                    "--custom-rm-path", "tests.shell.tied_workers:parity_reward", *extra,
                    home=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [without_timing(json.loads(line)) for line in lines]

    full = run("full", 3)
    run("first", 2, "--save", str(tmp_path / "ckpt"), "--save-interval", "2")
    resumed = run("resumed", 3, "--load", str(tmp_path / "ckpt"))
    assert [x["rollout"] for x in resumed] == [2] and resumed[0] == full[2]
