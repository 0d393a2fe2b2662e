"""The scheduling pipeline behind ``build_schedule``: steps, packing, alignment, distribution.

See ``vime_pure.schedule`` for the contract and invariants; this module only computes.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from vime_pure import kernels
from vime_pure.config import BatchingPolicy, ParallelLayout, check_feasible
from vime_pure.config import static_misalignment_message
from vime_pure.errors import ScheduleError
from vime_pure.flops import proxy_flops
from vime_pure.grouping import Grouping, group_samples
from vime_pure.schedule import Schedule, StepPlan
from vime_pure.validate import as_flops, as_lengths, check_same_length


def plan(
    lengths: Sequence[Any] | np.ndarray,
    group_ids: Sequence[Any],
    layout: Any,
    policy: Any,
    flops: Sequence[Any] | np.ndarray | None,
) -> Schedule:
    if not isinstance(layout, ParallelLayout):
        raise ScheduleError(f"layout={layout!r} is not a ParallelLayout. "
                            "Fix: pass ParallelLayout(dp=...).")
    if not isinstance(policy, BatchingPolicy):
        raise ScheduleError(f"policy={policy!r} is not a BatchingPolicy. "
                            "Fix: pass BatchingPolicy(global_batch_size=...).")
    sizes = as_lengths(lengths)
    check_same_length(sizes, group_ids)
    work = proxy_flops(sizes) if flops is None else as_flops(flops, len(sizes))
    check_feasible(layout, policy)
    grouping = group_samples(group_ids)
    gbs, num_groups = policy.global_batch_size, grouping.num_groups
    full = num_groups // gbs
    steps = [_build_step(range(k * gbs, (k + 1) * gbs), k, grouping, sizes, work, layout, policy)
             for k in range(full)]
    dropped = list(range(full * gbs, num_groups))
    partial_error = None
    if dropped and policy.allow_partial_step:
        try:
            steps.append(_build_step(dropped, full, grouping, sizes, work, layout, policy))
            dropped = []
        except ScheduleError as exc:  # an infeasible partial step is dropped and reported
            partial_error = exc
    if not steps:
        raise _too_few_groups(num_groups, gbs, partial_error)

    dropped_samples = sorted(int(i) for g in dropped for i in grouping.members[g])
    partitions, local = _assemble(steps, layout.dp)
    return Schedule(
        layout=layout, policy=policy, lengths=tuple(sizes.tolist()),
        sample_group=tuple(grouping.dense.tolist()), steps=tuple(steps),
        partitions=partitions, micro_batch_indices=local,
        dropped_groups=tuple(grouping.ids[g] for g in dropped),
        dropped_samples=tuple(dropped_samples),
    )


def _build_step(groups: Sequence[int], index: int, grouping: Grouping, sizes: np.ndarray,
                work: np.ndarray, layout: ParallelLayout, policy: BatchingPolicy) -> StepPlan:
    samples = np.concatenate([grouping.members[g] for g in groups])
    bins = _pack(samples, sizes, work, layout, policy)
    aligned = _align(bins, samples, sizes, layout, policy, step=index)
    return _distribute(aligned, samples, sizes, work, layout, policy, len(groups))


def _too_few_groups(num_groups: int, gbs: int, partial_error: ScheduleError | None) -> ScheduleError:
    partial = (f" allow_partial_step=True could not help: {partial_error}"
               if partial_error is not None else "")
    return ScheduleError(
        f"only {num_groups} groups arrived but one step needs global_batch_size={gbs} "
        f"groups.{partial} Fix: lower global_batch_size to at most {num_groups}, generate "
        "more rollouts per batch, or set allow_partial_step=True."
    )


def _pack(samples: np.ndarray, sizes: np.ndarray, work: np.ndarray,
          layout: ParallelLayout, policy: BatchingPolicy) -> kernels.Bins:
    """Bins of positions into ``samples``."""
    n = len(samples)
    if not policy.dynamic:
        mbs = policy.micro_batch_size
        return [list(range(i, min(i + mbs, n))) for i in range(0, n, mbs)]
    cap = policy.token_cap(layout)
    step_sizes = sizes[samples]
    if policy.packing == "first_fit":
        return kernels.first_fit(step_sizes, cap)
    ffd = kernels.first_fit_decreasing(step_sizes, cap)
    if policy.packing == "ffd":
        return ffd
    return kernels.flops_balanced_pack(step_sizes, work[samples], cap, len(ffd))


def _align(bins: kernels.Bins, samples: np.ndarray, sizes: np.ndarray, layout: ParallelLayout,
           policy: BatchingPolicy, step: int) -> kernels.Bins:
    multiple = layout.align_multiple
    if len(bins) % multiple == 0:
        return bins
    if not policy.dynamic:
        raise ScheduleError(f"step {step}: " + static_misalignment_message(len(bins), policy, layout))
    aligned = kernels.split_to_multiple(bins, sizes[samples], multiple)
    if aligned is None:
        target = -(-len(bins) // multiple) * multiple
        raise ScheduleError(
            f"step {step}: its {len(samples)} samples pack into {len(bins)} micro-batches under "
            f"the cap {policy.token_cap(layout)}; a multiple of dp*microbatch_group={multiple} "
            f"needs {target}, but splitting can make at most {len(samples)} (one per sample). "
            "Fix: raise global_batch_size (more samples per step), raise max_tokens_per_gpu so "
            "samples share micro-batches, or lower dp / microbatch_group."
        )
    return aligned


def _distribute(bins: kernels.Bins, samples: np.ndarray, sizes: np.ndarray, work: np.ndarray,
                layout: ParallelLayout, policy: BatchingPolicy, num_groups: int) -> StepPlan:
    dp = layout.dp
    if policy.balance == "strided":
        parts = kernels.strided(len(bins), dp)
    else:
        per_sample = sizes if policy.balance == "tokens" else work
        weights = np.array([float(per_sample[samples[b]].sum()) for b in bins])
        parts = kernels.karmarkar_karp_equal(weights, dp)
    micro = tuple(tuple(tuple(int(samples[p]) for p in bins[j]) for j in part) for part in parts)
    return StepPlan(num_groups=num_groups, num_microbatches=len(bins) // dp, microbatches=micro)


def _assemble(steps: list[StepPlan], dp: int):
    partitions: list[list[int]] = [[] for _ in range(dp)]
    local: list[list[tuple[int, ...]]] = [[] for _ in range(dp)]
    for step in steps:
        for rank, mbs in enumerate(step.microbatches):
            for mb in mbs:
                start = len(partitions[rank])
                partitions[rank].extend(mb)
                local[rank].append(tuple(range(start, start + len(mb))))
    return tuple(map(tuple, partitions)), tuple(map(tuple, local))
