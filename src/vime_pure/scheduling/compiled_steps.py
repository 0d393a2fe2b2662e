"""The planner's per-step loop in one numba call (``vime[fast]``), imported on demand.

``planner._build_steps`` runs, per step, pack -> align -> distribute -> gather, calling one
kernel at a time; at 64k samples in 256 steps the Python between the kernels costs more than
the kernels. ``plan_steps`` runs the same loop for every step inside numba, calling the
compiled kernels of ``compiled_kernels`` / ``compiled_balance`` directly, and returns the flat
arrays the ``Schedule`` stores. Its result equals the per-step loop on the pure kernels
(``tests/property/test_compiled_kernels.py``, end to end): same presort ties (size
descending, then position; straggler: rank first), same per-bin sums (left to right, as
``planner.bin_sums``), same fallbacks.

One loop per packing and kind of balance (``_loop``): both are compile-time constants of the
loop, so numba prunes the other branches and a schedule compiles only the kernels its policy
uses. On a fresh numba cache that is what the first schedule pays: the straggler balancer
alone is most of the compile time, and one loop with a runtime switch over every policy made
``ffd/strided`` pay it too. ``"tokens"`` and ``"flops"`` share one loop (Karmarkar-Karp on
token or FLOPs sums, a runtime flag): one compile fewer where both run (the tests).
Packings and balances are named by their codes (``PACKING_CODES`` / ``BALANCE_CODES``); a
policy missing there runs the planner's per-step loop instead, so a new packing needs no
change here.
Example: ``plan_steps(kept, bounds, sizes, work, cap=1000, dp=2, multiple=2, packing="ffd",
balance="strided", micro_batch_size=0)`` returns ``(failed_step, failed_count, ids,
mb_sizes, per_rank)``; ``failed_step`` is -1 when every step was planned.
"""

import functools

import numpy as np

from vime_pure.scheduling.compiled_balance import _balance_step, _bin_lower_bound
from vime_pure.scheduling.compiled_kernels import (_compiled, _ffd_sorted, _first_fit,
                                                   _flops_pack, _group_by, _karmarkar_karp,
                                                   _lpt_ranks, _sorted_by, _split_to_count,
                                                   argsort_desc)

PACKING_CODES = {"static": 0, "first_fit": 1, "ffd": 2, "flops": 3}
# balance -> (kind: 0 strided, 1 Karmarkar-Karp, 2 straggler; KK on tokens rather than FLOPs)
BALANCE_CODES = {"strided": (0, False), "tokens": (1, True), "flops": (1, False),
                 "straggler": (2, False)}


