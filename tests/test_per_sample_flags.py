"""The per-sample generation and partial-rollout flags: what they select, and their errors.

Asserts: ``--custom-generate-function-path`` or ``--partial-rollout`` switch the default
rollout function to the per-sample driver; bad combinations and values are ``ConfigError``s
naming the flag; a generate function with the wrong signature fails at launch, before any
model is built; ``--partial-rollout`` with two engines is refused at launch.
"""

import pytest

from vime_shell.models.embedded import build_embedded
from vime_shell.rollout.functions import DEFAULT_ROLLOUT_FUNCTION, PER_SAMPLE_ROLLOUT_FUNCTION
from vime_shell.rollout.plugins import PluginError
from vime_shell.run.launch_checks import launch_checks
from vime_shell.settings.flags import parse_train_config
from vime_shell.settings.train_config import ConfigError, TrainConfig


def sync_generate(args, sample, sampling_params):
    return sample


def test_per_sample_flags_select_the_driver():
    assert TrainConfig().effective_rollout_function_path == DEFAULT_ROLLOUT_FUNCTION
    for argv in (["--custom-generate-function-path", "vime_shell.rollout.functions:generate"],
                 ["--partial-rollout", "--over-sampling-batch-size", "20"]):
        cfg = parse_train_config(argv)
        assert cfg.effective_rollout_function_path == PER_SAMPLE_ROLLOUT_FUNCTION
    cfg = parse_train_config(["--partial-rollout", "--over-sampling-batch-size", "24",
                              "--mask-offpolicy-in-partial-rollout",
                              "--sglang-server-concurrency", "64"])
    assert (cfg.over_sampling_batch_size, cfg.sglang_server_concurrency) == (24, 64)


@pytest.mark.parametrize("kwargs,field", [
    (dict(mask_offpolicy_in_partial_rollout=True), "mask_offpolicy_in_partial_rollout"),
    (dict(partial_rollout=True, over_sampling_batch_size=20,
          rollout_function_path="vime_shell.rollout.functions:compact_rollout"),
     "partial_rollout"),
    (dict(partial_rollout=True), "partial_rollout"),  # nothing in flight to cut
    (dict(sglang_server_concurrency=0), "sglang_server_concurrency"),
])
def test_bad_combinations_name_the_flag(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**kwargs)


def test_generate_timeout_bounds_per_sample_executions_only():
    """--generate-timeout has a default (no unbounded wait) and reaches the per-sample runs; a
    batched rollout function runs no execution it could bound: another value is refused."""
    assert TrainConfig().generate_timeout == 3600  # the default: never an error
    cfg = parse_train_config(["--custom-generate-function-path",
                              "vime_shell.rollout.functions:generate", "--generate-timeout", "30"])
    assert cfg.generate_timeout == 30
    with pytest.raises(ConfigError, match=r"generate_timeout=30: bounds executions of a "
                                          r"per-sample generate function.*Fix: pass "
                                          "--custom-generate-function-path"):
        TrainConfig(generate_timeout=30)
    with pytest.raises(ConfigError, match="generate_timeout=0"):
        TrainConfig(generate_timeout=0, partial_rollout=True, over_sampling_batch_size=20)


def test_launch_checks_the_generate_signature_and_the_engine_width(tmp_path, monkeypatch):
    model = build_embedded(tmp_path / "cache")
    bad = TrainConfig(run_dir=str(tmp_path / "a"),
                      custom_generate_function_path="tests.test_per_sample_flags:sync_generate")
    with pytest.raises(PluginError, match="not an async function"):
        launch_checks(bad, model)
    monkeypatch.setenv("WORLD_SIZE", "2")  # two ranks, one engine each by default
    for name, kwargs in (("b", {}), ("c", dict(rollout_num_gpus=1))):  # a buffer per engine
        launch_checks(TrainConfig(run_dir=str(tmp_path / name), partial_rollout=True,
                                  over_sampling_batch_size=20, rollout_engine="hf", **kwargs),
                      model)
    monkeypatch.setenv("WORLD_SIZE", "4")  # two engines of two ranks: a buffer has one rank
    wide = TrainConfig(run_dir=str(tmp_path / "d"), partial_rollout=True, rollout_engine="hf",
                       over_sampling_batch_size=20, rollout_num_gpus_per_engine=2)
    with pytest.raises(ConfigError, match="2 engines of 2 ranks.*"
                                          "--rollout-num-gpus-per-engine 1"):
        launch_checks(wide, model)
