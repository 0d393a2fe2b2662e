"""The component records ``TrainConfig`` is composed of: each knob has one home, each record
checks its own fields when built alone, the rules that read two records live in
``TrainConfig``, and the flags and config-file sections follow from the records' fields."""

import argparse

import attrs
import pytest

from vime_shell.settings.batching import BatchingArgs
from vime_shell.settings.checkpoint import CheckpointArgs
from vime_shell.settings.data import DataArgs
from vime_shell.settings.engine import EngineArgs
from vime_shell.settings.evaluation import EvalArgs
from vime_shell.settings.flags import add_train_arguments, parse_train_config
from vime_shell.settings.loss import LossArgs
from vime_shell.settings.megatron_args import MegatronSwitchArgs, ModelArchArgs, PlacementArgs
from vime_shell.settings.memory import MemoryArgs
from vime_shell.settings.optimizer import OptimizerArgs
from vime_shell.settings.parallelism import ParallelArgs
from vime_shell.settings.reward import RewardArgs
from vime_shell.settings.rollout import RolloutArgs
from vime_shell.settings.run_logging import LoggingArgs
from vime_shell.settings.train_config import RECORDS, SECTIONS, ConfigError, TrainConfig

ALL = (*RECORDS, ModelArchArgs, MegatronSwitchArgs, PlacementArgs)


def test_every_setting_has_exactly_one_record_and_a_known_section():
    owners: dict[str, list[str]] = {}
    for record in ALL:
        for f in attrs.fields(record):
            owners.setdefault(f.name, []).append(record.__name__)
            assert f.metadata["section"] in SECTIONS, (record, f.name)
    assert {f.name for f in attrs.fields(TrainConfig)} == set(owners)
    assert [n for n, o in owners.items() if len(o) > 1] == []


def test_flags_come_from_the_records_fields():
    """A new field in a record is a flag with no other edit: every field has its --flag."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_train_arguments(parser)
    flags = set(parser._option_string_actions)
    missing = [f.name for r in ALL for f in attrs.fields(r)
               if "--" + f.name.replace("_", "-") not in flags]
    assert missing == []


@pytest.mark.parametrize("record, bad, flag", [
    (EngineArgs, {"rollout_gpu_memory_utilization": 1.5}, "rollout_gpu_memory_utilization=1.5"),
    (DataArgs, {"num_epoch": 2}, "num_epoch=2: needs --prompt-data"),
    (RolloutArgs, {"rollout_top_p": 0.0}, "rollout_top_p=0.0"),
    (RewardArgs, {"advantage_estimator": "ppo"}, "advantage_estimator='ppo'"),
    (EvalArgs, {"eval_prompt_data": ["gsm8k"]}, "is not NAME PATH pairs"),
    (BatchingArgs, {"max_tokens_per_gpu": 0}, "max_tokens_per_gpu=0"),
    (LossArgs, {"eps_clip": 0.0}, "--eps-clip=0.0: must lie in (0, 1]"),
    (OptimizerArgs, {"lr": 2.0}, "--lr=2.0"),
    (ParallelArgs, {"tensor_model_parallel_size": 0}, "tensor_model_parallel_size=0"),
    (MemoryArgs, {"overlap_cpu_optimizer_d2h_h2d": True}, "needs --optimizer-cpu-offload"),
    (CheckpointArgs, {"save_rollout_data": "d.npz"}, "lacks {rollout_id}"),
    (LoggingArgs, {"log_interval": 0}, "log_interval=0"),
])
def test_each_record_checks_its_own_fields_alone_and_inside_train_config(record, bad, flag):
    """The same rule, with the same message, whichever way the record is built: one check."""
    with pytest.raises(ConfigError) as alone:
        record(**bad)
    with pytest.raises(ConfigError) as composed:
        TrainConfig(**bad)
    assert flag in str(alone.value) and str(alone.value) == str(composed.value)


def test_a_rule_across_two_records_lives_in_train_config():
    """A group reward against the per-turn rewards of compact_rollout: each record alone is
    valid. (GSPO with context parallelism, the rule here before, now trains: its sequence
    ratio is reduced over the CP group.)"""
    RewardArgs(group_rm=True)
    path = "vime_shell.rollout.functions:compact_rollout"
    RolloutArgs(rollout_function_path=path)
    with pytest.raises(ConfigError, match="group_rm=True: does not apply to compact_rollout"):
        TrainConfig(group_rm=True, rollout_function_path=path)
    TrainConfig(advantage_estimator="gspo", context_parallel_size=2)


def test_record_views_carry_the_config_values_and_cfg_names_stay_flat():
    cfg = parse_train_config(["--eval-prompt-data", "sums", "s.jsonl", "--eval-top-p", "0.9",
                              "--eps-clip", "0.1"])
    assert cfg.record(EvalArgs) == EvalArgs(eval_prompt_data=("sums", "s.jsonl"),
                                            eval_top_p=0.9)
    assert cfg.eps_clip == 0.1 and cfg.record(LossArgs).loss_config_for(
        surrogate="ppo") == cfg.loss_config()


def test_warmup_fraction_without_num_rollout_uses_the_default_run_length():
    """0.1 of the default 300 rollouts x 1 step per rollout is 30 warmup steps."""
    assert TrainConfig(lr_warmup_fraction=0.1).warmup_iters() == 30
    # under --num-epoch the dataset sets the rollouts: the fraction is of the plan's steps
    assert TrainConfig(lr_warmup_fraction=0.1, num_epoch=3, prompt_data="d.jsonl",
                       rollout_max_response_len=8).warmup_iters(40) == 4
