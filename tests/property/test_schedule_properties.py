"""Hypothesis properties of ``build_schedule`` (see vime_pure.scheduling.schedule for
the invariants).

Each property's docstring gives the one-line reason it is a theorem. Micro-batch counts are
checked against bounds, never against another heuristic: first-fit decreasing does *not* always
use at most as many micro-batches as first-fit (``test_ffd_can_need_more_microbatches_than_
first_fit`` is a counterexample), so no property compares the two.

Counts: a step's ``num_microbatches`` is per rank; the step's total is ``num_microbatches * dp``
and is packed from that step's samples only.
"""

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from tests.invariant_helpers import assert_schedule_invariants
from tests.property.bin_packing import (EXACT_LIMIT, align_up, any_fit_upper_bound,
                                        ffd_upper_bound, first_fit_upper_bound, lower_bound,
                                        split_oversize)
from tests.property.strategies import layouts, scenarios, workloads
from tests.schedule_reference import reference_schedule_views
from vime_pure import BatchingPolicy, ParallelLayout, ScheduleError, build_schedule
from vime_pure.config import BALANCES
from vime_pure.scheduling import planner
from vime_pure.scheduling.report import step_stats

CAP = 1000  # the token cap per micro-batch of the count properties (max_tokens_per_gpu * cp)
BIN_BALANCES = ("strided", "tokens", "flops")  # the policies that deal packed bins to ranks


def _schedule_or_skip(lengths, group_ids, layout, policy):
    try:
        return build_schedule(lengths, group_ids, layout, policy)
    except ScheduleError as exc:
        # Expected rejections of drawn inputs: too few groups for a step, or a step whose
        # samples are too few to split into an aligned micro-batch count under the cap.
        assert "groups arrived" in str(exc) or "splitting can make at most" in str(exc), exc
        assert "Fix:" in str(exc)
        assume(False)


def _step_sizes(s, step):
    return [s.lengths[i] for rank in step.microbatches for mb in rank for i in mb]


@st.composite
def count_cases(draw, packings=("ffd", "first_fit", "flops")):
    """(lengths, group_ids, layout, gbs, packing, balance) with small steps (at most
    ``align_multiple + 4`` groups), so that about 60% of the examples have a step of at most
    ``EXACT_LIMIT`` fitting samples, checked against the exact optimum."""
    layout = draw(layouts(max_dp=3))
    gbs = draw(st.integers(layout.align_multiple, layout.align_multiple + 4))
    lengths, group_ids = draw(workloads(cap_hint=CAP, max_groups=2 * gbs + 1))
    return (lengths, group_ids, layout, gbs, draw(st.sampled_from(packings)),
            draw(st.sampled_from(BIN_BALANCES)))


def _policy(gbs, layout, packing, balance):
    return BatchingPolicy(global_batch_size=gbs, max_tokens_per_gpu=CAP // layout.cp,
                          packing=packing, balance=balance)


@given(scenarios())
def test_dynamic_schedule_invariants(case):
    """Every Schedule invariant holds: the planner's contract, re-checked from public fields."""
    lengths, group_ids, layout, policy = case
    s = _schedule_or_skip(lengths, group_ids, layout, policy)
    assert_schedule_invariants(s, group_ids)


@given(scenarios())
def test_deterministic(case):
    """Same input, same schedule: no randomness, ties break by position (invariant 7)."""
    lengths, group_ids, layout, policy = case
    a = _schedule_or_skip(lengths, group_ids, layout, policy)
    b = build_schedule(list(lengths), list(group_ids), layout, policy)
    assert a == b


@given(scenarios())
def test_used_microbatches_never_below_the_reported_bound(case):
    """The report's bound is a true lower bound: an oversize sample needs a micro-batch of its
    own and the rest need at least ceil(tokens / cap), aligned (samples drawn up to 3x cap)."""
    lengths, group_ids, layout, policy = case
    s = _schedule_or_skip(lengths, group_ids, layout, policy)
    for stats in step_stats(s):
        assert stats.num_microbatches >= stats.microbatch_bound_aligned >= stats.microbatch_bound
        assert stats.microbatches_per_rank >= stats.microbatch_lower_bound
        assert stats.microbatch_bound >= stats.oversize_samples


