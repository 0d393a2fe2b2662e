"""``--sequence-parallel`` reaches Megatron's config where it can run (TP > 1, TransformerEngine,
CP 1), packed rows are padded for it (tests/property: test_row_multiple_*), and a launch note
says when it is off and why."""

import pytest
import torch

from vime_shell.cli.train import sequence_parallel_note
from vime_shell.megatron.layout import sequence_parallel_on, transformer_engine_available
from vime_shell.megatron.platform import Platform
from vime_shell.run.components import trainer_config
from vime_shell.settings.flags import parse_train_config

TE_GPU = Platform(kind="cuda", backend="nccl", dtype=torch.bfloat16, transformer_engine=True,
                  packing="thd")
LOCAL_CPU = Platform(kind="cpu", backend="gloo", dtype=torch.float32, transformer_engine=False,
                     packing="mask")


def test_the_flag_reaches_the_trainer_config():
    on = parse_train_config(["--sequence-parallel", "--tensor-model-parallel-size", "2"])
    assert trainer_config(on).sequence_parallel is True
    assert trainer_config(parse_train_config([])).sequence_parallel is False


@pytest.mark.parametrize("tp, cp, te, want", [(2, 1, True, True), (1, 1, True, False),
                                              (2, 1, False, False), (2, 2, True, False)])
def test_sequence_parallel_runs_only_where_megatron_can(tp, cp, te, want):
    assert sequence_parallel_on(True, tp=tp, cp=cp, transformer_engine=te) is want
    assert sequence_parallel_on(False, tp=tp, cp=cp, transformer_engine=te) is False


def test_the_platform_passes_it_to_transformer_config_on_transformer_engine_only():
    assert TE_GPU.transformer_overrides(True)["sequence_parallel"] is True
    assert TE_GPU.transformer_overrides()["sequence_parallel"] is False
    assert LOCAL_CPU.transformer_overrides(True)["sequence_parallel"] is False


def test_the_launch_note_says_why_it_is_off():
    assert sequence_parallel_note(1, 1) == ("--sequence-parallel: off at "
                                            "--tensor-model-parallel-size 1 (as in Megatron)")
    assert "context-parallel-size" in sequence_parallel_note(2, 2)
    if not transformer_engine_available():
        assert "local layer spec" in sequence_parallel_note(2, 1)
