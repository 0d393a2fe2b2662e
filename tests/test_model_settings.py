"""Recompute, MoE, uneven-pipeline and offload settings: parsed as slime spells them, checked
at launch with the flag, the value and the fix, before anything heavy is built."""

import attrs
import pytest

from vime_shell.megatron.layout import UnsupportedLayoutError, resolve_layout
from vime_shell.megatron.model_options import ModelOptions, ModelOptionsError
from vime_shell.megatron.rope import RopeScaling, gpt_rope_args, rope_scaling_of
from vime_shell.models.hf_config import (HfConfigSummary, ModelLoadError, check_config,
                                         first_dense_layers)
from vime_shell.run.model_checks import check_model_settings
from vime_shell.settings.flags import parse_train_config
from vime_shell.settings.train_config import ConfigError, TrainConfig

DENSE = HfConfigSummary(model_type="qwen2", num_layers=4, vocab_size=128,
                        max_position_embeddings=512)
MOE = HfConfigSummary(model_type="qwen3_moe", num_layers=4, vocab_size=128,
                      max_position_embeddings=512, num_experts=4)


def _layout(**kw):
    return resolve_layout(world_size=kw.pop("world_size", 2), num_layers=kw.pop("layers", 4),
                          supports_context_parallel=False, **kw)


def test_recompute_flags_reach_megatrons_config_fields():
    cfg = parse_train_config(["--recompute-granularity", "full", "--recompute-method", "block",
                              "--recompute-num-layers", "2"])
    assert cfg.model_options().transformer_fields() == {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}
    selective = parse_train_config(["--recompute-granularity", "selective",
                                    "--recompute-modules", "core_attn", "mlp"])
    assert selective.model_options().transformer_fields()["recompute_modules"] == [
        "core_attn", "mlp"]
    assert ModelOptions().transformer_fields() == {}


@pytest.mark.parametrize("kwargs,match", [
    ({"recompute_granularity": "full"}, "--recompute-method and --recompute-num-layers"),
    ({"recompute_method": "uniform"}, "without --recompute-granularity"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 1}, "takes no"),
    ({"recompute_granularity": "selective", "recompute_modules": ("attn",)}, "'attn'"),
    ({"recompute_granularity": "selective", "recompute_modules": ("moe_act",)},
     "--moe-grouped-gemm"),
    ({"moe_token_dispatcher_type": "allgather"}, "moe.token.dispatcher.type"),
    ({"moe_router_topk": 0}, "moe.router.topk"),
])
def test_inconsistent_model_options_name_the_flag(kwargs, match):
    with pytest.raises(ModelOptionsError, match=match):
        ModelOptions(**kwargs)
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**kwargs)


def test_uneven_pipeline_stages():
    layout = _layout(pp=2, first_stage_layers=1)
    assert layout.stage_layers(4) == (1, 3)
    assert _layout(world_size=3, pp=3, layers=7, first_stage_layers=1,
                   last_stage_layers=2).stage_layers(7) == (1, 4, 2)
    assert _layout(pp=2).stage_layers(4) == (2, 2)
    with pytest.raises(UnsupportedLayoutError, match="--decoder-first-pipeline-num-layers"):
        _layout(pp=2, layers=5)  # uneven without the flags: the fix names them
    with pytest.raises(UnsupportedLayoutError, match="remaining"):
        _layout(world_size=3, pp=3, layers=6, first_stage_layers=1)  # 5 over 2 stages
    with pytest.raises(UnsupportedLayoutError, match="need 2 stages or more"):
        _layout(world_size=1, first_stage_layers=1)
    with pytest.raises(UnsupportedLayoutError, match="--num-virtual-stages-per-pipeline-rank"):
        _layout(pp=2, first_stage_layers=1, num_layers_per_virtual_stage=1)


def test_uneven_pipeline_stages_with_virtual_stages_per_rank():
    layout = _layout(pp=2, layers=6, first_stage_layers=4, num_virtual_stages=2)
    assert (layout.vpp, layout.microbatch_group, layout.stage_layers(6)) == (2, 2, (4, 2))
    even = _layout(pp=2, layers=4, num_virtual_stages=2)  # Megatron-LM's other spelling
    assert (even.vpp, even.microbatch_group) == (2, 2)
    with pytest.raises(UnsupportedLayoutError, match=r"=2: .*divide every .*\[3, 3\]"):
        _layout(pp=2, layers=6, first_stage_layers=3, num_virtual_stages=2)
    with pytest.raises(UnsupportedLayoutError, match="pass one of the two"):
        _layout(pp=2, layers=4, num_virtual_stages=2, num_layers_per_virtual_stage=1)
    cfg = parse_train_config(["--num-virtual-stages-per-pipeline-rank", "2"])
    assert cfg.num_virtual_stages_per_pipeline_rank == 2


