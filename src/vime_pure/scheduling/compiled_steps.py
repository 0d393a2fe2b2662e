"""The planner's per-step loop in one numba call (``vime[fast]``), imported on demand.

``planner._build_steps`` runs, per step, pack -> align -> distribute -> gather, calling one
kernel at a time; at 64k samples in 256 steps the Python between the kernels costs more than
the kernels. ``plan_steps`` runs the same loop for every step inside numba, calling the
compiled kernels of ``compiled_kernels`` / ``compiled_balance`` directly, and returns the flat
arrays the ``Schedule`` stores. Its result equals the per-step loop on the pure kernels
(``tests/property/test_compiled_kernels.py``, end to end): same presort ties (size
descending, then position; straggler: rank first), same per-bin sums (left to right, as
``planner.bin_sums``), same fallbacks.

Packings and balances are passed as codes (``PACKING_CODES`` / ``BALANCE_CODES``); a packing
missing there runs the per-step loop instead, so a new packing needs no change here.
Example: ``plan_steps(kept, bounds, sizes, work, cap=1000, dp=2, multiple=2, packing="ffd",
balance="strided", micro_batch_size=0)`` returns ``(failed_step, failed_count, ids,
mb_sizes, per_rank)``; ``failed_step`` is -1 when every step was planned.
"""

import numpy as np

from vime_pure.scheduling.compiled_balance import _balance_step, _bin_lower_bound
from vime_pure.scheduling.compiled_kernels import (_compiled, _ffd_sorted, _first_fit,
                                                   _flops_pack, _karmarkar_karp, _lpt_ranks,
                                                   _split_to_count)

PACKING_CODES = {"static": 0, "first_fit": 1, "ffd": 2, "flops": 3}
BALANCE_CODES = {"strided": 0, "tokens": 1, "flops": 2, "straggler": 3}


@_compiled
def _ffd(step_sizes, cap):
    order = np.argsort(-step_sizes, kind="mergesort")
    return _ffd_sorted(order, step_sizes[order], cap)


@_compiled
def _pack(step_sizes, step_work, cap, multiple, packing, mbs):
    n = len(step_sizes)
    if packing == 0:
        offsets = np.empty(-(-n // mbs) + 1, dtype=np.int64)
        offsets[:-1] = np.arange(0, n, mbs)
        offsets[-1] = n
        return np.arange(n), offsets
    if packing == 1:
        return _first_fit(step_sizes, cap)
    items, offsets = _ffd(step_sizes, cap)
    if packing == 3:  # planner._pack_flops: LPT into FFD's aligned count, unless that costs more
        aligned = -(-(len(offsets) - 1) // multiple) * multiple
        order = np.argsort(-step_work, kind="mergesort")
        f_items, f_offsets = _flops_pack(order, step_sizes, step_work, cap, min(aligned, n))
        if -(-(len(f_offsets) - 1) // multiple) * multiple <= aligned:
            return f_items, f_offsets
    return items, offsets


@_compiled
def _straggler_order(step_sizes, step_work, dp):
    """``planner._presort`` for one step: LPT ranks, then positions by (rank, size descending,
    position), and the rank of each of those positions."""
    ranks = _lpt_ranks(step_work, np.array([0, len(step_sizes)], dtype=np.int64), dp)
    order = np.argsort(-step_sizes, kind="mergesort")
    order = order[np.argsort(ranks[order], kind="mergesort")]
    return order, ranks[order]


@_compiled
def _bin_sums(items, offsets, per_item):
    sums = np.zeros(len(offsets) - 1, dtype=np.float64)
    for b in range(len(offsets) - 1):
        for k in range(offsets[b], offsets[b + 1]):
            sums[b] += per_item[items[k]]
    return sums


@_compiled
def _plan_steps(kept, bounds, sizes, work, cap, dp, multiple, packing, balance, mbs):
    steps = len(bounds) - 1
    ids = np.empty(bounds[-1], dtype=np.int64)
    mb_sizes = np.empty(bounds[-1], dtype=np.int64)
    per_rank = np.empty(steps, dtype=np.int64)
    dynamic = packing != 0
    pos, nmb = 0, 0
    for s in range(steps):
        samples = kept[bounds[s]:bounds[s + 1]]
        step_sizes, step_work = sizes[samples], work[samples]
        n = len(samples)
        done = False
        if dynamic and balance == 3:
            order, ranks = _straggler_order(step_sizes, step_work, dp)
            cuts = np.searchsorted(ranks, np.arange(dp + 1))
            lb = _bin_lower_bound(step_sizes, cap)
            m = max(-(-lb // dp), 1)
            m = -(-m // (multiple // dp)) * (multiple // dp)
            ok, items, offsets, m = _balance_step(order, cuts, step_sizes, step_work, cap, m,
                                                  multiple // dp)
            if ok:
                parts = np.arange(dp * m).reshape(dp, m)
                done = True
        if not done:
            items, offsets = _pack(step_sizes, step_work, cap, multiple, packing, mbs)
            count = len(offsets) - 1
            if count % multiple:
                target = -(-count // multiple) * multiple
                if not dynamic or n < target:
                    return s, count, ids[:pos], mb_sizes[:nmb], per_rank[:s]
                items, offsets = _split_to_count(items, offsets, step_sizes, target)
                count = target
            if balance == 0:
                parts = np.arange(count).reshape(-1, dp).T.copy()
            else:
                per_item = step_sizes.astype(np.float64) if balance == 1 else step_work
                weights = _bin_sums(items, offsets, per_item)
                parts = _karmarkar_karp(weights, np.argsort(-weights, kind="mergesort"), dp)
        per_rank[s] = parts.shape[1]
        for r in range(dp):
            for j in range(parts.shape[1]):
                b = parts[r, j]
                for k in range(offsets[b], offsets[b + 1]):
                    ids[pos] = samples[items[k]]
                    pos += 1
                mb_sizes[nmb] = offsets[b + 1] - offsets[b]
                nmb += 1
    return -1, 0, ids[:pos], mb_sizes[:nmb], per_rank


def plan_steps(kept: np.ndarray, bounds: np.ndarray, sizes: np.ndarray, work: np.ndarray, *,
               cap: int, dp: int, multiple: int, packing: str, balance: str,
               micro_batch_size: int):
    """Every step planned in one call; see the module docstring. ``multiple`` is the layout's
    ``align_multiple``; ``cap`` is unused (0) under static packing."""
    return _plan_steps(np.asarray(kept, dtype=np.int64), np.asarray(bounds, dtype=np.int64),
                       np.asarray(sizes, dtype=np.int64), np.asarray(work, dtype=np.float64),
                       np.int64(cap), np.int64(dp), np.int64(multiple),
                       np.int64(PACKING_CODES[packing]), np.int64(BALANCE_CODES[balance]),
                       np.int64(micro_batch_size))