@given(scenarios())
def test_every_kept_sample_lands_once(case):
    """Packing partitions the kept samples: each lands in exactly one micro-batch."""
    lengths, group_ids, layout, policy = case
    s = _schedule_or_skip(lengths, group_ids, layout, policy)
    landed = sorted(i for step in s.steps for r in step.microbatches for mb in r for i in mb)
    assert landed == sorted(set(range(len(lengths))) - set(s.dropped_samples))


@given(scenarios())
def test_microbatch_count_never_below_the_aligned_lower_bound(case):
    """Every policy's step total >= align_up(oversize + ceil(other tokens / cap), dp * group):
    an oversize sample sits alone, the others fill micro-batches of at most ``cap`` tokens, and
    the total is a multiple of ``align_multiple``."""
    lengths, group_ids, layout, policy = case
    s = _schedule_or_skip(lengths, group_ids, layout, policy)
    cap = policy.token_cap(layout)
    for step in s.steps:
        bound = align_up(lower_bound(_step_sizes(s, step), cap), layout.align_multiple)
        assert step.num_microbatches * layout.dp >= bound


@given(count_cases(packings=("ffd", "first_fit")))
def test_ffd_and_first_fit_counts_within_their_worst_case_bounds(case):
    """Step total <= align_up(oversize + bound on the others): FFD <= 11/9 OPT + 6/9 (Dósa
    2007), first-fit <= floor(1.7 OPT) (Dósa-Sgall 2013), both < 2 * tokens / cap + 1 (no two
    first-fit bins fit together); splitting adds bins only up to the next multiple."""
    lengths, group_ids, layout, gbs, packing, balance = case
    policy = _policy(gbs, layout, packing, balance)
    s = _schedule_or_skip(lengths, group_ids, layout, policy)
    cap = policy.token_cap(layout)
    for step in s.steps:
        sizes = _step_sizes(s, step)
        bound = any_fit_upper_bound(sizes, cap)
        if len(split_oversize(sizes, cap)[1]) <= EXACT_LIMIT:
            event("step small enough for the exact optimum")
            exact = ffd_upper_bound if packing == "ffd" else first_fit_upper_bound
            bound = min(bound, exact(sizes, cap))
        assert step.num_microbatches * layout.dp <= align_up(bound, layout.align_multiple)


@given(count_cases(packings=("ffd", "first_fit", "flops")))
def test_count_does_not_depend_on_the_bin_balance(case):
    """Under strided/tokens/flops balancing the count is the packing's: balancing only deals the
    packed, aligned micro-batches to ranks."""
    lengths, group_ids, layout, gbs, packing, _ = case
    counts = {tuple(step.num_microbatches for step in _schedule_or_skip(
        lengths, group_ids, layout, _policy(gbs, layout, packing, balance)).steps)
        for balance in BIN_BALANCES}
    assert len(counts) == 1


@given(count_cases(packings=("flops",)))
def test_flops_packing_never_needs_more_microbatches_than_ffd(case):
    """FLOPs packing targets FFD's aligned count and keeps FFD's bins whenever LPT's would
    align to more, so per step its count is at most FFD's."""
    lengths, group_ids, layout, gbs, _, balance = case
    ffd = _schedule_or_skip(lengths, group_ids, layout, _policy(gbs, layout, "ffd", balance))
    flops = _schedule_or_skip(lengths, group_ids, layout, _policy(gbs, layout, "flops", balance))
    assert len(flops.steps) == len(ffd.steps)
    assert all(a.num_microbatches <= b.num_microbatches for a, b in zip(flops.steps, ffd.steps))


@given(st.data())
def test_static_invariants_or_clear_error(data):
    """Static packing either keeps every invariant with at most ``micro_batch_size`` samples per
    micro-batch, or refuses with a fix (it cannot split chunks to align)."""
    layout = data.draw(layouts(max_dp=3))
    mbs = data.draw(st.integers(1, 3))
    gbs = data.draw(st.integers(1, 12))
    lengths, group_ids = data.draw(workloads(max_groups=3 * gbs + 2))
    policy = BatchingPolicy(global_batch_size=gbs, micro_batch_size=mbs,
                            allow_partial_step=data.draw(st.booleans()))
    try:
        s = build_schedule(lengths, group_ids, layout, policy)
    except ScheduleError as exc:
        assert "Fix:" in str(exc)
        return
    assert_schedule_invariants(s, group_ids)
    for step in s.steps:
        assert all(len(mb) <= mbs for r in step.microbatches for mb in r)


