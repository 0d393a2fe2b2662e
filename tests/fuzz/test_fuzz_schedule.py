"""Fuzz: the scheduler's entry points (``build_schedule``, ``check_feasible``,
``policy_from_flags``) and the layout / policy records, on valid and invalid inputs.

Success must mean a schedule that keeps the documented meaning of group ids (each None its own
group; ids never merged across types) and covers every sample once; failure a ``VimeError``.
"""

from collections import defaultdict

import numpy as np

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import REJECTED, canonical_groups, outcome
from tests.fuzz.strategies import (JUNK, bad_id_lists, bad_ints, bad_length_lists, good_ints,
                                   one_bad, or_junk)
from tests.property.strategies import scenarios
from vime_pure import (BALANCES, PACKINGS, BatchingPolicy, ParallelLayout, Schedule,
                       build_schedule, check_feasible, policy_from_flags)

CHOICES = st.one_of(st.text(max_size=3), JUNK)


def layout_kwargs() -> st.SearchStrategy:
    return one_bad({"dp": good_ints(1, 4), "cp": good_ints(1, 2), "pp": good_ints(1, 2),
                    "vpp": st.sampled_from([1, 1, 2]),
                    "microbatch_group": st.one_of(st.none(), good_ints(1, 3))},
                   {"dp": bad_ints(1), "cp": bad_ints(1), "pp": bad_ints(1), "vpp": bad_ints(1),
                    "microbatch_group": bad_ints(1)})


def policy_kwargs() -> st.SearchStrategy:
    return one_bad({"global_batch_size": good_ints(1, 12),
                    "max_tokens_per_gpu": st.one_of(good_ints(50, 600), st.none()),
                    "micro_batch_size": st.one_of(st.none(), st.none(), good_ints(1, 4)),
                    "packing": st.sampled_from(PACKINGS), "balance": st.sampled_from(BALANCES),
                    "allow_partial_step": st.one_of(st.booleans(), st.just(np.True_))},
                   {"global_batch_size": bad_ints(1), "max_tokens_per_gpu": bad_ints(1),
                    "micro_batch_size": bad_ints(1), "packing": CHOICES, "balance": CHOICES})


@given(layout_kwargs())
def test_parallel_layout(kwargs):
    layout = outcome("ParallelLayout", ParallelLayout, **kwargs)
    if layout is not REJECTED:
        assert all(type(getattr(layout, f)) is int for f in ("dp", "cp", "pp", "vpp"))
        assert layout.align_multiple % layout.dp == 0 and layout.align_multiple >= 1


@given(policy_kwargs())
def test_batching_policy(kwargs):
    policy = outcome("BatchingPolicy", BatchingPolicy, **kwargs)
    if policy is not REJECTED:
        assert type(policy.global_batch_size) is int and policy.global_batch_size >= 1
        assert policy.packing in PACKINGS and policy.balance in BALANCES
        assert type(policy.allow_partial_step) is bool


@given(or_junk(st.builds(ParallelLayout, dp=st.integers(1, 4))),
       or_junk(st.builds(BatchingPolicy, global_batch_size=st.integers(1, 8),
                         max_tokens_per_gpu=st.integers(1, 99))))
def test_check_feasible(layout, policy):
    outcome("check_feasible", check_feasible, layout, policy)


@given(one_bad({"global_batch_size": good_ints(1, 8),
                "max_tokens_per_gpu": st.one_of(good_ints(1, 500), st.none()),
                "micro_batch_size": st.none(), "packing": st.none() | st.sampled_from(PACKINGS),
                "balance": st.none() | st.sampled_from(BALANCES),
                "balance_data": st.booleans(), "balance_by_flops": st.booleans(),
                "allow_partial_train_step": st.booleans()},
               {"global_batch_size": bad_ints(1), "max_tokens_per_gpu": bad_ints(1),
                "micro_batch_size": good_ints(1, 4), "packing": CHOICES, "balance": CHOICES}))
def test_policy_from_flags(kwargs):
    policy = outcome("policy_from_flags", policy_from_flags, **kwargs)
    assert policy is REJECTED or isinstance(policy, BatchingPolicy)


@st.composite
def schedule_inputs(draw):
    """A feasible-looking scenario (ids sometimes None or numpy ints), then half the time one
    argument replaced by a bad one: lengths or ids with a bad entry, of another length or
    type; a junk layout, policy or flops."""
    lengths, group_ids, layout, policy = draw(scenarios())
    if draw(st.booleans()):  # the same groups as an integer array (numbered as they appear)
        number = {g: k for k, g in enumerate(dict.fromkeys(group_ids))}
        group_ids = np.asarray([number[g] for g in group_ids], dtype=np.int64)
    else:
        group_ids = [None if draw(st.integers(0, 5)) == 0 else g for g in group_ids]
    kwargs = dict(lengths=lengths, group_ids=group_ids, layout=layout, policy=policy, flops=None)
    if draw(st.booleans()):
        n = len(lengths)
        name = draw(st.sampled_from(sorted(kwargs)))
        kwargs[name] = draw({"lengths": bad_length_lists(n), "group_ids": bad_id_lists(n),
                             "flops": st.lists(st.floats(allow_nan=True, allow_infinity=True),
                                               min_size=n, max_size=n) | JUNK}.get(name, JUNK))
    return kwargs


@given(schedule_inputs())
def test_build_schedule(kwargs):
    s = outcome("build_schedule", build_schedule, **kwargs)
    if s is REJECTED:
        return
    assert isinstance(s, Schedule)  # constructed, so its own invariant checks passed
    groups = canonical_groups(kwargs["group_ids"])
    assert not any(isinstance(g, (bool, float)) for g in groups)  # never merged across types
    members = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    step_of = {i: k for k, st_ in enumerate(s.steps) for r in st_.microbatches for mb in r
               for i in mb}
    for k, step in enumerate(s.steps):
        held = {groups[i] for i, j in step_of.items() if j == k}
        assert len(held) == step.num_groups  # None ids count one group each
    kept = sum(step.num_groups for step in s.steps)
    assert kept + len(s.dropped_groups) == len(members)
    assert len(step_of) + len(s.dropped_samples) == len(groups)
    for idx in members.values():
        assert len({step_of.get(i, -1) for i in idx}) == 1  # siblings share a step
