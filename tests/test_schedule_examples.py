"""Named scenarios users hit, each with exact expected schedules."""

import sys

import numpy as np
import pytest

from tests.invariant_helpers import assert_schedule_invariants
from vime_pure import (BatchingPolicy, ParallelLayout, ScheduleError, build_schedule,
                       check_feasible)
from vime_pure.scheduling.registry import (COMPILED_MIN_SAMPLES, PURE, kernel_set,
                                           numba_available)


def _build(lengths, groups, layout, policy):
    s = build_schedule(lengths, groups, layout, policy)
    assert_schedule_invariants(s, groups)
    return s


def test_static_stride():
    # 8 samples, mbs=2 -> 4 chunks [0,1] [2,3] [4,5] [6,7], round-robin over dp=2.
    s = _build([10] * 8, list(range(8)), ParallelLayout(dp=2),
               BatchingPolicy(global_batch_size=8, micro_batch_size=2))
    assert s.steps[0].microbatches == (((0, 1), (4, 5)), ((2, 3), (6, 7)))
    assert s.partitions == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert s.micro_batch_indices == (((0, 1), (2, 3)), ((0, 1), (2, 3)))


def test_static_balance_over_several_steps():
    # Two steps of 4 groups; token balancing pairs heavy with light chunks on each rank.
    lengths = [100, 1, 90, 2, 5, 80, 6, 70]
    s = _build(lengths, list(range(8)), ParallelLayout(dp=2),
               BatchingPolicy(global_batch_size=4, micro_batch_size=1, balance="tokens"))
    assert s.num_steps == 2
    for step in s.steps:
        loads = [sum(lengths[i] for mb in r for i in mb) for r in step.microbatches]
        assert step.num_microbatches == 2
        assert max(loads) - min(loads) <= 12
    assert {tuple(sorted(i for mb in r for i in mb)) for r in s.steps[0].microbatches} == {
        (0, 1), (2, 3)}


def test_uniform_dynamic_packs_to_lower_bound():
    # 16 samples of 250 tokens, cap 1000 -> exactly 4 per micro-batch, 4 micro-batches, dp=2.
    s = _build([250] * 16, list(range(16)), ParallelLayout(dp=2),
               BatchingPolicy(global_batch_size=16, max_tokens_per_gpu=1000))
    assert s.steps[0].num_microbatches == 2
    assert all(len(mb) == 4 for r in s.steps[0].microbatches for mb in r)


def test_oversize_sample_sits_alone():
    s = _build([5000, 300, 300, 300], list(range(4)), ParallelLayout(dp=2),
               BatchingPolicy(global_batch_size=4, max_tokens_per_gpu=1000))
    mbs = [mb for r in s.steps[0].microbatches for mb in r]
    assert (0,) in mbs
    assert all(sum([5000, 300, 300, 300][i] for i in mb) <= 1000 for mb in mbs if len(mb) > 1)


def test_cp_multiplies_the_cap():
    # cap = 600 * cp(2) = 1200: two 500-token samples share a micro-batch.
    s = _build([500] * 4, list(range(4)), ParallelLayout(dp=1, cp=2),
               BatchingPolicy(global_batch_size=4, max_tokens_per_gpu=600))
    assert s.steps[0].num_microbatches == 2


def test_vpp_rounds_microbatch_count_up():
    # 6 samples of 400 with cap 1000 pack into 3 bins; dp=1, vpp=2, group 4 -> split to 4.
    layout = ParallelLayout(dp=1, pp=2, vpp=2, microbatch_group=4)
    s = _build([400] * 6, list(range(6)), layout,
               BatchingPolicy(global_batch_size=6, max_tokens_per_gpu=1000))
    assert s.steps[0].num_microbatches == 4


def test_siblings_kept_together_across_steps():
    # Group "a" has non-contiguous siblings; gbs=2 groups per step: a+b, then c+d.
    groups = ["a", "b", "a", "c", "d", "a", "c"]
    s = _build([10] * 7, groups, ParallelLayout(dp=1),
               BatchingPolicy(global_batch_size=2, max_tokens_per_gpu=100))
    first = sorted(i for r in s.steps[0].microbatches for mb in r for i in mb)
    assert first == [0, 1, 2, 5]
    assert [st.num_groups for st in s.steps] == [2, 2]


