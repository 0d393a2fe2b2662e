"""The fast kernels equal their naive textbook definitions (``benchmarks.reference``).

Properties: FFD, first-fit and FLOPs packing give the same bins in the same order as the linear
scans; the heap splitter equals the rescanning splitter; equal-count Karmarkar-Karp equals the
plain version and keeps counts equal; LPT equals the linear-scan LPT; ``lpt_bins`` returns
exactly ``m`` non-empty bins within the cap or declines.
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import reference as ref
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
    sizes, cap = case
    assert kernels.first_fit_decreasing(sizes, cap) == ref.naive_first_fit_decreasing(sizes, cap)


@given(packing_cases())
def test_first_fit_equals_naive_definition(case):
    sizes, cap = case
    assert kernels.first_fit(sizes, cap) == ref.naive_first_fit(sizes, cap)


@given(packing_cases(), st.integers(1, 12), st.randoms(use_true_random=False))
def test_flops_pack_equals_naive_definition(case, num_bins, rnd):
    sizes, cap = case
    # Work correlated with size plus noise, with ties.
    work = np.array([s + rnd.choice([0.0, 0.5, 3.0]) for s in sizes.tolist()])
    assert (kernels.flops_balanced_pack(sizes, work, cap, num_bins)
            == ref.naive_flops_balanced_pack(sizes, work, cap, num_bins))


@given(packing_cases(), st.integers(1, 9))
def test_heap_splitter_equals_rescanning_splitter(case, multiple):
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
    weights = np.array(values[:parts * rows], dtype=np.float64)
    out = kernels.karmarkar_karp_equal(weights, parts)
    if rows:
        assert out == ref.naive_karmarkar_karp(weights, parts, equal=True)
    assert [len(p) for p in out] == [rows] * parts
    assert sorted(i for p in out for i in p) == list(range(parts * rows))


@given(st.integers(1, 6), st.lists(st.integers(0, 40), max_size=40))
def test_lpt_equals_linear_scan(parts, values):
    weights = np.array(values, dtype=np.float64)
    assert kernels.lpt_partition(weights, parts) == ref.naive_lpt(weights, parts)


@given(packing_cases(max_items=30), st.integers(1, 6))
def test_lpt_bins_exact_count_within_cap(case, m):
    sizes, cap = case
    order = np.argsort(-sizes, kind="stable").tolist()
    bins = lpt_bins(order, sizes[order].tolist(), m, cap)
    if bins is None:
        return
    assert len(bins) == m and all(bins)
    assert sorted(i for b in bins for i in b) == sorted(order)
    assert all(len(b) == 1 or sizes[b].sum() <= cap for b in bins)


def test_docstring_examples():
    sizes = np.array([300, 800, 200, 700])
    assert kernels.first_fit_decreasing(sizes, 1000) == [[1, 2], [3, 0]]
    assert kernels.first_fit(sizes, 1000) == [[0, 2], [1], [3]]
    assert kernels.split_to_count([[0, 1], [2]], np.array([5, 4, 6]), 3) == [[0], [2], [1]]
    assert kernels.lpt_partition(np.array([5.0, 4, 3, 3, 3]), 2) == [[0, 3], [1, 2, 4]]
    kk = kernels.karmarkar_karp_equal(np.array([8.0, 7, 6, 5, 4, 3]), 2)
    assert sorted(sum([8, 7, 6, 5, 4, 3][i] for i in part) for part in kk) == [16, 17]
    assert lpt_bins([0, 1, 2, 3, 4], [9, 5, 4, 3, 1], 2, 20) == [[0, 3], [1, 2, 4]]
