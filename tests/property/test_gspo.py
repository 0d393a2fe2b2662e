"""GSPO: a sequence-level ratio (geometric mean of token ratios), clipped per sequence, as
split-invariant as every loss mode (also over context-parallel ranks, each holding a slice of
every sample, with the per-sample sums reduced over them), and equal to GRPO exactly until the
policy moves."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.loss_helpers import Step, divisor, oracle_loss, step_denominators
from vime_pure import LossMode
from vime_pure.torch_ops.loss import microbatch_loss
from vime_pure.torch_ops.policy_loss import gspo_clip_loss, policy_loss


@st.composite
def gspo_steps(draw):
    """(step, per-token old log-probs and advantages, sample -> row): groups of 1-3
    siblings, responses of 1-6 tokens with random masks, 1-4 rows of whole samples."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    group_ids = [g for g, size in enumerate(sizes) for _ in range(size)]
    n = len(group_ids)
    resp = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    masks = [draw(st.lists(st.sampled_from([0.0, 1.0, 1.0]), min_size=r, max_size=r))
             for r in resp]
    step = Step(group_ids, [1] * n, masks)
    old = draw(st.lists(st.floats(-0.5, 0.5), min_size=step.num_tokens,
                        max_size=step.num_tokens))
    adv_per_sample = draw(st.lists(st.floats(-2, 2), min_size=n, max_size=n))
    adv = [adv_per_sample[i] for i, r in enumerate(resp) for _ in range(r)]
    rows = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    return step, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64), rows


def _sample_index(step: Step, ids: list[int]) -> torch.Tensor:
    return torch.tensor([k for k, i in enumerate(ids) for _ in step.loss_masks[i]])


def _gspo(theta, old, adv, step, ids):
    sel = torch.cat([torch.arange(step.offsets[i], step.offsets[i + 1]) for i in ids])
    mask = torch.tensor([m for i in ids for m in step.loss_masks[i]], dtype=theta.dtype)
    loss, _, _ = gspo_clip_loss(theta[sel], old[sel], adv[sel], mask, _sample_index(step, ids),
                                eps_clip=0.2)
    return sel, mask, loss


