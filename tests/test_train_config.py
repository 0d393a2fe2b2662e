"""``TrainConfig``: defaults, file + flag layering, and typed errors naming field and fix.

Asserts :mod:`vime_shell.settings.train_config`'s invariants: defaults are valid and give one
optimizer step per rollout; YAML / JSON / TOML files load with either key spelling; flags
override the file; unknown keys and flags fail with the closest name; each bad value names its
field.
"""

import json

import pytest

from vime_pure.config import BatchingPolicy
from vime_shell.settings.flags import parse_train_config
from vime_shell.settings.train_config import ConfigError, TrainConfig


def test_defaults_are_the_demo_and_valid():
    cfg = TrainConfig()
    assert cfg.groups_per_rollout == 128 == cfg.effective_global_batch_size
    # No balance flag under dynamic packing: the straggler policy (vime differs from slime).
    assert cfg.batching_policy() == BatchingPolicy(global_batch_size=128, max_tokens_per_gpu=1024,
                                                   balance="straggler")
    assert TrainConfig.from_mapping(cfg.to_dict()) == cfg


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "global-batch-size: 64\nlr: 0.001\nbalance_data: true\n"),
    (".json", json.dumps({"global_batch_size": 64, "lr": 1e-3, "balance-data": True})),
    (".toml", "global_batch_size = 64\nlr = 0.001\nbalance_data = true\n"),
])
def test_config_file_then_flags(tmp_path, suffix, text):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    cfg = parse_train_config(["--config", str(path)])
    assert (cfg.global_batch_size, cfg.lr, cfg.balance_data) == (64, 1e-3, True)
    assert cfg.batching_policy().balance == "tokens"
    cfg = parse_train_config(["--config", str(path), "--lr", "2e-4", "--no-balance-data",
                              "--balance-by-flops", "--max-tokens-per-gpu", "none",
                              "--micro-batch-size", "4"])
    assert (cfg.global_batch_size, cfg.lr, cfg.balance_data) == (64, 2e-4, False)
    assert (cfg.max_tokens_per_gpu, cfg.micro_batch_size) == (None, 4)
    assert cfg.batching_policy().balance == "flops"


@pytest.mark.parametrize("kwargs, field", [
    (dict(global_batch_size=100), "global_batch_size"),
    (dict(global_batch_size=0), "global_batch_size"),
    (dict(lr=0.0), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(lr="fast"), "lr"),
    (dict(n_samples_per_prompt=True), "n_samples_per_prompt"),
    (dict(rollout_engine="sglang"), "rollout_engine"),
    (dict(task="reverse9"), "task"),
    (dict(rollout_num_turns=4), "rollout_num_turns"),
    (dict(rollout_top_p=0.0), "rollout_top_p"),
    (dict(max_tokens_per_gpu=None), "max_tokens_per_gpu"),
    (dict(advantage_estimator="ppo2"), "advantage_estimator"),
    (dict(rollout_turn_reward="max"), "rollout_turn_reward"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**kwargs)


def test_partial_steps_relax_the_divisibility_check():
    cfg = TrainConfig(global_batch_size=48, allow_partial_train_step=True)
    assert cfg.batching_policy().allow_partial_step


def test_the_response_length_is_the_flag_else_the_built_in_tasks_answer_length():
    assert TrainConfig(task="reverse2").max_response_len == 2
    assert TrainConfig(task="reverse2", rollout_max_response_len=64).max_response_len == 64


def test_unknown_keys_and_bad_files_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'global_batch_size'"):
        TrainConfig.from_mapping({"global_batchsize": 64})
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1, 2\n")
    with pytest.raises(ConfigError, match="does not parse"):
        parse_train_config(["--config", str(bad)])
    with pytest.raises(ConfigError, match="extension"):
        (tmp_path / "x.ini").write_text("")
        parse_train_config(["--config", str(tmp_path / "x.ini")])
    with pytest.raises(ConfigError, match="cannot be read"):
        parse_train_config(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(SystemExit):
        parse_train_config(["--global-batch", "64"])  # no abbreviations: a typo fails