def test_ffd_can_need_more_microbatches_than_first_fit():
    """Issue 15's counterexample to the old property "FFD never uses more micro-batches than
    first-fit". Step 1 holds 1 x6, 336, 456, 120, 120, 425, 425 (1888 tokens, optimum 2):
    first-fit in group order packs 1 x6 + 336 + 456 + 120 | 120 + 425 + 425, while FFD packs
    456 + 425 + 1 x6 | 425 + 336 + 120 | 120."""
    lengths = [1] * 11 + [120, 120, 336, 425, 425, 456]
    group_ids = [3, 10, 17, 17, 17, 24, 24, 24, 24, 31, 31, 38, 38, 31, 38, 38, 31]
    counts = {packing: [step.num_microbatches for step in build_schedule(
        lengths, group_ids, ParallelLayout(dp=1),
        BatchingPolicy(global_batch_size=3, max_tokens_per_gpu=1000, packing=packing)).steps]
        for packing in ("ffd", "first_fit")}
    assert counts == {"ffd": [1, 3], "first_fit": [1, 2]}


@pytest.mark.parametrize("bad", [[0], [-3], [1.5], [True], ["7"]])
def test_bad_lengths_rejected(bad):
    with pytest.raises(ScheduleError, match=r"lengths\[0\]"):
        build_schedule(bad, [0], ParallelLayout(dp=1),
                       BatchingPolicy(global_batch_size=1, max_tokens_per_gpu=8))


@st.composite
def registry_cases(draw):
    """Any packing of the planner's registry with any balance, dynamic or static, with a
    partial step sometimes, and None group ids sometimes (each its own group)."""
    layout = draw(layouts(max_dp=3))
    packing = draw(st.sampled_from(sorted(planner.PACKERS)))
    gbs = draw(st.integers(layout.align_multiple, layout.align_multiple + 8))
    lengths, group_ids = draw(workloads(max_groups=3 * gbs + 3))
    if packing == "static":
        mbs = draw(st.integers(1, 3))
        policy = BatchingPolicy(global_batch_size=gbs, micro_batch_size=mbs,
                                balance=draw(st.sampled_from(BALANCES)),
                                allow_partial_step=draw(st.booleans()))
    else:
        policy = BatchingPolicy(global_batch_size=gbs, max_tokens_per_gpu=CAP // layout.cp,
                                packing=packing, balance=draw(st.sampled_from(BALANCES)),
                                allow_partial_step=draw(st.booleans()))
    if draw(st.booleans()):
        group_ids = [None if k % 3 == 0 else g for k, g in enumerate(group_ids)]
    return lengths, group_ids, layout, policy


@given(registry_cases())
def test_every_registry_entry_keeps_the_invariants_and_equals_the_tuple_schedule(case):
    """Each packing of ``planner.PACKERS`` with each balance keeps every Schedule invariant,
    and the array-backed Schedule's views equal the nested tuples built the old way from the
    list kernels (``tests.schedule_reference``): storing flat arrays changed no schedule."""
    lengths, group_ids, layout, policy = case
    try:
        s = build_schedule(lengths, group_ids, layout, policy)
    except ScheduleError as exc:
        assert "Fix:" in str(exc)
        assert reference_schedule_views(lengths, group_ids, layout, policy) is None or (
            "groups arrived" not in str(exc))
        assume(False)
    if None not in group_ids:  # the helper matches dropped_groups to ids; None repeats
        assert_schedule_invariants(s, group_ids)
    steps, partitions, local, dropped, dropped_groups = reference_schedule_views(
        lengths, group_ids, layout, policy)
    assert [(p.num_groups, p.microbatches) for p in s.steps] == list(steps)
    assert s.partitions == partitions and s.micro_batch_indices == local
    assert s.dropped_samples == dropped and s.dropped_groups == dropped_groups
    assert s.lengths == tuple(lengths)
