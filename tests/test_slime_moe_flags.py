"""slime's MoE-router, RoPE-scaling and pass-through flags: each is checked against the HF
config, wired, or accepted with its one-line note; none is refused by string distance."""

import pytest

from vime_shell.cli.main import main
from vime_shell.run.components import engine_options
from vime_shell.settings.flags import parse_train_config
from vime_shell.settings.megatron_args import ModelArgsError, check_architecture, notes
from vime_shell.settings.moe_architecture import LayerPatternError, moe_layer_pattern
from vime_shell.settings.slime_flags import UNSUPPORTED_VALUES
from vime_shell.settings.train_config import ConfigError, TrainConfig

# A Qwen3-MoE-style config.json (as slime's scripts/models/qwen3-30B-A3B.sh describes it)
QWEN3_MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
             "num_experts_per_tok": 2, "hidden_size": 64, "num_attention_heads": 4}


def _exit(argv, capsys) -> tuple[int, str]:
    try:
        status = main(["train", *argv])
    except SystemExit as exc:
        status = exc.code
    return status, capsys.readouterr().err.strip()


@pytest.mark.parametrize("text, layers, want", [
    ("1", 4, [1, 1, 1, 1]), ("2", 4, [1, 0, 1, 0]), ("[1,1,1]", None, [1, 1, 1]),
    ("([0]*1+[1]*3)", None, [0, 1, 1, 1]), ("[0]*2+[1]*2", 4, [0, 0, 1, 1])])
def test_moe_layer_freq_forms(text, layers, want):
    assert moe_layer_pattern(text, layers) == want


@pytest.mark.parametrize("text", ["__import__('os').system('true')", "[2]*3", "0", "[]",
                                  "[1]*10**9"])
def test_moe_layer_freq_is_read_never_evaluated(text):
    with pytest.raises(LayerPatternError, match="--moe-layer-freq"):
        moe_layer_pattern(text, 4)


def test_moe_architecture_matches_pass_and_mismatches_name_both_values():
    slime_qwen3_moe = ["--moe-layer-freq", "[1]*4", "--moe-router-score-function", "softmax",
                       "--moe-token-drop-policy", "probs", "--num-experts", "8"]
    check_architecture(parse_train_config(slime_qwen3_moe), QWEN3_MOE, "/m")
    for argv, both in ((["--moe-layer-freq", "[0]*1+[1]*3"], ("--moe-layer-freq=",
                                                               "[1, 1, 1, 1]")),
                       (["--moe-router-score-function", "sigmoid"], ("'sigmoid'",
                                                                     "'softmax'")),
                       (["--moe-router-pre-softmax"], ("--moe-router-pre-softmax=True",
                                                       "not norm_topk_prob: False"))):
        with pytest.raises(ModelArgsError) as err:
            check_architecture(parse_train_config(argv), QWEN3_MOE, "/m")
        assert all(b in str(err.value) for b in both), str(err.value)


def test_deepseek_style_router_flags_check_against_their_hf_keys():
    hf = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "n_routed_experts": 8,
          "first_k_dense_replace": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
          "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
          "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0}}
    check_architecture(parse_train_config([
        "--moe-layer-freq", "[0]*1+[1]*3", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5",
        "--moe-router-num-groups", "1", "--moe-router-group-topk", "1",
        "--rotary-scaling-factor", "40", "--mscale", "1.0"]), hf, "/m")
    with pytest.raises(ModelArgsError, match="routed_scaling_factor: 2.5"):
        check_architecture(parse_train_config(["--moe-router-topk-scaling-factor", "1.8"]),
                           hf, "/m")


def test_deepep_needs_the_flex_dispatcher(capsys):
    assert parse_train_config(["--moe-enable-deepep", "--moe-token-dispatcher-type",
                               "flex"]).moe_enable_deepep
    status, err = _exit(["--moe-enable-deepep", "--moe-token-dispatcher-type", "alltoall"],
                        capsys)
    assert status == 2 and len(err.splitlines()) == 1 and "--moe-enable-deepep" in err, err


