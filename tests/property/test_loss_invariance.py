"""Properties: every loss mode gives the same value and gradient for any split of a step.

Hypothesis draws groups of 1-4 siblings (not contiguous in the batch), random masks (all-zero
included), optional rejection masks with both denominators, a DP partition, micro-batch
assignment and CP size 1/2/4 with zigzag slicing. The split step is run through the Megatron
emulation (its scaling, then DDP's average) and compared with the oracle's whole-step value and
its ``torch.autograd`` gradient on a per-token parameter. The largest deviations are printed at
the end of the module (run with ``-s``).
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.loss_helpers import (Split, Step, assert_zigzag_invariants, divisor,
                                emulate_megatron, oracle_loss, step_denominators)
from vime_pure import LossMode, reduce_train_step
from vime_pure.torch_ops.loss import microbatch_loss, microbatch_losses
from vime_pure.torch_ops.policy_loss import policy_loss

MAX_DEV = {"value": 0.0, "grad": 0.0}


@pytest.fixture(scope="module", autouse=True)
def report_max_deviation():
    yield
    print(f"\n[loss invariance] max |value - oracle| = {MAX_DEV['value']:.3e}, "
          f"max |grad - oracle grad| = {MAX_DEV['grad']:.3e}")


@st.composite
def steps(draw) -> Step:
    """Groups of 1-4 siblings in shuffled order; response masks may be all zero."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    group_ids = [g for g, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(range(len(group_ids))))
    group_ids = [group_ids[i] for i in order]
    n = len(group_ids)
    resp = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    masks = [draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=r, max_size=r)) for r in resp]
    rejection = None
    if draw(st.booleans()):
        rejection = [draw(st.lists(st.sampled_from([0.0, 1.0, 1.0]), min_size=r, max_size=r))
                     for r in resp]
    norm = float(draw(st.integers(1, 16)))
    return Step(group_ids, prompts, masks, rejection, norm)


@st.composite
def splits(draw, step: Step) -> Split:
    dp = draw(st.integers(1, 3))
    cp = draw(st.sampled_from([1, 2, 4]))
    k = draw(st.integers(1, 3))
    n = len(step.group_ids)
    rank_of = draw(st.lists(st.integers(0, dp - 1), min_size=n, max_size=n))
    mb_of = draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n))
    return Split(dp, cp, k, rank_of, mb_of)


@st.composite
def cases(draw):
    step = draw(steps())
    return (step, draw(splits(step)), draw(st.sampled_from(list(LossMode))),
            draw(st.sampled_from(["original", "surviving"])),
            draw(st.sampled_from(["pair", "triple", "per_token"])))


def per_token_loss(step: Step, theta: torch.Tensor, seed: int) -> torch.Tensor:
    """A real per-token policy loss (clipped surrogate + k3 KL) of per-token parameters."""
    g = torch.Generator().manual_seed(seed)
    old = theta.detach() + 0.3 * torch.randn(step.num_tokens, generator=g, dtype=theta.dtype)
    adv = torch.randn(step.num_tokens, generator=g, dtype=theta.dtype)
    ref = theta.detach() - 0.2
    return policy_loss(theta, old, adv, ref_log_probs=ref, kl_coef=0.1).total


@given(case=cases(), seed=st.integers(0, 2**16))
def test_split_step_matches_whole_step_value_and_gradient(case, seed):
    """Each token's weight (mask / denominator / divisor) depends only on the whole step, so
    the split sum, once Megatron's scaling and DDP's average cancel, is the whole-step sum
    (to float64 rounding), and so is its gradient."""
    step, split, mode, denominator, path = case
    theta_split = torch.linspace(-1.0, 0.0, step.num_tokens, dtype=torch.float64)
    theta_split.requires_grad_(True)
    theta_whole = theta_split.detach().clone().requires_grad_(True)

    applied, _ = emulate_megatron(step, split, per_token_loss(step, theta_split, seed), mode,
                                  denominator, path)
    expected = oracle_loss(step, per_token_loss(step, theta_whole, seed), mode, denominator)
    applied.backward()
    expected.backward()

    dev = abs(float(applied.detach()) - float(expected.detach()))
    gdev = float((theta_split.grad - theta_whole.grad).abs().max()) if step.num_tokens else 0.0
    MAX_DEV["value"], MAX_DEV["grad"] = max(MAX_DEV["value"], dev), max(MAX_DEV["grad"], gdev)
    assert dev <= 1e-12 * max(1.0, abs(float(expected.detach())))
    assert gdev <= 1e-12


