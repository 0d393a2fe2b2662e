"""The compiled kernel set equals the pure one, kernel by kernel, and both give one schedule.

The pure kernels are the oracle (they equal their textbook definitions, ``test_kernels``); the
numba set (``vime[fast]``) must return the same bins in the same order on tie-heavy inputs, so
choosing it changes only the speed. Skipped without numba (the CI venv has it; the properties of
``test_schedule_properties`` run on both sets via ``VIME_KERNELS``).
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.property.test_kernels import packing_cases
from vime_pure import BatchingPolicy, ParallelLayout, build_schedule
from vime_pure.config import BALANCES, PACKINGS
from vime_pure.scheduling import planner
from vime_pure.scheduling.registry import PURE, kernel_set, numba_available, to_flat

pytestmark = [pytest.mark.compiled,  # make test-compiled-kernels runs them, not make test
              pytest.mark.skipif(not numba_available(), reason="numba (vime[fast]) not installed")]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@given(packing_cases())
def test_ffd_compiled_equals_pure(case):
    """Same bisection, same union-find skips, same tie-break by position."""
    sizes, cap = case
    assert _same(kernel_set("compiled").ffd(sizes, cap), PURE.ffd(sizes, cap))


@given(packing_cases())
def test_first_fit_compiled_equals_pure(case):
    """Same segment tree over bin rooms: the first bin with room, oversize items alone."""
    sizes, cap = case
    assert _same(kernel_set("compiled").first_fit(sizes, cap), PURE.first_fit(sizes, cap))


@given(packing_cases())
def test_ffd_sorted_compiled_equals_pure(case):
    """The presorted entry (the planner's FFD path) too, with a permuted item numbering."""
    sizes, cap = case
    order = np.argsort(-sizes, kind="stable")[::-1].copy()  # any numbering works
    order = order[np.argsort(-sizes[order], kind="stable")]
    ks = kernel_set("compiled")
    assert _same(ks.ffd_sorted(order, sizes[order], cap), PURE.ffd_sorted(order, sizes[order], cap))


@given(packing_cases(), st.integers(1, 9))
def test_split_compiled_equals_pure(case, multiple):
    """The heaviest splittable bin, its balanced halves and their positions are the same."""
    sizes, cap = case
    flat = PURE.ffd(sizes, cap)
    target = -(-(len(flat[1]) - 1) // multiple) * multiple
    assert _same(kernel_set("compiled").split_to_count(flat, sizes, target),
                 PURE.split_to_count(flat, sizes, target))


@given(packing_cases(), st.integers(1, 12), st.randoms(use_true_random=False))
def test_flops_pack_compiled_equals_pure(case, num_bins, rnd):
    """Same LPT order, same heaps of loads and rooms, same bins opened."""
    sizes, cap = case
    work = np.array([s + rnd.choice([0.0, 0.5, 3.0]) for s in sizes.tolist()])
    assert _same(kernel_set("compiled").flops_pack(sizes, work, cap, num_bins),
                 PURE.flops_pack(sizes, work, cap, num_bins))


@given(st.one_of(
    st.lists(st.one_of(st.integers(1, 4), st.integers(1, 70000)), min_size=64, max_size=300),
    st.lists(st.one_of(st.integers(1, 4), st.integers(1, 2**40),
                       st.integers(-2**63, 2**63 - 1)), max_size=300)))
def test_radix_sorts_equal_numpy(values):
    """FFD's size order and the kernels' int sorts: the radix sorts equal numpy's stable
    argsort of ``-values`` (ties by position) and ``np.sort``, on ties, spans of one to eight
    bytes and the whole int64 range (negative values included)."""
    from vime_pure.scheduling.compiled_kernels import _sorted_ints, argsort_desc  # imports numba

    a = np.array(values, dtype=np.int64)
    expected = sorted(range(len(values)), key=lambda i: (-values[i], i))  # Python ints: exact
    assert argsort_desc(a).tolist() == expected
    assert np.array_equal(_sorted_ints(a), np.sort(a))


@st.composite
def weights_cases(draw):
    """Bin weights with many ties (small integers) and a number of parts dividing them."""
    parts = draw(st.integers(1, 8))
    rows = draw(st.integers(0, 12))
    values = st.one_of(st.integers(0, 4).map(float), st.floats(0, 100, allow_nan=False))
    return np.array(draw(st.lists(values, min_size=parts * rows, max_size=parts * rows))), parts


@given(weights_cases())
def test_karmarkar_karp_compiled_equals_pure(case):
    """Largest differencing merges the same states in the same order (stable load sort)."""
    weights, parts = case
    assert np.array_equal(kernel_set("compiled").karmarkar_karp(weights, parts),
                          PURE.karmarkar_karp(weights, parts))


@given(weights_cases(), st.integers(1, 3))
def test_lpt_ranks_compiled_equals_pure(case, steps):
    """Per step, the same heaviest-first dealing to the lightest rank (lowest rank on ties)."""
    weights, dp = case
    step_of = np.sort(np.arange(len(weights)) % steps)
    bounds = np.searchsorted(step_of, np.arange(steps + 1))
    assert np.array_equal(kernel_set("compiled").lpt_ranks(weights, bounds, dp),
                          PURE.lpt_ranks(weights, bounds, dp))


@st.composite
def balance_cases(draw):
    """One straggler step: tie-heavy sizes around the cap (some oversize), FLOPs with ties,
    any dealing of samples to ranks (not only LPT's, so trimming, placing, ejecting and
    splitting all occur), the planner's (rank, size descending, position) order."""
    sizes, cap = draw(packing_cases(max_items=70))
    dp = draw(st.integers(1, 5))
    multiple = draw(st.sampled_from([1, 1, 2, 3]))
    ranks = np.array(draw(st.lists(st.integers(0, dp - 1), min_size=len(sizes),
                                   max_size=len(sizes))), dtype=np.int64)
    work = np.array(draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, 7.5]), min_size=len(sizes),
                                  max_size=len(sizes)))) + sizes * draw(st.sampled_from([0, 1]))
    order = np.lexsort((np.arange(len(sizes)), -sizes, ranks))
    return order, ranks[order], sizes, work.astype(np.float64), cap, dp, multiple


