"""Per-token weight versions (``vime_pure.token_versions``): the staleness bound acting per
token, as Hypothesis properties over samples generated across several weight syncs.

- masking never sets a mask to 1; it keeps exactly the generated tokens within the bound and
  leaves context tokens (``NO_VERSION``) as they were; it is idempotent and monotone in ``K``;
- ``version_runs`` expands back to the generated tokens' versions;
- a step of samples spanning ``k`` syncs, masked per token, split over any DP ranks,
  micro-batches and CP gives the loss and gradient of the same tokens in one micro-batch.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.loss_helpers import Split, Step, emulate_megatron
from tests.property.test_loss_invariance import per_token_loss, splits
from vime_pure import LossMode
from vime_pure.errors import RolloutValidationError
from vime_pure.token_versions import (NO_VERSION, checked_versions, mask_stale_tokens,
                                      token_staleness_counts, tokens_before, version_runs)


@st.composite
def versioned(draw, length: int, start: int = 0):
    """A response of ``length`` tokens: a 0/1 mask, and per token the version that sampled it
    (non-decreasing over the generated tokens, jumps where syncs landed) or NO_VERSION for
    context tokens (mask 0)."""
    mask = draw(st.lists(st.sampled_from([0, 1, 1]), min_size=length, max_size=length))
    context = draw(st.lists(st.booleans(), min_size=length, max_size=length))
    versions, v = [], start
    for i in range(length):
        v += draw(st.sampled_from([0, 0, 0, 1, 2]))
        if context[i] and not mask[i]:
            versions.append(NO_VERSION)
        else:
            versions.append(v)
    return mask, versions


@st.composite
def samples(draw):
    length = draw(st.integers(0, 12))
    mask, versions = draw(versioned(length, draw(st.integers(0, 3))))
    trainer = max([v for v in versions if v != NO_VERSION], default=0) + draw(st.integers(0, 3))
    return mask, versions, trainer


def test_the_docstring_example():
    mask, removed = mask_stale_tokens([1, 1, 0, 1, 1], [3, 3, -1, 4, 5], 6, 2)
    assert mask == [0, 0, 0, 1, 1] and removed == 2
    assert version_runs([3, 3, -1, 4, 5]) == ([3, 4, 5], [0, 3, 4])
    assert tokens_before([3, 3, -1, 4], 4) == 3
    assert token_staleness_counts([3, 3, 4], [1, 0, 1], 5) == {2: 1, 1: 1}


@given(case=samples(), bound=st.integers(0, 4))
def test_masking_keeps_exactly_the_generated_tokens_within_the_bound(case, bound):
    mask, versions, trainer = case
    out, removed = mask_stale_tokens(mask, versions, trainer, bound)
    for m, o, v in zip(mask, out, versions):
        assert o <= m  # never trains a token the mask left out
        if v == NO_VERSION:
            assert o == m
        else:
            assert o == (m and trainer - v <= bound)
    assert removed == sum(mask) - sum(out)
    assert mask_stale_tokens(out, versions, trainer, bound) == (out, 0)  # idempotent
    looser, _ = mask_stale_tokens(mask, versions, trainer, bound + 1)
    assert all(a <= b for a, b in zip(out, looser))  # monotone in K
    assert mask_stale_tokens(mask, versions, trainer, None) == (list(mask), 0)
    counts = token_staleness_counts(versions, out, trainer)
    assert sum(counts.values()) == sum(o for o, v in zip(out, versions) if v != NO_VERSION)
    assert all(0 <= s <= bound for s in counts)


@given(case=samples())
def test_version_runs_expand_back_to_the_generated_versions(case):
    _, versions, _ = case
    runs, starts = version_runs(versions)
    assert runs == sorted(set(runs)) and starts == sorted(starts)
    expanded = []
    for i, v in enumerate(versions):
        if v != NO_VERSION:
            expanded.append(runs[max(j for j, s in enumerate(starts) if s <= i)])
    assert expanded == [v for v in versions if v != NO_VERSION]
    assert checked_versions(versions, len(versions), "s").tolist() == versions


def test_bad_token_versions_are_typed_errors_naming_the_sample():
    with pytest.raises(RolloutValidationError, match=r"^rollout 2, sample 0: token_versions="
                                                     r"\[1\] is not one int per response token"):
        checked_versions([1], 2, "rollout 2, sample 0")
    with pytest.raises(RolloutValidationError, match=r"decreases"):
        checked_versions([2, -1, 1], 3, "s")


@st.composite
def versioned_steps(draw):
    """Groups of 1-3 samples spanning up to a few syncs each, a trainer version and a bound;
    the step holds the masks after the per-token bound."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    group_ids = [g for g, size in enumerate(sizes) for _ in range(size)]
    trainer, bound = draw(st.integers(3, 6)), draw(st.integers(0, 3))
    masks = []
    for _ in group_ids:
        mask, versions = draw(versioned(draw(st.integers(0, 8)), draw(st.integers(0, 3))))
        versions = [min(v, trainer) for v in versions]
        masks.append([float(m) for m in mask_stale_tokens(mask, versions, trainer, bound)[0]])
    prompts = draw(st.lists(st.integers(1, 4), min_size=len(group_ids), max_size=len(group_ids)))
    return Step(group_ids, prompts, masks)


@given(step=versioned_steps(), data=st.data(), mode=st.sampled_from(list(LossMode)),
       seed=st.integers(0, 2**16))
def test_a_step_across_syncs_gives_one_microbatchs_loss_under_any_split(step, data, mode, seed):
    """The per-token bound only edits masks, before the core computes denominators, so the
    split step equals the same tokens in one micro-batch on one rank (value and gradient)."""
    split = data.draw(splits(step))
    one = Split(1, 1, 1, [0] * len(step.group_ids), [0] * len(step.group_ids))
    theta = torch.linspace(-1.0, 0.0, step.num_tokens, dtype=torch.float64)
    a = theta.clone().requires_grad_(True)
    b = theta.clone().requires_grad_(True)
    split_loss, _ = emulate_megatron(step, split, per_token_loss(step, a, seed), mode, "original")
    whole_loss, _ = emulate_megatron(step, one, per_token_loss(step, b, seed), mode, "original")
    split_loss.backward()
    whole_loss.backward()
    assert float(split_loss.detach()) == pytest.approx(float(whole_loss.detach()), rel=1e-12,
                                                       abs=1e-12)
    if step.num_tokens:
        assert float((a.grad - b.grad).abs().max()) <= 1e-12
