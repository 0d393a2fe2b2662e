"""The scheduling pipeline behind ``build_schedule``: steps, packing, alignment, distribution.

See ``vime_pure.scheduling.schedule`` for the contract and invariants; this module only computes.
Work that spans the whole batch is done once with numpy (grouping, step slicing, the per-step
size sort, index assembly). With the compiled kernels (``vime[fast]``) every step is planned in
one numba call (``compiled_steps.plan_steps``); with the pure ones the sequential kernels run
step by step in Python, and both give the same schedule.

Policy details: ``packing="flops"`` packs by LPT on FLOPs straight into FFD's aligned count and
keeps FFD's bins when LPT would need more micro-batches, so it never costs micro-batches.
``balance="straggler"`` (``vime_pure.scheduling.rank_balance``) distributes samples before packing; it falls
back to packing + FLOPs balancing under static packing or when a step is too small for it.
"""

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from vime_pure.config import BatchingPolicy, ParallelLayout, check_feasible
from vime_pure.config import alignment_terms, static_misalignment_message
from vime_pure.errors import ScheduleError, ScheduleInvariantError
from vime_pure.scheduling.flops import proxy_flops
from vime_pure.grouping import Grouping, group_samples
from vime_pure.scheduling.registry import Flat, KernelSet, kernel_set
from vime_pure.scheduling.schedule import Schedule
from vime_pure.scheduling.inputs import as_flops, as_lengths, check_same_length


def build_schedule(lengths: Any, group_ids: Any, layout: Any, policy: Any,
                   flops: Any = None) -> Schedule:
    """Plan the steps of one rollout batch. See the module docstring for the algorithm.

    ``lengths[i]``: total tokens of sample ``i`` (prompt + response), an integer in
    ``[1, 2**40]``; ``group_ids[i]``: its rollout group, an ``int`` or ``str`` (numpy ones
    too). Bools and floats are rejected: ``True == 1 == 1.0`` would merge distinct groups.
    ``None`` means the sample is its own group, as in ``RolloutBatch.from_samples``
    (a dropped one is reported as ``None`` in ``dropped_groups``). ``flops[i]``: optional
    workload estimate used by ``packing="flops"`` / ``balance="flops"`` (default:
    ``vime_pure.scheduling.flops.proxy_flops``).
    Arguments are typed loosely on purpose: this is the user boundary, and every value is
    validated here with a ``ScheduleError`` that names the field, instead of a type-check error.
    Raises ``ScheduleError`` for bad input or an infeasible configuration.
    Example: ``build_schedule([5, 7, 3], ["a", None, None], ParallelLayout(dp=1),
    BatchingPolicy(global_batch_size=3, max_tokens_per_gpu=8))`` has one step of 3 groups.
    """
    sizes = as_lengths(lengths)
    grouping = group_samples(group_ids)
    check_same_length(sizes, grouping.dense)
    return plan_grouped(sizes, grouping, layout, policy, flops)


def plan_grouped(lengths: Sequence[Any] | np.ndarray, grouping: Grouping, layout: Any,
                 policy: Any, flops: Any = None) -> Schedule:
    """``build_schedule`` for samples already grouped (``schedule_for`` passes a batch's
    dense ids, so they are not numbered twice)."""
    check_feasible(layout, policy)  # checks their types first
    sizes = as_lengths(lengths)
    check_same_length(sizes, grouping.dense)
    work = proxy_flops(sizes) if flops is None else as_flops(flops, len(sizes))
    gbs, num_groups = policy.global_batch_size, grouping.num_groups
    full = num_groups // gbs
    step_groups = [(k * gbs, (k + 1) * gbs) for k in range(full)]
    if policy.allow_partial_step and full * gbs < num_groups:
        step_groups.append((full * gbs, num_groups))  # tried; dropped and reported if infeasible
    planned, partial_error = _build_steps(step_groups, full, grouping, sizes, work, layout,
                                          policy)
    if not planned.num_steps:
        raise _too_few_groups(num_groups, gbs, partial_error)

    kept_groups = step_groups[planned.num_steps - 1][1]
    dropped = np.sort(grouping.order[grouping.offsets[kept_groups]:]).astype(np.int64)
    offsets = np.zeros(len(planned.mb_sizes) + 1, dtype=np.int64)
    np.cumsum(planned.mb_sizes, out=offsets[1:])
    step_groups_array = np.diff(np.asarray([g for g, _ in step_groups] + [step_groups[-1][1]],
                                           dtype=np.int64))[:planned.num_steps]
    return Schedule(
        layout=layout, policy=policy, lengths_array=sizes.astype(np.int64, copy=True),
        group_array=np.asarray(grouping.dense, dtype=np.int64).copy(),
        sample_ids=planned.ids, mb_offsets=offsets, step_microbatches=planned.per_rank,
        step_groups=step_groups_array, dropped_groups=grouping.ids[kept_groups:],
        dropped_array=dropped,
    )