@given(balance_cases())
def test_straggler_balance_compiled_equals_pure(case):
    """Same LPT bins, trims, pool placement, ejections, splits and refining exchanges, with
    the oracle's tie rules (stable sorts, first minimum, left-to-right float sums)."""
    compiled = kernel_set("compiled").balance_step(*case)
    pure = PURE.balance_step(*case)
    assert (compiled is None) == (pure is None)
    if pure is not None:
        assert compiled[1] == pure[1] and _same(compiled[0], pure[0])


@st.composite
def schedule_cases(draw):
    """A batch, a layout (VPP groups too: an alignment multiple above dp), a policy, and FLOPs:
    the default (which follow the lengths) or tie-heavy ones that do not, so FLOPs packing
    takes both of its LPT orders (FFD's size order reused, or its own sort)."""
    n = draw(st.integers(1, 80))
    lengths = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    groups = draw(st.lists(st.integers(0, n // 2 + 1), min_size=n, max_size=n))
    dp = draw(st.integers(1, 4))
    group = draw(st.sampled_from([None, None, 2, 3]))
    layout = ParallelLayout(dp=dp, vpp=2 if group else 1, microbatch_group=group)
    packing = draw(st.sampled_from(PACKINGS))
    balance = draw(st.sampled_from(BALANCES))
    policy = BatchingPolicy(global_batch_size=draw(st.integers(1, 8)), max_tokens_per_gpu=300,
                            packing=packing, balance=balance, allow_partial_step=True)
    flops = draw(st.one_of(st.none(), st.lists(st.sampled_from([1.0, 2.0, 2.5, 40.0]),
                                               min_size=n, max_size=n)))
    return lengths, groups, layout, policy, flops


@given(schedule_cases())
def test_schedules_equal_with_either_kernel_set(case):
    """End to end: the kernel set changes the speed of build_schedule, never its result."""
    lengths, groups, layout, policy, flops = case
    with pytest.MonkeyPatch.context() as mp:
        out = []
        for name in ("pure", "compiled"):
            mp.setenv("VIME_KERNELS", name)
            try:
                out.append(build_schedule(lengths, groups, layout, policy, flops))
            except ValueError as exc:
                out.append(str(exc))
    assert out[0] == out[1]


def test_every_packing_has_a_packer():
    """A packing named in the config's choice list is one registry entry in the planner."""
    assert set(planner.PACKERS) == set(PACKINGS) | {"static"}


def test_to_flat_example():
    """The flat form of ``[[1, 2], [3]]``."""
    items, offsets = to_flat([[1, 2], [3]])
    assert items.tolist() == [1, 2, 3] and offsets.tolist() == [0, 2, 3]


def test_import_vime_pure_does_not_import_numba():
    """numba loads (and compiles) on the first schedule, never at ``import vime_pure``."""
    code = "import sys, vime_pure; assert 'numba' not in sys.modules, 'numba imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_policy_compiles_only_its_own_kernels(tmp_path):
    """Each policy's compiled loop holds only its own kernels (numba prunes the others'
    branches), so a first schedule compiles no straggler balancer (most of the first compile)
    unless it asks for one. Checked on a fresh numba cache (a cached loop would load without
    compiling anything) with static packing, the cheapest loop to compile (a few seconds)."""
    code = (
        "from vime_pure import BatchingPolicy, ParallelLayout, build_schedule\n"
        "from vime_pure.scheduling import compiled_balance as cb, compiled_kernels as ck\n"
        "policy = BatchingPolicy(global_batch_size=4, micro_batch_size=1)\n"
        "build_schedule([30, 70, 50, 20], [0, 1, 2, 3], ParallelLayout(dp=2), policy)\n"
        "print([len(f.signatures) for f in (cb._balance_step, ck._lpt_ranks, ck._flops_pack,"
        " ck._karmarkar_karp, ck._ffd_sorted, ck._split_to_count)])\n")
    env = {**os.environ, "VIME_KERNELS": "compiled", "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=env)
    assert out.stdout.strip() == "[0, 0, 0, 0, 0, 0]"


def test_each_step_loop_has_its_own_cache_file_under_the_import_hook():
    """The tests' jaxtyping hook wraps the closure ``plan``; numba caches the unwrapped one
    under its qualified name. Were that name shared, the loops of two policies compiled by two
    processes at once would share one cache index and one could load the other's machine code
    (CI: "NRT_adapt_ndarray_to_python: 'descr' is NULL" for first_fit)."""
    from vime_pure.scheduling.compiled_steps import BALANCE_CODES, PACKING_CODES, _loop

    pairs = {(p, k) for p in PACKING_CODES.values() for k, _ in BALANCE_CODES.values()}
    names = {_loop(p, k).py_func.__qualname__ for p, k in pairs}
    assert len(names) == len(pairs)


def test_a_compile_waits_for_another_processs_compile_and_names_the_lock(tmp_path,
                                                                          monkeypatch):
    """Every compile of a vime kernel holds one file lock across processes (numba's cache index
    is not safe for two processes compiling one function's signatures at once). While another
    process holds it, a compile waits, then fails with the file's name, not silently."""
    import numpy as np

    from vime_pure.scheduling import compiled_kernels as ck

    lock = tmp_path / "compile.lock"
    monkeypatch.setattr(ck, "COMPILE_LOCK", str(lock))
    monkeypatch.setattr(ck, "COMPILE_LOCK_WAIT_S", 0.3)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\n"
         f"f = open({str(lock)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True)"
         "\nsys.stdin.readline()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        add = ck._compiled(lambda a: a + 1)
        with pytest.raises(TimeoutError, match="compile.lock"):
            add(np.int64(1))
    finally:
        holder.communicate("\n", timeout=30)
    assert add(np.int64(1)) == 2  # released: the same compile now goes through
    with ck.compile_lock(), ck.compile_lock():  # re-entrant: a compile types its callees
        assert add(np.int64(2)) == 3