def test_trailing_groups_dropped_and_reported():
    s = _build([10] * 7, ["a", "b", "c", "c", "d", "e", "f"], ParallelLayout(dp=1),
               BatchingPolicy(global_batch_size=4, max_tokens_per_gpu=100))
    assert s.dropped_groups == ("e", "f")
    assert s.dropped_samples == (5, 6)


def test_partial_step_opted_in():
    s = _build([10] * 7, ["a", "b", "c", "c", "d", "e", "f"], ParallelLayout(dp=2),
               BatchingPolicy(global_batch_size=4, max_tokens_per_gpu=20,
                              allow_partial_step=True))
    assert [st.num_groups for st in s.steps] == [4, 2]
    assert s.dropped_groups == () and s.dropped_samples == ()


def test_partial_step_infeasible_under_vpp_is_dropped_not_crashed():
    # Trailing 2 groups of 1 sample cannot form dp*group = 4 micro-batches: dropped, reported.
    layout = ParallelLayout(dp=2, pp=2, vpp=2, microbatch_group=2)
    s = _build([10] * 10, list(range(10)), layout,
               BatchingPolicy(global_batch_size=8, max_tokens_per_gpu=100,
                              allow_partial_step=True))
    assert s.num_steps == 1
    assert s.dropped_groups == (8, 9)


def test_fewer_groups_than_a_step():
    with pytest.raises(ScheduleError, match=r"only 3 groups arrived.*global_batch_size=8"):
        build_schedule([10, 10, 10, 10], [0, 0, 1, 2], ParallelLayout(dp=1),
                       BatchingPolicy(global_batch_size=8, max_tokens_per_gpu=100))


def test_misaligned_static_config():
    policy = BatchingPolicy(global_batch_size=6, micro_batch_size=2)
    with pytest.raises(ScheduleError, match=r"3 micro-batches.*multiple of dp=2.*Fix:"):
        check_feasible(ParallelLayout(dp=2), policy)
    with pytest.raises(ScheduleError, match="Fix:"):
        build_schedule([5] * 6, list(range(6)), ParallelLayout(dp=2), policy)


def test_static_step_with_siblings_misaligned_names_the_step():
    # gbs=2 groups -> 3 samples in step 0 -> 3 chunks of 1, not a multiple of dp=2.
    with pytest.raises(ScheduleError, match=r"step 0: .*3 micro-batches"):
        build_schedule([5, 5, 5, 5], ["a", "a", "b", "c"], ParallelLayout(dp=2),
                       BatchingPolicy(global_batch_size=2, micro_batch_size=1))


def test_dynamic_step_too_small_to_align():
    # Five samples that each fill a micro-batch cannot become 8 micro-batches for dp=4.
    with pytest.raises(ScheduleError, match="splitting can make at most 5"):
        build_schedule([100, 100, 100, 60, 50], [0, 1, 2, 3, 3], ParallelLayout(dp=4),
                       BatchingPolicy(global_batch_size=4, max_tokens_per_gpu=100))


def test_flops_packing_respects_the_cap():
    lengths = [900, 850, 100, 90, 80, 700, 50, 40]
    s = _build(lengths, list(range(8)), ParallelLayout(dp=2),
               BatchingPolicy(global_batch_size=8, max_tokens_per_gpu=1000, packing="flops",
                              balance="flops"))
    for r in s.steps[0].microbatches:
        for mb in r:
            assert len(mb) == 1 or sum(lengths[i] for i in mb) <= 1000


def test_module_docstring_example():
    s = _build(list(range(100, 900, 100)), list(range(8)), ParallelLayout(dp=2),
               BatchingPolicy(global_batch_size=8, max_tokens_per_gpu=1000))
    packed = sorted(sorted(((i + 1) * 100 for i in mb), reverse=True)
                    for r in s.steps[0].microbatches for mb in r)
    assert packed == [[500, 100], [600, 400], [700, 300], [800, 200]]


