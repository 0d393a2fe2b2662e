"""The memory estimator on docs/large-models.md's two runs (a 7B dense and a 30B-A3B MoE)."""

import attrs
import pytest

from vime_pure.errors import MemoryEstimateError
from vime_pure.memory import GIB, MemoryPlan, ModelShape, estimate_memory

QWEN25_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 18944,
             "vocab_size": 152064, "tie_word_embeddings": False}
QWEN3_30B_A3B = {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "vocab_size": 151936, "decoder_sparse_step": 1, "mlp_only_layers": []}
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1)


def test_7b_dense_on_8_h100s_the_docstring_example():
    shape = ModelShape.from_hf_config(QWEN25_7B)
    plan = MemoryPlan(gpu_bytes=80 * GIB, tokens_per_microbatch=16384, tp=2, dp=4,
                      distributed_optimizer=True, **RECOMPUTE)
    gib = estimate_memory(shape, plan).as_gib()
    assert (gib["weights"], gib["grads"], gib["optimizer"]) == (7.1, 14.2, 10.6)
    assert (gib["activations"], gib["activations_no_recompute"]) == (11.7, 35.3)
    assert (gib["train_peak"], gib["generate_peak"]) == (43.6, 71.9)
    offloaded = estimate_memory(shape, attrs.evolve(plan, offload_train=True))
    assert offloaded.as_gib()["generate_peak"] == 40.0 and offloaded.fits


def test_30b_a3b_moe_on_8_h200s_needs_trainer_offload():
    shape = ModelShape.from_hf_config(QWEN3_30B_A3B)
    assert shape.num_experts == 128 and shape.moe_layers == 48
    h200 = 141 * 10**9
    plan = dict(gpu_bytes=h200, tokens_per_microbatch=16384, dp=8, ep=8,
                distributed_optimizer=True, **RECOMPUTE)
    resident = estimate_memory(shape, MemoryPlan(**plan))
    # With EP 8 on 8 GPUs each expert has one replica: its Adam state is not sharded.
    assert resident.as_gib()["optimizer"] == 42.7
    assert not resident.fits  # the engine's half plus the resident trainer: 137 GiB > 131
    offloaded = estimate_memory(shape, MemoryPlan(**plan, offload_train=True))
    assert offloaded.fits
    assert offloaded.as_gib()["train_peak"] == 94.1


def test_bad_sizes_are_typed_errors():
    shape = ModelShape.from_hf_config(QWEN3_30B_A3B)
    with pytest.raises(MemoryEstimateError, match="ep=3"):
        estimate_memory(shape, MemoryPlan(gpu_bytes=GIB, tokens_per_microbatch=1, ep=3))
    with pytest.raises(MemoryEstimateError, match="tp=0"):
        estimate_memory(shape, MemoryPlan(gpu_bytes=GIB, tokens_per_microbatch=1, tp=0))


def test_a_runs_flags_become_the_plan(tmp_path):
    import json

    from vime_shell.megatron.layout import resolve_layout
    from vime_shell.run.memory_report import estimate_run
    from vime_shell.settings.flags import parse_train_config

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    cfg = parse_train_config(["--max-tokens-per-gpu", "16384", "--use-distributed-optimizer",
                              "--recompute-granularity", "full", "--recompute-method",
                              "uniform", "--recompute-num-layers", "1",
                              "--tensor-model-parallel-size", "2", "--offload-train"])
    layout = resolve_layout(world_size=8, num_layers=28, supports_context_parallel=False, tp=2)
    gib = estimate_run(cfg, tmp_path, layout, gpu_bytes=80 * GIB).as_gib()
    assert (gib["train_peak"], gib["generate_peak"]) == (43.6, 40.0)


def test_muon_keeps_one_moment_for_the_decoders_weights():
    """Under --optimizer muon the decoder's weights (experts too) keep one fp32 momentum where
    Adam keeps two: 4 bytes less per decoder parameter (plus the fp32 master either way); the
    embedding and LM head stay Adam's."""
    for config, kw in ((QWEN25_7B, {"tp": 2}), (QWEN3_30B_A3B, {"ep": 8, "dp": 8})):
        shape = ModelShape.from_hf_config(config)
        plan = MemoryPlan(gpu_bytes=80 * GIB, tokens_per_microbatch=16384, **kw)
        adam = estimate_memory(shape, plan)
        muon = estimate_memory(shape, attrs.evolve(plan, optimizer="muon"))
        embedding = 2 * shape.vocab * shape.hidden / plan.tp  # untied: embedding and LM head
        decoder = adam.weights / plan.param_bytes - embedding
        assert muon.optimizer == pytest.approx(adam.optimizer - 4 * decoder, rel=1e-6)
        assert (muon.weights, muon.grads, muon.activations) == \
            (adam.weights, adam.grads, adam.activations)
    with pytest.raises(MemoryEstimateError, match="optimizer='sgd': is not one of"):
        estimate_memory(shape, attrs.evolve(plan, optimizer="sgd"))
