"""Construction-time checks of ``Schedule`` (the numbered invariants of ``vime_pure.schedule``).

A violation here is a bug in vime, not bad user input, so it raises ``ScheduleInvariantError``
naming the invariant and where it broke. The checks flatten the nested tuples once (C-level
iterators) and compare whole arrays, so a 64k-sample schedule checks in milliseconds; the slow
search for *where* a check broke runs only after it has failed.
"""

from itertools import accumulate, chain
from typing import TYPE_CHECKING

import numpy as np

from vime_pure.errors import VimeError

if TYPE_CHECKING:
    from vime_pure.schedule import Schedule


class ScheduleInvariantError(VimeError):
    """A ``Schedule`` broke one of its invariants (a bug: please report it)."""


def _fail(number: int, what: str) -> None:
    raise ScheduleInvariantError(f"schedule invariant {number} violated: {what}")


def _flat(nested, count: int = -1) -> np.ndarray:
    return np.fromiter(chain.from_iterable(nested), dtype=np.int64, count=count)


def check_schedule(s: "Schedule") -> None:
    dp = s.layout.dp
    if len(s.partitions) != dp or len(s.micro_batch_indices) != dp:
        _fail(1, f"{len(s.partitions)} partitions for dp={dp}")
    for k, step in enumerate(s.steps):
        counts = [len(rank) for rank in step.microbatches]
        if len(counts) != dp or any(c != step.num_microbatches for c in counts):
            _fail(1, f"step {k} micro-batch counts per rank {counts} != {step.num_microbatches}")
        if step.num_microbatches < 1:
            _fail(1, f"step {k} has no micro-batches")
        if step.num_microbatches % s.layout.microbatch_multiple:
            _fail(6, f"step {k}: {step.num_microbatches} per rank is not a multiple of "
                     f"microbatch_group={s.layout.microbatch_multiple}")
    total_mbs = sum(step.num_microbatches for step in s.steps)
    for rank in range(dp):
        _check_rank(s, rank, total_mbs)
    lengths = np.asarray(s.lengths, dtype=np.int64)
    # Every scheduled micro-batch, step by step, rank by rank.
    mbs = list(chain.from_iterable(chain.from_iterable(step.microbatches for step in s.steps)))
    sizes = np.fromiter(map(len, mbs), dtype=np.int64, count=len(mbs))
    ids = _flat(mbs, int(sizes.sum()))
    _check_coverage(s, len(lengths), ids)
    _check_cap(s, lengths, mbs, sizes, ids)
    _check_siblings(s, ids)


def _check_rank(s: "Schedule", rank: int, total_mbs: int) -> None:
    local = s.micro_batch_indices[rank]
    partition = s.partitions[rank]
    own = list(chain.from_iterable(step.microbatches[rank] for step in s.steps))
    local_sizes = list(map(len, local))
    if len(local) != total_mbs or not np.array_equal(_flat(local), np.arange(len(partition))):
        _fail(2, f"rank {rank}: micro_batch_indices do not enumerate its partition in order")
    if 0 in local_sizes:
        _fail(2, f"rank {rank} has an empty micro-batch")
    if local_sizes != list(map(len, own)):
        _fail(2, f"rank {rank}: micro_batch_indices disagree with the steps' micro-batch sizes")
    if not np.array_equal(np.asarray(partition, dtype=np.int64), _flat(own)):
        _fail(2, f"rank {rank}: partition disagrees with the steps' micro-batches")


def _check_coverage(s: "Schedule", n: int, ids: np.ndarray) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        _fail(3, f"a scheduled sample index is outside 0..{n - 1}")
    seen = np.bincount(ids, minlength=n)
    if seen.max(initial=0) > 1:
        _fail(3, f"sample {int(np.argmax(seen > 1))} is scheduled more than once")
    dropped = np.zeros(n, dtype=bool)
    dropped[np.asarray(s.dropped_samples, dtype=np.int64)] = True
    if np.any(dropped & (seen > 0)):
        _fail(3, "a dropped sample is also scheduled")
    missing = np.flatnonzero(~dropped & (seen == 0))
    if missing.size:
        _fail(3, f"sample {int(missing[0])} is neither scheduled nor reported as dropped")
    groups = np.asarray(s.sample_group, dtype=np.int64)
    if s.dropped_samples and len(np.unique(groups[list(s.dropped_samples)])) != len(
            s.dropped_groups):
        _fail(3, "dropped_samples and dropped_groups disagree")


def _check_cap(s: "Schedule", lengths: np.ndarray, mbs: list, sizes: np.ndarray,
               ids: np.ndarray) -> None:
    cap = s.token_cap
    if cap is None or not ids.size:
        return
    starts = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    tokens = np.add.reduceat(lengths[ids], starts)
    bad = np.flatnonzero((sizes > 1) & (tokens > cap))
    if bad.size:
        mb = mbs[int(bad[0])]
        step = _step_of_microbatch(s, int(bad[0]))
        _fail(4, f"step {step}: micro-batch {mb} has {int(tokens[bad[0]])} tokens > cap {cap}")


def _step_of_microbatch(s: "Schedule", flat_index: int) -> int:
    ends = list(accumulate(s.layout.dp * step.num_microbatches for step in s.steps))
    return next(k for k, end in enumerate(ends) if flat_index < end)


def _check_siblings(s: "Schedule", ids: np.ndarray) -> None:
    groups = np.asarray(s.sample_group, dtype=np.int64)
    per_step = [sum(map(len, chain.from_iterable(step.microbatches))) for step in s.steps]
    step_of = np.repeat(np.arange(len(s.steps), dtype=np.int64), per_step)
    # Sort scheduled samples by group (stable radix sort): a group's samples are then adjacent.
    by_group = np.argsort(groups[ids], kind="stable")
    g_sorted, s_sorted = groups[ids][by_group], step_of[by_group]
    same_group = g_sorted[1:] == g_sorted[:-1]
    split = np.flatnonzero(same_group & (s_sorted[1:] != s_sorted[:-1]))
    if split.size:
        g = int(g_sorted[split[0]])
        _fail(5, f"group {g} straddles steps {int(s_sorted[split[0]])} and "
                 f"{int(s_sorted[split[0] + 1])}")
    first = np.concatenate(([True], ~same_group)) if ids.size else np.zeros(0, dtype=bool)
    held = np.bincount(s_sorted[first], minlength=len(s.steps))
    for k, step in enumerate(s.steps):
        if held[k] != step.num_groups:
            _fail(5, f"step {k} says {step.num_groups} groups but holds {int(held[k])}")
    # A group is either wholly in one step or wholly dropped: compare per-group counts.
    if len(groups):
        kept = np.bincount(groups[ids], minlength=int(groups.max()) + 1)
        size = np.bincount(groups)
        partial = np.flatnonzero((kept > 0) & (kept < size))
        if partial.size:
            _fail(5, f"group {int(partial[0])} is partly scheduled")
