"""The fast kernels equal their naive textbook definitions (``benchmarks.reference``).

Properties: FFD, first-fit and FLOPs packing give the same bins in the same order as the linear
scans; the heap splitter equals the rescanning splitter; equal-count Karmarkar-Karp equals the
plain version and keeps counts equal; LPT equals the linear-scan LPT; ``lpt_bins`` returns
exactly ``m`` non-empty bins within the cap or declines. Against the optimum: FFD and first-fit
stay within their tight worst-case bounds (exact optimum on up to 12 items) and no two of their
bins fit together. FFD is *not* always at most first-fit (a named counterexample below).
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import reference as ref
from tests.property.bin_packing import (EXACT_LIMIT, any_fit_upper_bound, ffd_upper_bound,
                                        first_fit_upper_bound, lower_bound, optimal_count,
                                        optimal_count_by_enumeration)
from vime_pure.scheduling import kernels
from vime_pure.scheduling.rank_balance import lpt_bins


@st.composite
def packing_cases(draw, max_items: int = 60):
    """Sizes around a cap: many small items, some over half the cap, some oversize, ties."""
    cap = draw(st.integers(1, 120))
    size = st.one_of(st.integers(1, max(1, cap // 3)), st.integers(1, cap),
                     st.integers(cap, 3 * cap), st.sampled_from([1, cap, max(1, cap // 2)]))
    sizes = draw(st.lists(size, max_size=max_items))
    return np.array(sizes, dtype=np.int64), cap


@given(packing_cases())
def test_ffd_equals_naive_definition(case):
    """The fast FFD and the linear scan run the same algorithm with the same tie-breaks."""
    sizes, cap = case
    assert kernels.first_fit_decreasing(sizes, cap) == ref.naive_first_fit_decreasing(sizes, cap)


@given(packing_cases())
def test_first_fit_equals_naive_definition(case):
    """The segment-tree first-fit finds the same first bin with room as a scan of all bins."""
    sizes, cap = case
    assert kernels.first_fit(sizes, cap) == ref.naive_first_fit(sizes, cap)


@given(packing_cases(), st.integers(1, 12), st.randoms(use_true_random=False))
def test_flops_pack_equals_naive_definition(case, num_bins, rnd):
    """Parking full bins in a heap only skips bins the linear scan would reject too."""
    sizes, cap = case
    # Work correlated with size plus noise, with ties.
    work = np.array([s + rnd.choice([0.0, 0.5, 3.0]) for s in sizes.tolist()])
    assert (kernels.flops_balanced_pack(sizes, work, cap, num_bins)
            == ref.naive_flops_balanced_pack(sizes, work, cap, num_bins))


@given(packing_cases(), st.integers(1, 9))
def test_heap_splitter_equals_rescanning_splitter(case, multiple):
    """The heap pops the heaviest splittable bin the rescan finds; splitting a multi-item bin
    in two keeps every item, non-empty bins and the cap, and ends at the next multiple."""
    sizes, cap = case
    bins = kernels.first_fit_decreasing(sizes, cap)
    fast = kernels.split_to_multiple(bins, sizes, multiple)
    assert fast == ref.naive_split_to_multiple(bins, sizes, multiple)
    if fast is not None:
        assert len(fast) % multiple == 0 and all(fast)
        assert sorted(i for b in fast for i in b) == list(range(len(sizes)))
        assert all(len(b) == 1 or sizes[b].sum() <= cap for b in fast)


@given(st.integers(1, 8), st.integers(0, 8), st.lists(st.integers(0, 50), min_size=64,
                                                      max_size=64))
def test_karmarkar_karp_equal_counts(parts, rows, values):
    """Same merge loop as the plain version; every merge keeps one item per row in every set,
    so all sets end with ``rows`` items."""
    weights = np.array(values[:parts * rows], dtype=np.float64)
    out = kernels.karmarkar_karp_equal(weights, parts)
    if rows:
        assert out == ref.naive_karmarkar_karp(weights, parts, equal=True)
    assert [len(p) for p in out] == [rows] * parts
    assert sorted(i for p in out for i in p) == list(range(parts * rows))


@given(st.integers(1, 6), st.lists(st.integers(0, 40), max_size=40))
def test_lpt_equals_linear_scan(parts, values):
    """The heap's least-loaded part (lowest index on ties) is the linear scan's."""
    weights = np.array(values, dtype=np.float64)
    assert kernels.lpt_partition(weights, parts) == ref.naive_lpt(weights, parts)


@given(packing_cases(max_items=30), st.integers(1, 6))
def test_lpt_bins_exact_count_within_cap(case, m):
    """``lpt_bins``' contract: exactly ``m`` non-empty bins within the cap, or None."""
    sizes, cap = case
    order = np.argsort(-sizes, kind="stable").tolist()
    bins = lpt_bins(order, sizes[order].tolist(), m, cap)
    if bins is None:
        return
    assert len(bins) == m and all(bins)
    assert sorted(i for b in bins for i in b) == sorted(order)
    assert all(len(b) == 1 or sizes[b].sum() <= cap for b in bins)


