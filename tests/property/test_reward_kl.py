"""slime's reward-shaping KL (``--kl-coef``) in the core: ``kl_shaped_advantages``."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vime_pure.errors import LossConfigError
from vime_pure.policy_config import KL_KINDS
from vime_pure.torch_ops.policy_loss import kl_penalty, kl_shaped_advantages


@st.composite
def token_rows(draw):
    n = draw(st.integers(1, 12))
    reals = st.floats(-5.0, 0.0, allow_nan=False, width=32)
    old, ref = (torch.tensor(draw(st.lists(reals, min_size=n, max_size=n))) for _ in range(2))
    adv = torch.tensor(draw(st.lists(st.floats(-3, 3, width=32), min_size=n, max_size=n)))
    return adv, old, ref


@given(token_rows(), st.floats(0.0, 2.0), st.sampled_from(KL_KINDS))
def test_shaping_subtracts_the_scaled_kl_and_carries_no_gradient(row, coef, kind):
    """Reason: the KL is part of the reward (slime's REINFORCE++-baseline), so it shifts each
    token's advantage by -coef * KL(pi_old || ref) and never sends a gradient to the policy."""
    adv, old, ref = row
    old = old.clone().requires_grad_(True)
    shaped = kl_shaped_advantages(adv, old, ref, coef=coef, kind=kind)
    want = adv - coef * kl_penalty(old.detach(), ref, kind)
    torch.testing.assert_close(shaped, want)
    assert not shaped.requires_grad


def test_docstring_example_and_bad_coefficient():
    out = kl_shaped_advantages(torch.tensor([1.0]), torch.tensor([math.log(0.5)]),
                               torch.tensor([math.log(0.25)]), coef=0.1, kind="k1")
    assert float(out) == pytest.approx(1 - 0.1 * math.log(2))
    with pytest.raises(LossConfigError, match="reward_kl_coef=-1"):
        kl_shaped_advantages(torch.zeros(1), torch.zeros(1), torch.zeros(1), coef=-1)
