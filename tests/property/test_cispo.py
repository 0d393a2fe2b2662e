"""CISPO (MiniMax-M1, arXiv 2506.13585): the clipped importance ratio, detached, weights each
token's log-prob. Asserted: the closed form and where the clip acts; the gradient flows through
the log-probs alone, also on clipped tokens (where PPO's is 0); on policy its gradient is the
PPO surrogate's; ``eps_clip = 1`` leaves no lower clip; any split of a step over rows gives
the whole step's loss and gradient (a per-token term over step-level denominators); the
surrogate is chosen by ``--advantage-estimator cispo`` with GRPO's advantages, and a dual
clip beside it is a config error naming the flag."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.loss_helpers import step_denominators
from tests.property.test_gspo import gspo_steps
from vime_pure import LossMode
from vime_pure.errors import LossConfigError
from vime_pure.policy_config import LossConfig
from vime_pure.torch_ops.loss import microbatch_loss
from vime_pure.torch_ops.policy_loss import cispo_loss, policy_loss
from vime_shell.settings.common import ConfigError
from vime_shell.settings.train_config import TrainConfig

ADV = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
LOGP = torch.tensor([-0.7, -1.2, -0.4, -2.1], dtype=torch.float64)


@pytest.mark.parametrize("eps, high, ratios, weights", [
    (0.2, 0.28, [1.0, 1.14, 1.56, 0.4], [1.0, 1.14, 1.28, 0.8]),  # PPO's band
    (1.0, 4.0, [1.0, 3.0, 9.0, 0.4], [1.0, 3.0, 5.0, 0.4]),  # the paper's one-sided band
])
def test_closed_form_and_gradient_through_the_log_probs_only(eps, high, ratios, weights):
    log_ratio = torch.tensor([math.log(r) for r in ratios], dtype=torch.float64,
                             requires_grad=True)
    logp = LOGP.clone().requires_grad_(True)
    # old = logp - log_ratio: the ratio depends on logp and old, only logp gets a gradient
    loss, clipped, ratio = cispo_loss(logp, logp.detach() - log_ratio, ADV, eps_clip=eps,
                                      eps_clip_high=high)
    w = torch.tensor(weights, dtype=torch.float64)
    torch.testing.assert_close(loss.detach(), -w * ADV * LOGP)
    assert clipped.tolist() == [float(a != b) for a, b in zip(weights, ratios)]
    torch.testing.assert_close(ratio, torch.tensor(ratios, dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -w * ADV)  # clipped tokens keep their gradient
    assert log_ratio.grad is None or not log_ratio.grad.any()


def test_the_docstring_example():
    logp = torch.tensor([-0.7], dtype=torch.float64, requires_grad=True)
    loss, clipped, _ = cispo_loss(logp, logp.detach() - math.log(1.5),
                                  torch.ones(1, dtype=torch.float64))
    loss.sum().backward()
    assert float(loss) == pytest.approx(0.84) and float(logp.grad) == pytest.approx(-1.2)
    assert clipped.tolist() == [1.0]


@given(st.lists(st.floats(-3, 3), min_size=1, max_size=8), st.data())
def test_on_policy_its_gradient_is_the_ppo_surrogates(advantages, data):
    """At ``logp == old`` (the first step on a rollout) the weight is 1: the gradient is
    ``-A`` per token, PPO's too (their values differ: CISPO's is ``-A * logp``)."""
    n = len(advantages)
    adv = torch.tensor(advantages, dtype=torch.float64)
    values = data.draw(st.lists(st.floats(-5, -0.01), min_size=n, max_size=n))
    grads = []
    for surrogate in ("ppo", "cispo"):
        logp = torch.tensor(values, dtype=torch.float64, requires_grad=True)
        policy_loss(logp, logp.detach(), adv, surrogate=surrogate).total.sum().backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)


@given(gspo_steps(), st.sampled_from(list(LossMode)))
def test_any_split_into_rows_gives_the_whole_step(case, mode):
    step, old, adv, rows = case
    n = len(step.group_ids)
    dens = torch.as_tensor(step_denominators(step, mode, "original"), dtype=torch.float64)
    mask = torch.tensor([m for ms in step.loss_masks for m in ms], dtype=torch.float64)
    index = torch.tensor([k for k in range(n) for _ in step.loss_masks[k]])
    theta = torch.linspace(-1.4, -0.2, step.num_tokens, dtype=torch.float64, requires_grad=True)
    whole_theta = theta.detach().clone().requires_grad_(True)
    total = theta.sum() * 0.0
    for r in sorted(set(rows)):
        ids = [i for i in range(n) if rows[i] == r]
        sel = torch.cat([torch.arange(step.offsets[i], step.offsets[i + 1]) for i in ids])
        local = torch.tensor([k for k, i in enumerate(ids) for _ in step.loss_masks[i]])
        terms = policy_loss(theta[sel], old[sel], adv[sel], surrogate="cispo", eps_clip=1.0,
                            eps_clip_high=4.0)
        total = total + microbatch_loss(terms.total, mask[sel], local, dens[ids])
    whole = policy_loss(whole_theta, old, adv, surrogate="cispo", eps_clip=1.0,
                        eps_clip_high=4.0)
    expected = microbatch_loss(whole.total, mask, index, dens)
    total.backward()
    expected.backward()
    assert float(total) == pytest.approx(float(expected), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(theta.grad, whole_theta.grad, rtol=1e-12, atol=1e-12)


def test_the_flag_selects_it_with_grpo_advantages():
    cfg = TrainConfig(advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=4.0)
    assert cfg.loss_config() == LossConfig(eps_clip=1.0, eps_clip_high=4.0, surrogate="cispo")
    assert cfg.reward_normalization().method == "grpo"
    assert TrainConfig(advantage_estimator="gspo").loss_config().surrogate == "gspo"
    assert TrainConfig().loss_config().surrogate == "ppo"


def test_a_dual_clip_beside_it_is_an_error_naming_the_flag():
    with pytest.raises(ConfigError, match=r"--eps-clip-c=3\.0: applies to PPO's clipped "
                                          r"surrogate, not CISPO's.*Fix: drop the dual clip"):
        TrainConfig(advantage_estimator="cispo", eps_clip_c=3.0).loss_config()
    with pytest.raises(LossConfigError, match="surrogate='pg'"):
        LossConfig(surrogate="pg")