@given(packing_cases(max_items=EXACT_LIMIT))
def test_ffd_within_dosa_bound_of_the_optimum(case):
    """lower bound <= OPT <= FFD <= 11/9 OPT + 6/9 on the fitting items (Dósa 2007, tight),
    oversize items alone in both."""
    sizes, cap = case
    count = len(kernels.first_fit_decreasing(sizes, cap))
    assert lower_bound(sizes, cap) <= optimal_count(sizes, cap) <= count
    assert count <= ffd_upper_bound(sizes, cap)


@given(packing_cases(max_items=EXACT_LIMIT))
def test_first_fit_within_dosa_sgall_bound_of_the_optimum(case):
    """OPT <= FF <= floor(1.7 OPT) on the fitting items (Dósa and Sgall 2013, tight), oversize
    items alone in both."""
    sizes, cap = case
    count = len(kernels.first_fit(sizes, cap))
    assert optimal_count(sizes, cap) <= count <= first_fit_upper_bound(sizes, cap)


@given(packing_cases(), st.sampled_from(["ffd", "first_fit"]))
def test_no_two_first_fit_bins_fit_together(case, algorithm):
    """Every item of a later bin skipped each earlier bin for lack of room, and loads only grow,
    so load(earlier) + smallest item(later) > cap; hence B <= 1 or B * cap < 2 * tokens."""
    sizes, cap = case
    pack = kernels.first_fit_decreasing if algorithm == "ffd" else kernels.first_fit
    bins = [b for b in pack(sizes, cap) if sizes[b].max() <= cap]
    loads = [int(sizes[b].sum()) for b in bins]
    smallest = [int(sizes[b].min()) for b in bins]
    assert all(loads[i] + smallest[j] > cap for j in range(len(bins)) for i in range(j))
    assert len(pack(sizes, cap)) <= any_fit_upper_bound(sizes.tolist(), cap)


@given(st.integers(1, 30).flatmap(lambda cap: st.tuples(
    st.lists(st.integers(1, 2 * cap), max_size=7), st.just(cap))))
def test_exact_optimum_equals_enumeration(case):
    """The subset DP and a search over every partition compute the same minimum."""
    sizes, cap = case
    assert optimal_count(sizes, cap) == optimal_count_by_enumeration(sizes, cap)


def test_ffd_can_use_more_bins_than_first_fit():
    """Why no property says FFD <= first-fit: issue 15's step (optimum 2)."""
    sizes = np.array([1, 1, 1, 1, 1, 1, 336, 456, 120, 120, 425, 425])
    assert len(kernels.first_fit(sizes, 1000)) == optimal_count(sizes.tolist(), 1000) == 2
    assert len(kernels.first_fit_decreasing(sizes, 1000)) == 3


def test_docstring_examples():
    sizes = np.array([300, 800, 200, 700])
    assert kernels.first_fit_decreasing(sizes, 1000) == [[1, 2], [3, 0]]
    assert kernels.first_fit(sizes, 1000) == [[0, 2], [1], [3]]
    assert kernels.split_to_count([[0, 1], [2]], np.array([5, 4, 6]), 3) == [[0], [2], [1]]
    assert kernels.lpt_partition(np.array([5.0, 4, 3, 3, 3]), 2) == [[0, 3], [1, 2, 4]]
    kk = kernels.karmarkar_karp_equal(np.array([8.0, 7, 6, 5, 4, 3]), 2)
    assert sorted(sum([8, 7, 6, 5, 4, 3][i] for i in part) for part in kk) == [16, 17]
    assert lpt_bins([0, 1, 2, 3, 4], [9, 5, 4, 3, 1], 2, 20) == [[0, 3], [1, 2, 4]]