@pytest.mark.parametrize("kwargs, field", [
    (dict(dp=0), "dp"), (dict(dp=2, cp=0), "cp"), (dict(dp=2, vpp=2), "microbatch_group"),
    (dict(dp=2, vpp=2, microbatch_group=0), "microbatch_group"), (dict(dp=True), "dp"),
])
def test_layout_errors_name_the_field(kwargs, field):
    with pytest.raises(ScheduleError, match=rf"^{field}=.*Fix:"):
        ParallelLayout(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(global_batch_size=0, micro_batch_size=1), "global_batch_size"),
    (dict(global_batch_size=4), "max_tokens_per_gpu"),
    (dict(global_batch_size=4, max_tokens_per_gpu=-1), "max_tokens_per_gpu"),
    (dict(global_batch_size=4, max_tokens_per_gpu=10, packing="best_fit"), "packing"),
    (dict(global_batch_size=4, max_tokens_per_gpu=10, balance="random"), "balance"),
])
def test_policy_errors_name_the_field(kwargs, field):
    with pytest.raises(ScheduleError, match=rf"^{field}=.*Fix:"):
        BatchingPolicy(**kwargs)


def test_input_errors():
    layout, policy = ParallelLayout(dp=1), BatchingPolicy(global_batch_size=1,
                                                          max_tokens_per_gpu=10)
    with pytest.raises(ScheduleError, match="group_ids has 1 entries but lengths has 2"):
        build_schedule([1, 2], [0], layout, policy)
    with pytest.raises(ScheduleError, match=r"flops\[1\]"):
        build_schedule([1, 2], [0, 1], layout, policy, flops=[1.0, float("nan")])
    with pytest.raises(ScheduleError, match=r"group_ids\[0\]=\[1\]: is a list, not an int"):
        build_schedule([1], [[1]], layout, policy)
    with pytest.raises(ScheduleError, match="not a ParallelLayout"):
        build_schedule([1], [0], 4, policy)