@given(gspo_steps(), st.sampled_from(list(LossMode)))
def test_gspo_rows_of_whole_samples_give_the_whole_step(case, mode):
    """A sample's ratio depends on its own tokens only, and a micro-batch row holds whole
    samples, so summing the rows' partials over any assignment of samples to rows gives the
    whole step's loss and gradient."""
    step, old, adv, rows = case
    dens = torch.as_tensor(step_denominators(step, mode, "original"), dtype=torch.float64)
    theta = torch.linspace(-0.4, 0.4, step.num_tokens, dtype=torch.float64, requires_grad=True)
    whole_theta = theta.detach().clone().requires_grad_(True)
    total = theta.sum() * 0.0
    for r in sorted(set(rows)):
        ids = [i for i, row in enumerate(rows) if row == r]
        _, mask, loss = _gspo(theta, old, adv, step, ids)
        total = total + microbatch_loss(loss, mask, _sample_index(step, ids), dens[ids])
    split = total / divisor(step, mode)
    _, _, whole_loss = _gspo(whole_theta, old, adv, step, list(range(len(step.group_ids))))
    expected = oracle_loss(step, whole_loss, mode, "original")
    split.backward()
    expected.backward()
    assert float(split) == pytest.approx(float(expected), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(theta.grad, whole_theta.grad, rtol=1e-12, atol=1e-12)


@given(gspo_steps(), st.sampled_from(list(LossMode)))
def test_gspo_equals_grpo_on_policy(case, mode):
    """At ratio 1 (the first step of a rollout) every token's weight m/D sums back over its
    sample, so GSPO's value and gradient are the token-level surrogate's."""
    step, _, adv, _ = case
    n = len(step.group_ids)
    mask = torch.tensor([m for ms in step.loss_masks for m in ms], dtype=torch.float64)
    index = _sample_index(step, list(range(n)))
    dens = torch.as_tensor(step_denominators(step, mode, "original"), dtype=torch.float64)
    grads, values = [], []
    for sequence in (False, True):
        theta = torch.linspace(-0.4, 0.4, step.num_tokens, dtype=torch.float64,
                               requires_grad=True)
        terms = policy_loss(theta, theta.detach(), adv, surrogate="gspo" if sequence else "ppo",
                            loss_mask=mask, sample_index=index)
        loss = microbatch_loss(terms.total, mask, index, dens)
        loss.backward()
        values.append(float(loss))
        grads.append(theta.grad)
    assert values[0] == pytest.approx(values[1], rel=1e-12, abs=1e-12)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


@given(gspo_steps(), st.sampled_from(list(LossMode)), st.integers(2, 4), st.data())
def test_gspo_over_cp_ranks_with_reduced_sums_gives_the_whole_step(case, mode, cp, data):
    """Context parallelism: every CP rank holds any slice of every sample's tokens (zigzag in
    the shell; here any assignment, some ranks holding none of a sample). With the per-sample
    ``(sums, counts)`` reduced over the ranks (``reduce``, the shell's differentiable
    all-reduce; here the other ranks' sums added in one autograd graph), the ranks' partials
    add up to the whole step's loss and gradient. Without the reduce they do not."""
    step, old, adv, _ = case
    n = len(step.group_ids)
    owner = torch.tensor(data.draw(st.lists(st.integers(0, cp - 1), min_size=step.num_tokens,
                                            max_size=step.num_tokens)))
    dens = torch.as_tensor(step_denominators(step, mode, "original"), dtype=torch.float64)
    index = _sample_index(step, list(range(n)))
    mask = torch.tensor([m for ms in step.loss_masks for m in ms], dtype=torch.float64)
    theta = torch.linspace(-0.4, 0.4, step.num_tokens, dtype=torch.float64, requires_grad=True)

    def rank_sums(r):  # rank r's per-sample (sums, counts), as gspo_clip_loss forms them
        held = (owner == r).to(theta.dtype)
        parts = torch.stack([(theta - old) * mask * held, mask * held])
        return torch.zeros((2, n), dtype=theta.dtype).index_add(1, index, parts)

    total = theta.sum() * 0.0
    for r in range(cp):
        sel = (owner == r).nonzero().flatten()
        others = sum((rank_sums(q) for q in range(cp) if q != r), torch.zeros((2, n)))
        loss, _, _ = gspo_clip_loss(theta[sel], old[sel], adv[sel], mask[sel], index[sel],
                                    eps_clip=0.2, num_samples=n, reduce=lambda x: x + others)
        total = total + microbatch_loss(loss, mask[sel], index[sel], dens)
    whole_theta = theta.detach().clone().requires_grad_(True)
    _, _, whole = _gspo(whole_theta, old, adv, step, list(range(n)))
    expected = microbatch_loss(whole, mask, index, dens)
    total.backward()
    expected.backward()
    assert float(total) == pytest.approx(float(expected), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(theta.grad, whole_theta.grad, rtol=1e-12, atol=1e-12)


def test_sequence_ratio_is_the_geometric_mean_clipped_per_sequence():
    logp = torch.tensor([math.log(2.0), 0.0, 0.1], dtype=torch.float64)
    old = torch.zeros(3, dtype=torch.float64)
    adv, mask = torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    loss, clipped, ratio = gspo_clip_loss(logp, old, adv, mask, torch.tensor([0, 0, 1]))
    assert ratio.tolist() == pytest.approx([math.sqrt(2), math.sqrt(2), math.exp(0.1)])
    assert loss.tolist() == pytest.approx([-1.2, -1.2, -math.exp(0.1)])  # sample 0 clipped
    assert clipped.tolist() == [1.0, 1.0, 0.0]
    masked = gspo_clip_loss(logp, old, adv, torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64),
                            torch.tensor([0, 0, 1]))[2]
    assert masked[0] == pytest.approx(2.0)  # only sample 0's unmasked token counts


def test_gspo_differs_from_grpo_exactly_from_the_second_step():
    """Two optimizer steps on one rollout (``--num-steps-per-rollout 2``, old log-probs
    fixed) of a policy whose tokens share parameters: step 1 is on policy and identical;
    step 2 sees token log-ratios that differ within a sequence, where the per-sequence
    ratio (and its clip) differs from the per-token ones."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(7, 3, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0] * 4 + [-1.0] * 3, dtype=torch.float64)
    mask = torch.ones(7, dtype=torch.float64)
    index = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    dens = torch.tensor([4.0, 3.0], dtype=torch.float64)
    start = torch.randn(3, generator=g, dtype=torch.float64) * 0.1
    old = (features @ start).detach()
    params = {}
    for sequence in (False, True):
        w = start.clone().requires_grad_(True)
        opt = torch.optim.SGD([w], lr=0.5)
        history = []
        for _ in range(2):
            opt.zero_grad()
            terms = policy_loss(features @ w, old, adv, eps_clip=0.2, surrogate="gspo" if sequence else "ppo",
                                loss_mask=mask, sample_index=index)
            microbatch_loss(terms.total, mask, index, dens).backward()
            opt.step()
            history.append(w.detach().clone())
        params[sequence] = history
    torch.testing.assert_close(params[False][0], params[True][0], rtol=0, atol=1e-15)
    assert (params[False][1] - params[True][1]).abs().max() > 1e-4