def test_expert_parallel_layout_checks():
    layout = _layout(ep=2, num_experts=4)
    assert (layout.dp, layout.ep, layout.etp) == (2, 2, 1)
    with pytest.raises(UnsupportedLayoutError, match="dense model"):
        _layout(ep=2)
    with pytest.raises(UnsupportedLayoutError, match="4 experts"):
        _layout(world_size=3, ep=3, num_experts=4)
    with pytest.raises(UnsupportedLayoutError, match="--expert-tensor-parallel-size x "
                       "--expert-model-parallel-size x --pipeline-model-parallel-size"):
        _layout(ep=4, num_experts=4)


@pytest.mark.parametrize("flag", ["--optimizer-cpu-offload", "--moe-grouped-gemm",
                                  "--moe-permute-fusion"])
def test_cuda_only_flags_are_refused_on_cpu(flag):
    cfg = parse_train_config([flag])
    with pytest.raises(ConfigError, match=f"{flag.lstrip('-').replace('-', '_')}=True: is "
                                          "CUDA-only"):
        check_model_settings(cfg, MOE, _layout(num_experts=4))


def test_precision_aware_optimizer_without_te_is_torch_adam_with_fp32_state():
    """Megatron's default state dtypes are fp32: without TransformerEngine the flag changes
    nothing (a launch note says so; the trainer asks for TE's FusedAdam only with TE)."""
    cfg = parse_train_config(["--use-precision-aware-optimizer"])
    check_model_settings(cfg, DENSE, _layout())
    with pytest.raises(ConfigError, match="--optimizer-cpu-offload"):
        parse_train_config(["--overlap-cpu-optimizer-d2h-h2d"])


def test_routing_replay_runs_where_the_engine_returns_routes_and_is_refused_elsewhere():
    cfg = parse_train_config(["--use-rollout-routing-replay", "--rollout-engine", "hf"])
    assert cfg.model_options().moe_enable_routing_replay
    check_model_settings(cfg, MOE, _layout(num_experts=4))  # the HF engine returns them
    with pytest.raises(ConfigError, match="dense"):
        check_model_settings(cfg, DENSE, _layout())
    vllm_cpu = parse_train_config(["--use-rollout-routing-replay", "--rollout-engine", "vllm"])
    with pytest.raises(ConfigError, match="use_rollout_routing_replay=True: .*triton-cpu"):
        check_model_settings(vllm_cpu, MOE, _layout(num_experts=4))


def test_moe_flags_on_a_dense_model_and_recompute_layers_per_stage():
    with pytest.raises(ConfigError, match="moe_router_topk=8: applies to MoE models"):
        check_model_settings(parse_train_config(["--moe-router-topk", "8"]), DENSE, _layout())
    check_model_settings(parse_train_config(["--moe-router-topk", "2"]), DENSE, _layout())
    with pytest.raises(ConfigError, match="exceeds the model's 4 experts"):
        check_model_settings(parse_train_config(["--moe-router-topk", "8"]), MOE,
                             _layout(num_experts=4))
    cfg = parse_train_config(["--recompute-granularity", "full", "--recompute-method",
                              "uniform", "--recompute-num-layers", "2"])
    check_model_settings(cfg, DENSE, _layout(pp=2))  # stages of 2 layers
    with pytest.raises(ConfigError, match="smallest pipeline stage"):
        check_model_settings(cfg, DENSE, _layout(pp=2, first_stage_layers=1))