def test_offload_rollout_is_slimes_name_for_engine_sleep():
    assert engine_options(parse_train_config(["--offload-rollout"]), cuda=False).colocate
    assert not engine_options(parse_train_config(["--no-offload-rollout"]), cuda=True).colocate


def test_accepted_switches_say_what_vime_does_instead(capsys):
    cfg = parse_train_config(["--update-weight-transfer-mode", "broadcast", "--train-backend",
                              "megatron", "--deterministic-mode", "--use-rollout-logprobs"])
    lines = notes(cfg)
    assert len(lines) == 4 and any(line.startswith("--update-weight-transfer-mode: accepted; "
                                                   "vime syncs in-process") for line in lines)
    status, err = _exit(["--advantage-estimator", "ppo"], capsys)
    assert status == 2 and "--advantage-estimator ppo: not supported in vime" in err


def test_miles_fsdp_switches_are_megatrons(tmp_path):
    """miles' FSDP script: the backend is Megatron DP with the distributed optimizer, its
    checkpointing Megatron's full recompute, its dumps vime's rollout dumps; each yields to
    the Megatron flag given, and the environment is checked JSON."""
    cfg = parse_train_config(["--train-backend", "fsdp", "--gradient-checkpointing",
                              "--attn-implementation", "flash_attention_3", "--dump-details",
                              str(tmp_path / "d"), "--train-env-vars", '{"A_B": "1"}'])
    assert cfg.use_distributed_optimizer and cfg.recompute_granularity == "full"
    assert (cfg.recompute_method, cfg.recompute_num_layers) == ("uniform", 1)
    assert cfg.save_rollout_data == f"{tmp_path}/d/rollout_data/rollout_{{rollout_id}}.npz"
    assert cfg.train_env() == {"A_B": "1"}
    assert any(line.startswith("--attn-implementation: accepted") for line in notes(cfg))
    given = parse_train_config(["--gradient-checkpointing", "--recompute-granularity",
                                "selective", "--dump-details", "x", "--save-rollout-data",
                                "y/{rollout_id}.npz"])
    assert given.recompute_granularity == "selective"
    assert given.save_rollout_data == "y/{rollout_id}.npz"
    with pytest.raises(ConfigError, match="^--train-env-vars='\\[1\\]': is not a JSON "
                                             "object of strings"):
        parse_train_config(["--train-env-vars", "[1]"])


def test_moe_layer_freq_error_is_a_config_error():
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        TrainConfig(moe_layer_freq="[3]")


@pytest.mark.parametrize("argv", [["--rm-type", "ifbench"],
                                  ["--advantage-estimator", "reinforce_plus_plus"]])
def test_a_refused_slime_choice_prints_its_table_line(argv, capsys):
    status, err = _exit(argv, capsys)
    key = " ".join(argv)
    assert status == 2 and err == (f"vime train: error: {key}: not supported in vime "
                                   f"({UNSUPPORTED_VALUES[key]})")


def test_kl_coef_is_the_reward_kl_of_reinforce_plus_plus_baseline():
    """slime: --kl-coef shapes REINFORCE++-baseline's advantages (reference loaded for it) and
    does nothing for grpo / gspo."""
    on = parse_train_config(["--kl-coef", "0.05", "--advantage-estimator",
                             "reinforce_plus_plus_baseline"])
    assert on.needs_reference and on.loss_config().reward_kl_coef == 0.05
    grpo = parse_train_config(["--kl-coef", "0.05"])
    assert not grpo.needs_reference and grpo.loss_config().reward_kl_coef == 0.0


def test_a_derived_architecture_mismatch_quotes_the_config_as_written():
    """``--swiglu`` on a GELU checkpoint names ``"hidden_act": 'gelu'`` and what it means, not
    the derived ``"hidden_act": False`` (which read as a config value that is not there)."""
    with pytest.raises(ModelArgsError) as err:
        check_architecture(parse_train_config(["--swiglu"]),
                           {**QWEN3_MOE, "hidden_act": "gelu"}, "/m")
    message = str(err.value)
    assert "\"hidden_act\": 'gelu', which means no --swiglu" in message, message
    assert "False" not in message and message.count("Fix:") == 1