@given(case=cases(), seed=st.integers(0, 2**16))
def test_reported_step_loss_is_split_invariant(case, seed):
    """``reduce_train_step`` adds per-rank partial sums (additive over any split) and divides
    by step-wide constants, so it equals the whole-step value (to rounding)."""
    step, split, mode, denominator, _ = case
    x = torch.randn(step.num_tokens, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    _, partials = emulate_megatron(step, split, x, mode, denominator)
    per_rank = [{"loss": p} for _, p in sorted(partials.items())]
    report = reduce_train_step(per_rank, step.num_groups, mode, split.cp,
                               num_samples=len(step.group_ids))["loss"]
    expected = float(oracle_loss(step, x, mode, denominator))
    MAX_DEV["value"] = max(MAX_DEV["value"], abs(report - expected))
    assert report == pytest.approx(expected, rel=1e-12, abs=1e-12)


@given(step=steps(), mode=st.sampled_from([LossMode.GROUP_TOKEN_MEAN,
                                           LossMode.SAMPLE_TOKEN_MEAN]))
def test_token_weights_sum_to_non_empty_units(step, mode):
    """A unit's denominator D is the sum of its masks, so m/D sums to 1 over each non-empty
    group (sample) and to 0 over an empty one."""
    dens = step_denominators(step, mode, "original")
    weight = sum(m / dens[i] for i, masks in enumerate(step.loss_masks) for m in masks if m)
    if mode is LossMode.GROUP_TOKEN_MEAN:
        units = {g for g, masks in zip(step.group_ids, step.loss_masks) if sum(masks)}
    else:
        units = [masks for masks in step.loss_masks if sum(masks)]
    assert weight == pytest.approx(len(units), rel=1e-12)
    assert divisor(step, mode) >= 1


@given(step=steps())
def test_group_siblings_share_one_denominator(step):
    """The group-token-mean denominator is the mask sum of the whole group, one number per
    group."""
    dens = step_denominators(step, LossMode.GROUP_TOKEN_MEAN, "original")
    for g in set(step.group_ids):
        values = {dens[i] for i in range(len(dens)) if step.group_ids[i] == g}
        total = sum(sum(step.loss_masks[i]) for i in range(len(dens)) if step.group_ids[i] == g)
        assert values == {total}
    assert np.all(dens >= 0)


@given(response=st.integers(0, 40), prompt=st.integers(1, 40),
       cp=st.sampled_from([1, 2, 3, 4, 8]))
def test_zigzag_ranks_tile_the_response(response, prompt, cp):
    """Rank r takes chunks r and 2cp-1-r of 2cp equal chunks of the padded sequence; together
    the ranks take each chunk once, so their response ranges tile the response once."""
    assert_zigzag_invariants(prompt + response, response, cp)


@st.composite
def rows(draw):
    """One packed row: ``k`` per-token series, a 0/1 mask, each token's sample, and each
    sample's ``D`` (> 0, or 0 for a sample whose tokens are all masked)."""
    s = draw(st.integers(1, 5))
    sample_index = draw(st.lists(st.integers(0, s - 1), min_size=0, max_size=30))
    mask = [draw(st.sampled_from([0.0, 1.0])) for _ in sample_index]
    counted = {i for i, m in zip(sample_index, mask) if m}
    dens = [draw(st.floats(0.5, 50)) if i in counted else draw(st.sampled_from([0.0, 3.0]))
            for i in range(s)]
    k = draw(st.integers(1, 5))
    series = draw(st.lists(st.lists(st.floats(-5, 5), min_size=len(mask), max_size=len(mask)),
                           min_size=k, max_size=k))
    return (torch.tensor(series, dtype=torch.float64).reshape(k, len(mask)),
            torch.tensor(mask, dtype=torch.float64), torch.tensor(sample_index, dtype=torch.int64),
            torch.tensor(dens, dtype=torch.float64))


@given(rows())
def test_batched_partials_equal_one_row_at_a_time(row):
    """``microbatch_losses`` applies ``microbatch_loss``'s weights to every series: the same
    formula, one row of the result per series."""
    series, mask, index, dens = row
    together = microbatch_losses(series, mask, index, dens)
    alone = torch.stack([microbatch_loss(x, mask, index, dens) for x in series])
    torch.testing.assert_close(together, alone, rtol=1e-12, atol=1e-12)
