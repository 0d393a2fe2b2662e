"""Hypothesis properties of ``build_schedule`` (see vime_pure.scheduling.schedule for the invariants)."""

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.invariant_helpers import assert_schedule_invariants
from tests.property.strategies import layouts, scenarios, workloads
from vime_pure import BatchingPolicy, ScheduleError, build_schedule
from vime_pure.scheduling.report import step_stats


def _schedule_or_skip(lengths, group_ids, layout, policy):
    try:
        return build_schedule(lengths, group_ids, layout, policy)
    except ScheduleError as exc:
        # Expected rejections of drawn inputs: too few groups for a step, or a step whose
        # samples are too few to split into an aligned micro-batch count under the cap.
        assert "groups arrived" in str(exc) or "splitting can make at most" in str(exc), exc
        assert "Fix:" in str(exc)
        assume(False)


@given(scenarios())
def test_dynamic_schedule_invariants(case):
    lengths, group_ids, layout, policy = case
    s = _schedule_or_skip(lengths, group_ids, layout, policy)
    assert_schedule_invariants(s, group_ids)


@given(scenarios())
def test_deterministic(case):
    lengths, group_ids, layout, policy = case
    a = _schedule_or_skip(lengths, group_ids, layout, policy)
    b = build_schedule(list(lengths), list(group_ids), layout, policy)
    assert a == b


@given(scenarios())
def test_used_microbatches_never_below_the_reported_bound(case):
    # The report's bound is the one the scheduler guarantees: oversize samples alone, the rest
    # in ceil(tokens / cap) micro-batches at best, aligned. Workloads draw samples up to 3x cap.
    lengths, group_ids, layout, policy = case
    s = _schedule_or_skip(lengths, group_ids, layout, policy)
    for stats in step_stats(s):
        assert stats.num_microbatches >= stats.microbatch_bound_aligned >= stats.microbatch_bound
        assert stats.microbatches_per_rank >= stats.microbatch_lower_bound
        assert stats.microbatch_bound >= stats.oversize_samples


@given(scenarios())
def test_every_kept_sample_lands_once(case):
    lengths, group_ids, layout, policy = case
    s = _schedule_or_skip(lengths, group_ids, layout, policy)
    landed = sorted(i for step in s.steps for r in step.microbatches for mb in r for i in mb)
    assert landed == sorted(set(range(len(lengths))) - set(s.dropped_samples))


@given(st.data())
def test_ffd_never_more_microbatches_than_first_fit(data):
    layout = data.draw(layouts())
    gbs = data.draw(st.integers(layout.align_multiple, layout.align_multiple + 8))
    lengths, group_ids = data.draw(workloads(max_groups=2 * gbs))
    counts = {}
    for packing in ("ffd", "first_fit"):
        policy = BatchingPolicy(global_batch_size=gbs, max_tokens_per_gpu=1000, packing=packing)
        s = _schedule_or_skip(lengths, group_ids, layout, policy)
        counts[packing] = [step.num_microbatches for step in s.steps]
    assert all(f <= ff for f, ff in zip(counts["ffd"], counts["first_fit"]))


@given(st.data())
def test_static_invariants_or_clear_error(data):
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


@pytest.mark.parametrize("bad", [[0], [-3], [1.5], [True], ["7"]])
def test_bad_lengths_rejected(bad):
    from vime_pure import ParallelLayout

    with pytest.raises(ScheduleError, match=r"lengths\[0\]"):
        build_schedule(bad, [0], ParallelLayout(dp=1),
                       BatchingPolicy(global_batch_size=1, max_tokens_per_gpu=8))