@_compiled
def _static(n, mbs):
    offsets = np.empty(-(-n // mbs) + 1, dtype=np.int64)
    offsets[:-1] = np.arange(0, n, mbs)
    offsets[-1] = n
    return np.arange(n), offsets


@_compiled
def _ffd(step_sizes, cap):
    order = argsort_desc(step_sizes)
    return _ffd_sorted(order, step_sizes[order], cap)


@_compiled
def _flops_or_ffd(step_sizes, step_work, cap, multiple):
    """``planner._pack_flops``: LPT on FLOPs into FFD's aligned count, unless that needs more
    micro-batches (more than the aligned count: it is a multiple), then FFD's bins. The LPT
    order is FFD's size order when the FLOPs follow the sizes (checked, ``_sorted_by``)."""
    n = len(step_sizes)
    order = argsort_desc(step_sizes)
    items, offsets = _ffd_sorted(order, step_sizes[order], cap)
    aligned = -(-(len(offsets) - 1) // multiple) * multiple
    if not _sorted_by(step_work, order):
        order = np.argsort(-step_work, kind="mergesort")
    f_items, f_offsets = _flops_pack(order, step_sizes, step_work, cap, min(aligned, n), aligned)
    if len(f_offsets) - 1 <= aligned:
        return f_items, f_offsets
    return items, offsets


@_compiled
def _straggler_order(step_sizes, step_work, dp):
    """``planner._presort`` for one step: LPT ranks, then positions by (rank, size descending,
    position), and where each rank's positions start (``dp + 1`` cuts)."""
    ranks = _lpt_ranks(step_work, np.array([0, len(step_sizes)], dtype=np.int64), dp)
    order = argsort_desc(step_sizes)
    by_rank, cuts = _group_by(ranks[order], dp)  # stable by rank: a counting sort
    return order[by_rank], cuts


@_compiled
def _bin_sums(items, offsets, per_item):
    sums = np.zeros(len(offsets) - 1, dtype=np.float64)
    for b in range(len(offsets) - 1):
        for k in range(offsets[b], offsets[b + 1]):
            sums[b] += per_item[items[k]]
    return sums


@_compiled
def _gather(parts, items, offsets, samples, ids, mb_sizes, pos, nmb):
    """Write the step's bins rank by rank as global sample ids; the new write positions."""
    for r in range(parts.shape[0]):
        for j in range(parts.shape[1]):
            b = parts[r, j]
            for k in range(offsets[b], offsets[b + 1]):
                ids[pos] = samples[items[k]]
                pos += 1
            mb_sizes[nmb] = offsets[b + 1] - offsets[b]
            nmb += 1
    return pos, nmb


@functools.cache
def _loop(packing: int, kind: int):
    """The step loop for one packing code and balance kind. Every test of ``packing`` and
    ``kind`` below compares a closure constant with a literal, so numba prunes the branches of
    the other policies and never compiles their kernels. Each pair is its own function (own
    name, own numba cache file, also under the tests' import hook, which wraps ``plan``).
    Under static packing the straggler kind falls back to Karmarkar-Karp on FLOPs, as
    ``planner._step_bins`` does."""

    def plan(kept, bounds, sizes, work, cap, dp, multiple, mbs, by_tokens):
        steps = len(bounds) - 1
        ids = np.empty(bounds[-1], dtype=np.int64)
        mb_sizes = np.empty(bounds[-1], dtype=np.int64)
        per_rank = np.empty(steps, dtype=np.int64)
        pos, nmb = np.int64(0), np.int64(0)  # not literals: one _gather signature
        for s in range(steps):
            samples = kept[bounds[s]:bounds[s + 1]]
            step_sizes, step_work = sizes[samples], work[samples]
            n = len(samples)
            done = False
            if packing != 0 and kind == 2:
                order, cuts = _straggler_order(step_sizes, step_work, dp)
                lb = _bin_lower_bound(step_sizes, cap)
                m = max(-(-lb // dp), 1)
                m = -(-m // (multiple // dp)) * (multiple // dp)
                ok, items, offsets, m = _balance_step(order, cuts, step_sizes, step_work, cap, m,
                                                      multiple // dp)
                if ok:
                    parts = np.arange(dp * m).reshape(dp, m)
                    done = True
            if not done:
                if packing == 0:
                    items, offsets = _static(n, mbs)
                elif packing == 1:
                    items, offsets = _first_fit(step_sizes, cap)
                elif packing == 2:
                    items, offsets = _ffd(step_sizes, cap)
                else:
                    items, offsets = _flops_or_ffd(step_sizes, step_work, cap, multiple)
                count = len(offsets) - 1
                if count % multiple:
                    target = -(-count // multiple) * multiple
                    if packing == 0 or n < target:
                        return s, count, ids[:pos], mb_sizes[:nmb], per_rank[:s]
                    items, offsets = _split_to_count(items, offsets, step_sizes, target)
                    count = target
                if kind == 0:
                    parts = np.arange(count).reshape(-1, dp).T.copy()
                else:
                    per_item = step_sizes.astype(np.float64) if by_tokens else step_work
                    weights = _bin_sums(items, offsets, per_item)
                    parts = _karmarkar_karp(weights, np.argsort(-weights, kind="mergesort"), dp)
            per_rank[s] = parts.shape[1]
            pos, nmb = _gather(parts, items, offsets, samples, ids, mb_sizes, pos, nmb)
        return -1, 0, ids[:pos], mb_sizes[:nmb], per_rank

    return _compiled(plan, name=f"_plan_{packing}_{kind}")


def plan_steps(kept: np.ndarray, bounds: np.ndarray, sizes: np.ndarray, work: np.ndarray, *,
               cap: int, dp: int, multiple: int, packing: str, balance: str,
               micro_batch_size: int):
    """Every step planned in one call; see the module docstring. ``multiple`` is the layout's
    ``align_multiple``; ``cap`` is unused (0) under static packing. None for a packing or
    balance without a code: the planner then runs its per-step loop."""
    if packing not in PACKING_CODES or balance not in BALANCE_CODES:
        return None
    kind, by_tokens = BALANCE_CODES[balance]
    loop = _loop(PACKING_CODES[packing], kind)
    return loop(np.asarray(kept, dtype=np.int64), np.asarray(bounds, dtype=np.int64),
                np.asarray(sizes, dtype=np.int64), np.asarray(work, dtype=np.float64),
                np.int64(cap), np.int64(dp), np.int64(multiple), np.int64(micro_batch_size),
                by_tokens)