@pytest.mark.parametrize("group_ids, message", [
    ([1, 1.0, True], r"group_ids\[1\]=1.0: is a float: .*True == 1 == 1.0"),
    ([1, True], r"group_ids\[1\]=True: is a bool"),
    (np.array([1.0, float("nan"), 2.0]), r"group_ids\[0\]=1.0: is a float64 entry"),
    (None, r"group_ids=<NoneType>: is not a list"),
    ((g for g in [1, 2, 3]), r"group_ids=<generator>: is not a list"),
    ("abc", r"group_ids=<str>: is not a list"),
])
def test_group_ids_that_would_merge_or_are_not_ids_are_rejected(group_ids, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule([1, 2, 3], group_ids, ParallelLayout(dp=1),
                       BatchingPolicy(global_batch_size=1, max_tokens_per_gpu=10))


def test_none_group_id_means_its_own_group_as_in_rollout_batches():
    # Three samples, two without an id: three groups, as RolloutBatch.from_samples counts them.
    s = build_schedule([5, 7, 3], ["a", None, None], ParallelLayout(dp=1),
                       BatchingPolicy(global_batch_size=2, max_tokens_per_gpu=8))
    assert s.steps[0].num_groups == 2 and s.dropped_groups == (None,)
    assert s.dropped_samples == (2,)
    ints = build_schedule(np.array([5, 7], dtype=np.uint64), [np.int64(4), "4"],
                          ParallelLayout(dp=1), BatchingPolicy(global_batch_size=2,
                                                               max_tokens_per_gpu=8))
    assert ints.steps[0].num_groups == 2  # 4 and "4" are different ids


@pytest.mark.parametrize("lengths, message", [
    ([900, 300, 2.5], r"lengths\[2\]=2.5: is a float, not an integer"),
    ([900, True], r"lengths\[1\]=True: is a bool"),
    (np.array([3, 2**64 - 1], dtype=np.uint64), r"lengths\[1\]=18446744073709551615: exceeds"),
    ([1, 2**70], r"lengths\[1\]=1180591620717411303424: exceeds"),
    ([4, 0], r"lengths\[1\]=0: is not positive"),
    (np.array([1.0, 2.0]), r"lengths=<float64 array>: is not an integer array"),
    (None, r"lengths=<NoneType>: is not a list"),
])
def test_length_errors_name_the_first_bad_entry_with_its_real_value(lengths, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(lengths, list(range(len(lengths) if lengths is not None else 0)),
                       ParallelLayout(dp=1), BatchingPolicy(global_batch_size=1,
                                                            max_tokens_per_gpu=10))


def test_partial_step_error_says_fix_once():
    with pytest.raises(ScheduleError) as info:
        build_schedule([10, 10, 10], [0, 1, 2], ParallelLayout(dp=4),
                       BatchingPolicy(global_batch_size=4, max_tokens_per_gpu=100,
                                      allow_partial_step=True))
    assert str(info.value).count("Fix:") == 1 and "could not help" in str(info.value)


def test_dynamic_gbs_below_alignment_rejected_at_launch():
    with pytest.raises(ScheduleError, match="at least 16"):
        check_feasible(ParallelLayout(dp=8, pp=2, vpp=2, microbatch_group=2),
                       BatchingPolicy(global_batch_size=8, max_tokens_per_gpu=1000))


def _hand_built(sample_ids, mb_offsets, step_microbatches, step_groups, groups):
    from vime_pure.scheduling.schedule import Schedule

    a = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return Schedule(layout=ParallelLayout(dp=1), policy=BatchingPolicy(
        global_batch_size=1, max_tokens_per_gpu=100), lengths_array=a([5] * len(groups)),
        group_array=a(groups), sample_ids=a(sample_ids), mb_offsets=a(mb_offsets),
        step_microbatches=a(step_microbatches), step_groups=a(step_groups),
        dropped_groups=(), dropped_array=a([]))


@pytest.mark.parametrize("groups, step_groups, message", [
    ([0, 1, 0], [2, 1], "group 0 straddles steps 0 and 1"),
    ([0, 1, 2], [2, 2], "step 1 says 2 groups but holds 1"),
])
def test_sibling_invariant_violations_name_the_group_and_steps(groups, step_groups, message):
    # Hand-built (a bug in vime, not bad input): samples 0, 1 in step 0 and 2 in step 1.
    from vime_pure.errors import ScheduleInvariantError

    with pytest.raises(ScheduleInvariantError, match=f"invariant 5 violated: {message}"):
        _hand_built([0, 1, 2], [0, 1, 2, 3], [2, 1], step_groups, groups)


def test_the_kernel_set_follows_the_batch_size_unless_forced(monkeypatch):
    """A small batch never pays numba's first compile; a large one gets the compiled kernels
    when numba is there; ``VIME_KERNELS`` forces either set at any size."""
    monkeypatch.delenv("VIME_KERNELS", raising=False)
    assert kernel_set(num_samples=COMPILED_MIN_SAMPLES - 1) is PURE
    large = kernel_set(num_samples=COMPILED_MIN_SAMPLES)
    assert large.name == ("compiled" if numba_available() else "pure")
    monkeypatch.setenv("VIME_KERNELS", "pure")
    assert kernel_set(num_samples=10 * COMPILED_MIN_SAMPLES) is PURE
    if numba_available():
        monkeypatch.setenv("VIME_KERNELS", "compiled")
        assert kernel_set(num_samples=1).name == "compiled"


def test_without_numba_a_large_batch_plans_on_the_pure_kernels(monkeypatch):
    """``vime[fast]`` is optional: with numba absent (``find_spec`` sees no module), a batch
    past ``COMPILED_MIN_SAMPLES`` takes the pure kernels and plans the schedule those give,
    and forcing the compiled set is an error that names the extra."""
    monkeypatch.delenv("VIME_KERNELS", raising=False)
    monkeypatch.setitem(sys.modules, "numba", None)  # importlib.util.find_spec -> None
    assert not numba_available()
    assert kernel_set(num_samples=4 * COMPILED_MIN_SAMPLES) is PURE
    rng = np.random.default_rng(0)
    n = COMPILED_MIN_SAMPLES
    lengths = rng.integers(1, 200, size=n)
    group_ids = np.repeat(np.arange(n // 8), 8)
    layout = ParallelLayout(dp=8)
    policy = BatchingPolicy(global_batch_size=64, max_tokens_per_gpu=1024)
    schedule = build_schedule(lengths, group_ids, layout, policy)
    assert_schedule_invariants(schedule, group_ids)
    monkeypatch.setenv("VIME_KERNELS", "pure")
    assert build_schedule(lengths, group_ids, layout, policy) == schedule
    monkeypatch.setenv("VIME_KERNELS", "compiled")
    with pytest.raises(ScheduleError, match=r"vime\[fast\]"):
        kernel_set(num_samples=n)