def test_rope_scaling_parsing():
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
              "rope_theta": 5e5}
    assert rope_scaling_of(llama3) == RopeScaling(kind="llama3", factor=32.0,
                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=8192)
    assert gpt_rope_args(rope_scaling_of(llama3)) == {}  # applied after construction
    linear = rope_scaling_of({"type": "linear", "factor": 4.0})
    assert gpt_rope_args(linear) == {"seq_len_interpolation_factor": 4.0}
    assert rope_scaling_of(None) == RopeScaling()
    for bad, match in (({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
                       ({"rope_type": "linear"}, "lacks"),
                       ({**llama3, "high_freq_factor": 0.5}, "high_freq_factor")):
        with pytest.raises(ModelLoadError, match=match):
            rope_scaling_of(bad)


def test_expert_tensor_parallelism_other_than_tp_needs_transformer_engine():
    cfg = parse_train_config(["--expert-tensor-parallel-size", "2"])
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size=2: differs"):
        check_model_settings(cfg, MOE, _layout(etp=2, num_experts=4))
    same = parse_train_config(["--expert-tensor-parallel-size", "1"])
    check_model_settings(same, MOE, _layout(num_experts=4))  # equal to TP: fine


@pytest.mark.parametrize("tp,fits", [(1, True), (2, True), (14, True), (4, False), (7, False)])
def test_tp_against_the_attention_and_kv_heads(tp, fits):
    # Qwen2.5-0.5B's heads: 14 query heads, 2 KV heads. TP 14 gives each KV head to 7 ranks
    # (more TP ranks than KV heads); TP 4 splits no head count evenly, and TP 7 splits the
    # query heads but is neither a divisor nor a multiple of the 2 KV heads.
    qwen = HfConfigSummary(model_type="qwen2", num_layers=24, vocab_size=151936,
                           max_position_embeddings=32768, num_attention_heads=14,
                           num_key_value_heads=2)
    cfg = TrainConfig(tensor_model_parallel_size=tp)
    layout = _layout(world_size=tp, layers=24, tp=tp)
    if fits:
        check_model_settings(cfg, qwen, layout)
        return
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=\d: does not fit the "
                       r"model's 14 attention heads and 2 KV heads.*\[1, 2, 14\]"):
        check_model_settings(cfg, qwen, layout)


def test_vime_train_refuses_a_tp_the_heads_do_not_fit(tmp_path, monkeypatch, capsys):
    import json

    from vime_shell.cli.main import main

    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": 24, "vocab_size": 151936,
        "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896,
        "intermediate_size": 4864}))
    monkeypatch.setenv("WORLD_SIZE", "4")
    code = main(["train", "--hf-checkpoint", str(model), "--tensor-model-parallel-size", "4",
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "--tensor-model-parallel-size=4: does not fit the model's 14 " \
        "attention heads and 2 KV heads" in err, err
    assert not (tmp_path / "run").exists()


def test_routing_replay_turns_off_the_fused_router_and_refuses_sinkhorn():
    fields = ModelOptions(moe_enable_routing_replay=True).transformer_fields()
    assert fields == {"moe_enable_routing_replay": True, "moe_router_fusion": False}
    with pytest.raises(ModelOptionsError, match="sinkhorn"):
        ModelOptions(moe_enable_routing_replay=True, moe_router_load_balancing_type="sinkhorn")


def test_glm_4_7_flash_is_built_as_deepseek_v3_with_its_dense_layers_first(tmp_path):
    """GLM-4.7-Flash (glm4_moe_lite) is no longer refused; its mlp_layer_types become
    first_k_dense_replace, and a pattern DeepSeek-V3 cannot hold is refused at launch."""
    config = {"model_type": "glm4_moe_lite", "num_hidden_layers": 3, "vocab_size": 32,
              "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
              "mlp_layer_types": ["dense", "sparse", "sparse"]}
    check_config(config, tmp_path / "config.json")
    assert first_dense_layers(config["mlp_layer_types"], tmp_path) == 1
    with pytest.raises(ModelLoadError, match="not dense layers followed by MoE layers"):
        check_config({**config, "mlp_layer_types": ["sparse", "dense", "sparse"]},
                     tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match='"first_k_dense_replace" is 2 but'):
        check_config({**config, "first_k_dense_replace": 2}, tmp_path / "config.json")


def test_megatrons_no_switches_parse_as_given():
    """--no-position-embedding is Megatron's switch on (argparse's BooleanOptionalAction read
    every --no-... spelling as False, so slime's GLM-4.7 model file failed its check)."""
    assert parse_train_config(["--no-position-embedding"]).no_position_embedding is True
    assert parse_train_config(["--no-save-optim"]).no_save_optim is True


@pytest.mark.parametrize("model_type, reason", [
    ("deepseek_v2", "DeepSeek-V2"), ("qwen2_5_vl", "multimodal")])
def test_a_family_the_bridge_cannot_build_is_refused_at_launch(model_type, reason, tmp_path):
    """Before anything heavy is built (such a bridge fails inside Megatron's config, or
    mbridge has none): one line naming the family and the reason."""
    config = {"model_type": model_type, "num_hidden_layers": 2, "vocab_size": 32,
              "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
    with pytest.raises(ModelLoadError, match=rf"has \"model_type\" '{model_type}': not "
                                             rf"supported in vime \({reason}"):
        check_config(config, tmp_path / "config.json")
    check_config({**config, "model_type": "qwen3"}, tmp_path / "config.json")


def test_vllm_is_refused_for_a_model_type_only_remote_code_defines():
    """MiMo reads as Qwen2 in vime (its engines and bridge run no checkpoint code); vLLM reads
    its config.json only through that code (Kimi-K2's it maps itself)."""
    mimo = attrs.evolve(DENSE, model_type="mimo")
    check_model_settings(parse_train_config(["--rollout-engine", "hf"]), mimo, _layout())
    with pytest.raises(ConfigError, match="--rollout-engine='vllm': reads a mimo config.json "
                                          "only as the checkpoint's remote code.*Fix: use "
                                          "--rollout-engine hf"):
        check_model_settings(parse_train_config(["--rollout-engine", "vllm"]), mimo, _layout())