@attrs.frozen
class _StepArrays:
    """One planned step as flat arrays: sample ids in (rank, micro-batch) order, the
    micro-batch sizes in the same order, the per-rank count."""

    ids: np.ndarray
    mb_sizes: np.ndarray
    per_rank: int


@attrs.frozen
class _Planned:
    """The planned steps, concatenated: sample ids, micro-batch sizes, per-rank counts."""

    ids: np.ndarray
    mb_sizes: np.ndarray
    per_rank: np.ndarray

    @property
    def num_steps(self) -> int:
        return len(self.per_rank)

    @classmethod
    def of(cls, steps: list[_StepArrays]) -> "_Planned":
        empty = np.zeros(0, dtype=np.int64)
        return cls(ids=np.concatenate([s.ids for s in steps] or [empty]),
                   mb_sizes=np.concatenate([s.mb_sizes for s in steps] or [empty]),
                   per_rank=np.asarray([s.per_rank for s in steps], dtype=np.int64))


def _build_steps(step_groups: list[tuple[int, int]], full: int, grouping: Grouping,
                 sizes: np.ndarray, work: np.ndarray, layout: ParallelLayout,
                 policy: BatchingPolicy) -> tuple[_Planned, ScheduleError | None]:
    """Plan every step; a failing partial step (index ``full``) is left out, with its error.
    With the compiled kernels, every step in one call (``compiled_steps``); else step by step."""
    if not step_groups:
        return _Planned.of([]), None
    bounds = grouping.offsets[[g for g, _ in step_groups] + [step_groups[-1][1]]]
    kept = grouping.order[: bounds[-1]]  # samples of the steps, group-major, step by step
    ks = kernel_set(num_samples=sizes.size)
    packing = policy.packing if policy.dynamic else "static"
    fused = ks.plan_steps(kept, bounds, sizes, work, cap=policy.token_cap(layout) or 0,
                          dp=layout.dp, multiple=layout.align_multiple, packing=packing,
                          balance=policy.balance,
                          micro_batch_size=policy.micro_batch_size or 0) if ks.plan_steps else None
    if fused is not None:
        failed, count, ids, mb_sizes, per_rank = fused
        planned = _Planned(ids=ids, mb_sizes=mb_sizes, per_rank=per_rank)
        if failed < 0:
            return planned, None
        exc = _misaligned(int(failed), int(count), int(bounds[failed + 1] - bounds[failed]),
                          layout, policy)
        if failed < full:
            raise exc
        return planned, exc  # an infeasible partial step is dropped and reported
    step_of = np.repeat(np.arange(len(step_groups)), np.diff(bounds))
    presorted = _presort(ks, kept, sizes, work, step_of, bounds, layout, policy)
    steps: list[_StepArrays] = []
    for s in range(len(step_groups)):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        samples = kept[lo:hi]
        try:
            parts, bins = _step_bins(samples, sizes, work, layout, policy, s,
                                     _slice(presorted, lo, hi), ks)
        except ScheduleError as exc:
            if s < full:
                raise
            return _Planned.of(steps), exc  # an infeasible partial step is dropped and reported
        steps.append(_step_plan(parts, bins, samples))
    return _Planned.of(steps), None


def _too_few_groups(num_groups: int, gbs: int, partial_error: ScheduleError | None) -> ScheduleError:
    # The partial step's own problem, without its "Fix:": the one fix list follows below.
    reason = str(partial_error).split(" Fix: ")[0].rstrip(".") if partial_error else ""
    partial = f" allow_partial_step=True could not help: {reason}." if reason else ""
    return ScheduleError(
        f"only {num_groups} groups arrived but one step needs global_batch_size={gbs} "
        f"groups.{partial} Fix: lower global_batch_size to at most {num_groups}, generate "
        "more rollouts per batch, or set allow_partial_step=True."
    )


