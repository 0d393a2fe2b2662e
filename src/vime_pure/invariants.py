"""Construction-time checks of ``Schedule`` (the numbered invariants of ``vime_pure.schedule``).

A violation here is a bug in vime, not bad user input, so it raises ``ScheduleInvariantError``
naming the invariant and where it broke.
"""

from typing import TYPE_CHECKING

import numpy as np

from vime_pure.errors import VimeError

if TYPE_CHECKING:
    from vime_pure.schedule import Schedule


class ScheduleInvariantError(VimeError):
    """A ``Schedule`` broke one of its invariants (a bug: please report it)."""


def _fail(number: int, what: str) -> None:
    raise ScheduleInvariantError(f"schedule invariant {number} violated: {what}")


def check_schedule(s: "Schedule") -> None:
    dp = s.layout.dp
    n = len(s.lengths)
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
        local = s.micro_batch_indices[rank]
        flat = [i for mb in local for i in mb]
        if flat != list(range(len(s.partitions[rank]))) or len(local) != total_mbs:
            _fail(2, f"rank {rank}: micro_batch_indices do not enumerate its partition in order")
        if any(len(mb) == 0 for mb in local):
            _fail(2, f"rank {rank} has an empty micro-batch")
        expected = [i for step in s.steps for mb in step.microbatches[rank] for i in mb]
        if list(s.partitions[rank]) != expected:
            _fail(2, f"rank {rank}: partition disagrees with the steps' micro-batches")
    _check_coverage(s, n)
    _check_cap(s)
    _check_siblings(s)


def _check_coverage(s: "Schedule", n: int) -> None:
    seen = np.zeros(n, dtype=np.int64)
    for part in s.partitions:
        np.add.at(seen, np.asarray(part, dtype=np.int64), 1)
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
    if s.dropped_samples and len(set(groups[list(s.dropped_samples)].tolist())) != len(
            s.dropped_groups):
        _fail(3, "dropped_samples and dropped_groups disagree")


def _check_cap(s: "Schedule") -> None:
    cap = s.token_cap
    if cap is None:
        return
    lengths = np.asarray(s.lengths, dtype=np.int64)
    for k, step in enumerate(s.steps):
        for rank, mbs in enumerate(step.microbatches):
            for mb in mbs:
                if len(mb) > 1 and int(lengths[list(mb)].sum()) > cap:
                    _fail(4, f"step {k} rank {rank}: micro-batch {mb} has "
                             f"{int(lengths[list(mb)].sum())} tokens > cap {cap}")


def _check_siblings(s: "Schedule") -> None:
    groups = np.asarray(s.sample_group, dtype=np.int64)
    step_of_group: dict[int, int] = {}
    for k, step in enumerate(s.steps):
        members = [i for rank in step.microbatches for mb in rank for i in mb]
        for g in set(groups[members].tolist()) if members else ():
            if step_of_group.setdefault(g, k) != k:
                _fail(5, f"group {g} straddles steps {step_of_group[g]} and {k}")
        if len(set(groups[members].tolist())) != step.num_groups:
            _fail(5, f"step {k} says {step.num_groups} groups but holds "
                     f"{len(set(groups[members].tolist()))}")
    # A group is either wholly in one step or wholly dropped: compare per-group counts.
    scheduled = np.zeros(len(groups), dtype=np.int64)
    for part in s.partitions:
        scheduled[list(part)] = 1
    if len(groups):
        kept = np.bincount(groups, weights=scheduled)
        size = np.bincount(groups)
        partial = np.flatnonzero((kept > 0) & (kept < size))
        if partial.size:
            _fail(5, f"group {int(partial[0])} is partly scheduled")
