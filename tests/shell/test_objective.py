"""The per-micro-batch objective: group-token-mean numerator and the Megatron factor."""

import numpy as np
import pytest
import torch

from vime_pure.errors import VimeError
from vime_shell.objective import LossConfig, group_weights, megatron_loss_factor, microbatch_loss
from vime_shell.packing import TrainRows, pack


def test_factor_docstring_example():
    assert megatron_loss_factor(4, 8, 2) == 1.0


@pytest.mark.parametrize("groups", [0, -1, 1.5, True])
def test_factor_rejects_bad_group_counts(groups):
    with pytest.raises(VimeError, match="num_groups"):
        megatron_loss_factor(4, groups, 2)


def _row():
    rows = TrainRows(tokens=np.arange(8), lengths=np.array([4, 4]),
                     response_lengths=np.array([2, 2]), loss_mask=np.array([1.0, 1.0, 1.0, 0.0]),
                     advantages=np.ones(4), denominators=np.array([3.0, 3.0]),
                     group=np.array([0, 0]))
    return pack(rows, [0, 1])


def test_group_token_mean_numerator_example():
    # One group, masks [1, 1] and [1, 0] -> denominator 3; per-token losses 1, 2, 3, 9.
    row = _row()
    assert group_weights(row).tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    per_token = torch.tensor([1.0, 2.0, 3.0, 9.0])
    assert float((per_token * group_weights(row)).sum()) == pytest.approx(2.0)


def test_ratio_one_surrogate_gradient_is_minus_advantage_weight():
    row = _row()
    logp = torch.tensor([-1.0, -2.0, -1.5, -0.5], requires_grad=True)
    loss, metrics = microbatch_loss(logp, row, LossConfig(), factor=2.0)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-2 / 3, -2 / 3, -2 / 3, 0.0])
    assert metrics["tokens"].tolist() == [3.0, 1.0]
    assert metrics["ratio"].tolist() == pytest.approx([3.0, 3.0])


def test_bad_loss_config_is_typed():
    with pytest.raises(VimeError, match="eps_low"):
        LossConfig(eps_low=1.5)