def _presort(ks: KernelSet, kept: np.ndarray, sizes: np.ndarray, work: np.ndarray,
             step_of: np.ndarray, bounds: np.ndarray, layout: ParallelLayout,
             policy: BatchingPolicy):
    """One sort for all steps: per step the positions by decreasing size (ties by position)
    for FFD and FLOPs packing, or, for ``balance="straggler"``, by rank then decreasing size."""
    if not policy.dynamic or policy.packing == "first_fit" and policy.balance != "straggler":
        return None
    if policy.balance == "straggler":
        ranks = ks.lpt_ranks(work[kept], bounds, layout.dp)
        return _sort_by_bucket_then_size(step_of * layout.dp + ranks, sizes[kept]), ranks
    return _sort_by_bucket_then_size(step_of, sizes[kept])


def _sort_by_bucket_then_size(bucket: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Positions by (bucket ascending, size descending, position): one stable sort of a single
    int64 key ``bucket * (max + 1) + (max - size)`` when it fits in 63 bits (always, for
    lengths up to 2**40 and fewer than 2**22 buckets), else a three-key lexsort.
    Example: buckets [0, 0, 1], sizes [5, 9, 7] give [1, 0, 2]."""
    top = int(size.max(initial=0))
    if int(bucket.max(initial=0)) < (2**63 - 1) // (top + 1) - 1:
        return np.argsort(bucket * (top + 1) + (top - size), kind="stable")
    return np.lexsort((np.arange(len(size)), -size, bucket))


def _slice(presorted, lo: int, hi: int):
    """The step's share of ``_presort``'s output, as positions into the step."""
    if presorted is None:
        return None
    if isinstance(presorted, tuple):
        order, ranks = presorted
        return order[lo:hi] - lo, ranks[lo:hi]
    return presorted[lo:hi] - lo


def _step_bins(samples: np.ndarray, sizes: np.ndarray, work: np.ndarray, layout: ParallelLayout,
               policy: BatchingPolicy, step: int, presorted, ks: KernelSet
               ) -> tuple[np.ndarray, Flat]:
    """Each rank's bin numbers (``[dp, per_rank]``) and the step's bins of positions into
    ``samples``, in flat form."""
    step_sizes = sizes[samples]
    if policy.dynamic and policy.balance == "straggler":
        order, ranks = presorted
        cap = policy.token_cap(layout)
        if cap is None:  # a dynamic policy always has one (BatchingPolicy checks it)
            raise ScheduleInvariantError("a dynamic policy without max_tokens_per_gpu")
        result = ks.balance_step(order, ranks[order], step_sizes, work[samples], cap,
                                 layout.dp, layout.microbatch_multiple)
        if result is not None:
            flat, m = result
            return np.arange(layout.dp * m, dtype=np.int64).reshape(layout.dp, m), flat
        presorted = None  # fall back to packing, alignment and FLOPs balancing below
    flat = PACKERS[policy.packing if policy.dynamic else "static"](
        _PackInput(step_sizes, work[samples], layout, policy, presorted, ks))
    flat = _align(flat, step_sizes, layout, policy, step, ks)
    return _distribute(flat, step_sizes, work[samples], layout, policy, ks), flat


@attrs.frozen
class _PackInput:
    """What a packer sees of one step: sizes and work per position, the layout and policy,
    the FFD presort (positions by decreasing size) when one was computed, the kernel set."""

    sizes: np.ndarray
    work: np.ndarray
    layout: ParallelLayout
    policy: BatchingPolicy
    presorted: np.ndarray | None
    ks: KernelSet

    @property
    def cap(self) -> int:
        cap = self.policy.token_cap(self.layout)
        assert cap is not None  # dynamic packers only; the policy guarantees a cap
        return cap


def _pack_static(p: _PackInput) -> Flat:
    n, mbs = len(p.sizes), p.policy.micro_batch_size
    return np.arange(n, dtype=np.int64), np.append(np.arange(0, n, mbs, dtype=np.int64), n)


def _pack_first_fit(p: _PackInput) -> Flat:
    return p.ks.first_fit(p.sizes, p.cap)


def _pack_ffd(p: _PackInput) -> Flat:
    if p.presorted is None:
        return p.ks.ffd(p.sizes, p.cap)
    return p.ks.ffd_sorted(p.presorted, p.sizes[p.presorted], p.cap)


def _pack_flops(p: _PackInput) -> Flat:
    # FLOPs packing straight into FFD's aligned count (no token-driven splits afterwards); it
    # never costs micro-batches: when LPT's weaker packing would need more, FFD's bins are kept.
    ffd = _pack_ffd(p)
    multiple, n = p.layout.align_multiple, len(p.sizes)
    aligned = -(-(len(ffd[1]) - 1) // multiple) * multiple
    packed = p.ks.flops_pack(p.sizes, p.work, p.cap, min(aligned, n))
    return packed if -(-(len(packed[1]) - 1) // multiple) * multiple <= aligned else ffd


# Packing name -> packer; "static" is fixed-size chunks (``micro_batch_size``). A new packing
# is one function here plus its name in ``vime_pure.config.PACKINGS``; the tests iterate this.
PACKERS: dict[str, Callable[[_PackInput], Flat]] = {
    "static": _pack_static, "first_fit": _pack_first_fit, "ffd": _pack_ffd,
    "flops": _pack_flops,
}


def _align(flat: Flat, step_sizes: np.ndarray, layout: ParallelLayout,
           policy: BatchingPolicy, step: int, ks: KernelSet) -> Flat:
    multiple, count = layout.align_multiple, len(flat[1]) - 1
    if count % multiple == 0:
        return flat
    aligned = None
    if policy.dynamic:
        aligned = ks.split_to_count(flat, step_sizes, -(-count // multiple) * multiple)
    if aligned is None:
        raise _misaligned(step, count, len(step_sizes), layout, policy)
    return aligned


def _misaligned(step: int, count: int, num_samples: int, layout: ParallelLayout,
                policy: BatchingPolicy) -> ScheduleError:
    """Why ``step``'s ``count`` micro-batches cannot be aligned (static, or too few samples)."""
    if not policy.dynamic:
        return ScheduleError(f"step {step}: " + static_misalignment_message(count, policy, layout))
    multiple = layout.align_multiple
    target = -(-count // multiple) * multiple
    return ScheduleError(
        f"step {step}: its {num_samples} samples pack into {count} micro-batches "
        f"under the cap {policy.token_cap(layout)}; a multiple of {multiple} "
        f"({alignment_terms(layout)}) needs {target}, but splitting can make at most "
        f"{num_samples} (one per sample). Fix: raise global_batch_size (more samples per "
        "step), raise max_tokens_per_gpu so samples share micro-batches, or use fewer "
        f"{alignment_terms(layout, fewer=True)}."
    )


def bin_sums(flat: Flat, per_item: np.ndarray) -> np.ndarray:
    """Sum of ``per_item`` over every (non-empty) bin, each left to right from 0.0 (a
    weighted ``bincount``), the order ``compiled_steps`` sums in: a pairwise sum would round
    differently and could tip a tie. Example: bins [[0, 1], [2]] of [1.5, 2.0, 4.0] give
    [3.5, 4.0]."""
    items, offsets = flat
    bins = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    return np.bincount(bins, weights=per_item[items], minlength=len(offsets) - 1)


def _distribute(flat: Flat, step_sizes: np.ndarray, step_work: np.ndarray,
                layout: ParallelLayout, policy: BatchingPolicy, ks: KernelSet) -> np.ndarray:
    """Bin numbers per rank, ``[dp, count / dp]``."""
    count, dp = len(flat[1]) - 1, layout.dp
    if policy.balance == "strided":
        return np.arange(count, dtype=np.int64).reshape(-1, dp).T
    per_item = step_sizes.astype(np.float64) if policy.balance == "tokens" else step_work
    return ks.karmarkar_karp(bin_sums(flat, per_item), dp)


def _step_plan(parts: np.ndarray, flat: Flat, samples: np.ndarray) -> _StepArrays:
    """Gather the bins rank by rank and translate positions to global sample ids, in one go."""
    items, offsets = flat
    order = parts.reshape(-1)
    lens = offsets[order + 1] - offsets[order]
    out_starts = np.cumsum(lens) - lens
    gather = np.repeat(offsets[order] - out_starts, lens) + np.arange(int(lens.sum()))
    return _StepArrays(ids=samples[items[gather]].astype(np.int64, copy=False), mb_sizes=lens,
                       per_rank=parts.shape[1])
