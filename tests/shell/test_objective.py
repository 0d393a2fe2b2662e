"""The per-micro-batch objective: core pieces wired to a packed row, and the Megatron factor."""

import numpy as np
import pytest
import torch

from vime_pure.errors import VimeError
from vime_shell.objective import LossConfig, loss_factor, microbatch_objective
from vime_shell.packing import TrainRows, pack


def test_factor_docstring_example():
    assert loss_factor(LossConfig(), 4, 8, 16, dp=2, cp=1) == 1.0
    # sample_token_mean divides by N_s, not G_s.
    assert loss_factor(LossConfig(mode="sample_token_mean"), 4, 8, 16, dp=2, cp=1) == 0.5


@pytest.mark.parametrize("groups", [0, -1])
def test_factor_rejects_bad_group_counts(groups):
    with pytest.raises(VimeError, match="G_s"):
        loss_factor(LossConfig(), 4, groups, 16, dp=2, cp=1)


def _row(old=None):
    # One group, masks [1, 1] and [1, 0] -> denominator 3 for every token.
    rows = TrainRows(tokens=np.arange(8), lengths=np.array([4, 4]),
                     response_lengths=np.array([2, 2]), loss_mask=np.array([1.0, 1.0, 1.0, 0.0]),
                     advantages=np.ones(4), denominators=np.array([3.0, 3.0]),
                     group=np.array([0, 0]), old_log_probs=old)
    return pack(rows, [0, 1])


def test_ratio_one_surrogate_gives_minus_advantage_group_mean_and_gradient():
    logp = torch.tensor([-1.0, -2.0, -1.5, -0.5], requires_grad=True)
    loss, report = microbatch_objective(logp, _row(), LossConfig(), factor=2.0)
    loss.backward()
    # pg = -A = -1 on 3 masked tokens over D = 3 -> P = -1; scaled by 2.
    assert loss.item() == pytest.approx(-2.0)
    assert float(report["loss"]) == pytest.approx(-1.0)
    assert logp.grad.tolist() == pytest.approx([-2 / 3, -2 / 3, -2 / 3, 0.0])
    assert float(report["tokens"]) == 3.0
    assert float(report["ratio"]) == pytest.approx(3.0)  # ratio sum over 3 masked tokens


def test_clipped_tokens_are_reported_as_group_weighted_fraction():
    old = np.log(np.array([0.5, 1.0, 1.0, 1.0]))  # token 0 has ratio 2 -> clipped at 1.2
    logp = torch.zeros(4)
    _, report = microbatch_objective(logp, _row(old), LossConfig(), factor=1.0)
    assert float(report["clipfrac"]) == pytest.approx(1 / 3)


def test_bad_loss_config_is_typed():
    with pytest.raises(VimeError, match="eps_clip"):
        LossConfig(eps_clip=1.5)
    with pytest.raises(VimeError, match="mode"):
        LossConfig(mode="mean_of_means")
