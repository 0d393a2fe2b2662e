"""The scheduling pipeline behind ``build_schedule``: steps, packing, alignment, distribution.

See ``vime_pure.scheduling.schedule`` for the contract and invariants; this module only computes.
Work that spans the whole batch is done once with numpy (grouping, step slicing, the per-step
size sort, index assembly); only the inherently sequential kernels run per step in Python.

Policy details: ``packing="flops"`` packs by LPT on FLOPs straight into FFD's aligned count and
keeps FFD's bins when LPT would need more micro-batches, so it never costs micro-batches.
``balance="straggler"`` (``vime_pure.scheduling.rank_balance``) distributes samples before packing; it falls
back to packing + FLOPs balancing under static packing or when a step is too small for it.
"""

from collections.abc import Sequence
from itertools import accumulate, chain
from typing import Any

import numpy as np

from vime_pure.scheduling import kernels
from vime_pure.config import BatchingPolicy, ParallelLayout, check_feasible
from vime_pure.config import static_misalignment_message
from vime_pure.errors import ScheduleError, ScheduleInvariantError
from vime_pure.scheduling.flops import proxy_flops
from vime_pure.grouping import Grouping, group_samples
from vime_pure.scheduling.rank_balance import balance_step, lpt_ranks
from vime_pure.scheduling.schedule import Schedule, StepPlan
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
    steps, partial_error = _build_steps(step_groups, full, grouping, sizes, work, layout, policy)
    if not steps:
        raise _too_few_groups(num_groups, gbs, partial_error)

    kept_groups = step_groups[len(steps) - 1][1]
    dropped_samples = np.sort(grouping.order[grouping.offsets[kept_groups]:]).tolist()
    partitions, local = _assemble(steps, layout.dp)
    return Schedule(
        layout=layout, policy=policy, lengths=tuple(sizes.tolist()),
        sample_group=tuple(grouping.dense.tolist()), steps=tuple(steps),
        partitions=partitions, micro_batch_indices=local,
        dropped_groups=grouping.ids[kept_groups:],
        dropped_samples=tuple(dropped_samples),
    )


def _build_steps(step_groups: list[tuple[int, int]], full: int, grouping: Grouping,
                 sizes: np.ndarray, work: np.ndarray, layout: ParallelLayout,
                 policy: BatchingPolicy) -> tuple[list[StepPlan], ScheduleError | None]:
    """Plan every step; a failing partial step (index ``full``) is left out, with its error."""
    if not step_groups:
        return [], None
    bounds = grouping.offsets[[g for g, _ in step_groups] + [step_groups[-1][1]]]
    kept = grouping.order[: bounds[-1]]  # samples of the steps, group-major, step by step
    step_of = np.repeat(np.arange(len(step_groups)), np.diff(bounds))
    presorted = _presort(kept, sizes, work, step_of, bounds, layout, policy)
    steps: list[StepPlan] = []
    for s, (g0, g1) in enumerate(step_groups):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        samples = kept[lo:hi]
        try:
            parts, bins = _step_bins(samples, sizes, work, layout, policy, s,
                                     _slice(presorted, lo, hi))
        except ScheduleError as exc:
            if s < full:
                raise
            return steps, exc  # an infeasible partial step is dropped and reported
        steps.append(_step_plan(parts, bins, samples, g1 - g0))
    return steps, None


def _too_few_groups(num_groups: int, gbs: int, partial_error: ScheduleError | None) -> ScheduleError:
    # The partial step's own problem, without its "Fix:": the one fix list follows below.
    reason = str(partial_error).split(" Fix: ")[0].rstrip(".") if partial_error else ""
    partial = f" allow_partial_step=True could not help: {reason}." if reason else ""
    return ScheduleError(
        f"only {num_groups} groups arrived but one step needs global_batch_size={gbs} "
        f"groups.{partial} Fix: lower global_batch_size to at most {num_groups}, generate "
        "more rollouts per batch, or set allow_partial_step=True."
    )


def _presort(kept: np.ndarray, sizes: np.ndarray, work: np.ndarray, step_of: np.ndarray,
             bounds: np.ndarray, layout: ParallelLayout, policy: BatchingPolicy):
    """One lexsort for all steps: per step the positions by decreasing size (ties by position)
    for FFD, or, for ``balance="straggler"``, by rank then decreasing size."""
    if not policy.dynamic or policy.packing != "ffd" and policy.balance != "straggler":
        return None
    position = np.arange(len(kept))
    if policy.balance == "straggler":
        ranks = lpt_ranks(work[kept], step_of, bounds, layout.dp)
        return np.lexsort((position, -sizes[kept], ranks, step_of)), ranks
    return np.lexsort((position, -sizes[kept], step_of))


def _slice(presorted, lo: int, hi: int):
    """The step's share of ``_presort``'s output, as positions into the step."""
    if presorted is None:
        return None
    if isinstance(presorted, tuple):
        order, ranks = presorted
        return order[lo:hi] - lo, ranks[lo:hi]
    return presorted[lo:hi] - lo


def _step_bins(samples: np.ndarray, sizes: np.ndarray, work: np.ndarray, layout: ParallelLayout,
               policy: BatchingPolicy, step: int, presorted) -> tuple[list[list[int]], kernels.Bins]:
    """Micro-batches of one step (positions into ``samples``) and each rank's bin numbers."""
    step_sizes = sizes[samples]
    if policy.dynamic and policy.balance == "straggler":
        order, ranks = presorted
        result = balance_step(order.tolist(), ranks[order].tolist(), step_sizes, work[samples],
                              _cap(policy, layout), layout.dp, layout.microbatch_multiple)
        if result is not None:
            return result
        presorted = None  # fall back to packing, alignment and FLOPs balancing below
    bins = _pack(samples, step_sizes, work, layout, policy, presorted)
    bins = _align(bins, step_sizes, layout, policy, step)
    return _distribute(bins, samples, step_sizes, work, layout, policy), bins


def _cap(policy: BatchingPolicy, layout: ParallelLayout) -> int:
    """The token cap of a dynamic policy (never None there: BatchingPolicy checks it)."""
    cap = policy.token_cap(layout)
    if cap is None:
        raise ScheduleInvariantError("a dynamic policy without max_tokens_per_gpu")
    return cap


def _pack(samples: np.ndarray, step_sizes: np.ndarray, work: np.ndarray, layout: ParallelLayout,
          policy: BatchingPolicy, presorted: np.ndarray | None) -> kernels.Bins:
    """Bins of positions into ``samples``."""
    n = len(samples)
    if not policy.dynamic:
        mbs = policy.micro_batch_size
        if mbs is None:  # BatchingPolicy sets one of the two
            raise ScheduleInvariantError("a static policy without micro_batch_size")
        return [list(range(i, min(i + mbs, n))) for i in range(0, n, mbs)]
    cap = _cap(policy, layout)
    if policy.packing == "first_fit":
        return kernels.first_fit(step_sizes, cap)
    if presorted is None:
        ffd = kernels.first_fit_decreasing(step_sizes, cap)
    else:
        ffd = kernels.ffd_sorted(presorted.tolist(), step_sizes[presorted].tolist(), cap)
    if policy.packing == "ffd":
        return ffd
    # FLOPs packing straight into FFD's aligned count (no token-driven splits afterwards); it
    # never costs micro-batches: when LPT's weaker packing would need more, FFD's bins are kept.
    multiple = layout.align_multiple
    aligned = -(-len(ffd) // multiple) * multiple
    packed = kernels.flops_balanced_pack(step_sizes, work[samples], cap, min(aligned, n))
    return packed if -(-len(packed) // multiple) * multiple <= aligned else ffd


def _align(bins: kernels.Bins, step_sizes: np.ndarray, layout: ParallelLayout,
           policy: BatchingPolicy, step: int) -> kernels.Bins:
    multiple = layout.align_multiple
    if len(bins) % multiple == 0:
        return bins
    if not policy.dynamic:
        raise ScheduleError(f"step {step}: " + static_misalignment_message(len(bins), policy, layout))
    aligned = kernels.split_to_multiple(bins, step_sizes, multiple)
    if aligned is None:
        target = -(-len(bins) // multiple) * multiple
        raise ScheduleError(
            f"step {step}: its {len(step_sizes)} samples pack into {len(bins)} micro-batches "
            f"under the cap {policy.token_cap(layout)}; a multiple of dp*microbatch_group="
            f"{multiple} needs {target}, but splitting can make at most {len(step_sizes)} (one "
            "per sample). Fix: raise global_batch_size (more samples per step), raise "
            "max_tokens_per_gpu so samples share micro-batches, or lower dp / microbatch_group."
        )
    return aligned


def bin_sums(bins: kernels.Bins, per_item: np.ndarray) -> np.ndarray:
    """Sum of ``per_item`` over every (non-empty) bin, vectorised."""
    flat = np.fromiter(chain.from_iterable(bins), dtype=np.int64)
    starts = np.zeros(len(bins), dtype=np.int64)
    np.cumsum([len(b) for b in bins[:-1]], out=starts[1:])
    return np.add.reduceat(per_item[flat], starts) if len(flat) else np.zeros(0)


def _distribute(bins: kernels.Bins, samples: np.ndarray, step_sizes: np.ndarray,
                work: np.ndarray, layout: ParallelLayout, policy: BatchingPolicy) -> list[list[int]]:
    if policy.balance == "strided":
        return kernels.strided(len(bins), layout.dp)
    per_item = step_sizes.astype(np.float64) if policy.balance == "tokens" else work[samples]
    return kernels.karmarkar_karp_equal(bin_sums(bins, per_item), layout.dp)


def _step_plan(parts: list[list[int]], bins: kernels.Bins, samples: np.ndarray,
               num_groups: int) -> StepPlan:
    """Translate positions to global sample ids in one gather, then cut into tuples."""
    ordered = [bins[j] for part in parts for j in part]
    ids = samples[np.fromiter(chain.from_iterable(ordered), dtype=np.int64)].tolist()
    micro, start = [], 0
    for part in parts:
        rank = []
        for j in part:
            end = start + len(bins[j])
            rank.append(tuple(ids[start:end]))
            start = end
        micro.append(tuple(rank))
    return StepPlan(num_groups=num_groups, num_microbatches=len(parts[0]),
                    microbatches=tuple(micro))


def _assemble(steps: list[StepPlan], dp: int):
    """Per rank: the partition (all steps' micro-batches in order) and local index ranges."""
    partitions, local = [], []
    for rank in range(dp):
        mbs = list(chain.from_iterable(step.microbatches[rank] for step in steps))
        ends = list(accumulate(map(len, mbs)))
        partitions.append(tuple(chain.from_iterable(mbs)))
        local.append(tuple(map(tuple, map(range, [0, *ends[:-1]], ends))))
    return tuple(partitions), tuple(local)
