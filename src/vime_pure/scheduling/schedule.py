"""Rollout-side step schedule: whole groups per step, packed micro-batches, equal counts per rank.

Purpose: turn one rollout batch (per-sample token counts plus ``group_id``s) into the plan that
every trainer rank follows, computed once on the rollout side. The trainer only consumes indices.

Pipeline (pack first, distribute second), per step:

1. **Group** samples by ``group_id`` in first-occurrence order (siblings keep their order).
2. **Plan steps** of ``global_batch_size`` *groups*. Trailing groups are dropped whole and
   reported in ``dropped_groups`` / ``dropped_samples``, or, with ``allow_partial_step``, form
   one smaller final step when it is feasible (it can form ``dp * microbatch_group``
   micro-batches).
3. **Pack** the step's samples: static chunks of ``micro_batch_size``, or first-fit / FFD under
   the cap ``max_tokens_per_gpu * cp``, or FLOPs-balanced packing that still respects the cap.
   A sample over the cap sits alone in its micro-batch.
4. **Align** the micro-batch count to a multiple of ``dp * (microbatch_group if vpp > 1 else 1)``
   by splitting the heaviest multi-sample micro-batches into token-balanced halves.
5. **Distribute** ``K / dp`` micro-batches to every rank: strided round-robin, or
   Karmarkar-Karp with equal counts on micro-batch tokens or FLOPs.

``balance="straggler"`` reverses steps 3-5 to minimise the slowest rank: it deals samples to
ranks by estimated FLOPs first (LPT), packs each rank under the cap, equalises the counts by
splitting and refines by swaps (``vime_pure.scheduling.rank_balance``). Its per-rank count can
exceed FFD's: by one micro-batch (never under VPP) when that removes a straggler the cap would
leave, and by whole ``microbatch_group`` multiples when per-rank packing cannot fit the samples
into the aligned count (a VPP layout with group 3 was seen at +3 per rank).

Micro-batches are **not** interleaved across virtual pipeline (VPP) chunks. Megatron's
interleaved schedule runs every micro-batch through every model chunk of a rank, so every
chunk's data iterator must see the same, full list of the rank's micro-batches; the only VPP
constraint is that the rank's count is a multiple of ``microbatch_group``.

Invariants (checked when a ``Schedule`` is constructed, asserted by the tests):

1. Every rank has the same ``num_microbatches`` in every step.
2. Flattening ``micro_batch_indices[rank]`` gives ``0 .. len(partitions[rank]) - 1``.
3. Partitions are disjoint and their union is exactly the samples of the kept groups.
4. Under dynamic packing every micro-batch is within the token cap, or is a singleton.
5. Siblings share a step.
6. With VPP, per-rank counts are multiples of ``microbatch_group``.
7. Output is deterministic for identical input (no randomness, ties broken by position).

Example: 8 groups of one sample each, lengths 100..800, ``dp=2``, ``max_tokens_per_gpu=1000``,
``global_batch_size=8`` gives one step whose FFD packing is
``[800, 200] [700, 300] [600, 400] [500, 100]``: 4 micro-batches, 2 per rank.
"""

from collections.abc import Hashable
from itertools import accumulate, chain

import attrs
import numpy as np

from vime_pure.config import BatchingPolicy, ParallelLayout
from vime_pure.errors import ScheduleError, ScheduleInvariantError, field_error, type_tag

MicroBatch = tuple[int, ...]


@attrs.frozen
class StepPlan:
    """One optimizer step: ``microbatches[rank][j]`` are the global sample indices of the
    rank's ``j``-th micro-batch. ``num_microbatches`` is per rank and equal on every rank."""

    num_groups: int
    num_microbatches: int
    microbatches: tuple[tuple[MicroBatch, ...], ...]

    @property
    def num_samples(self) -> int:
        return sum(len(mb) for rank in self.microbatches for mb in rank)


@attrs.frozen
class Schedule:
    """A validated schedule; construction checks every invariant in the module docstring.

    ``partitions[rank]``: the rank's global sample indices in execution order (all steps).
    ``micro_batch_indices[rank]``: per micro-batch (all steps in order), local positions into
    ``partitions[rank]``. ``sample_group[i]``: dense group number of sample ``i``.
    ``dropped_groups``: original ids of groups not trained; ``dropped_samples``: their samples.
    """

    layout: ParallelLayout
    policy: BatchingPolicy
    lengths: tuple[int, ...]
    sample_group: tuple[int, ...]
    steps: tuple[StepPlan, ...]
    partitions: tuple[tuple[int, ...], ...]
    micro_batch_indices: tuple[tuple[MicroBatch, ...], ...]
    dropped_groups: tuple[Hashable, ...]
    dropped_samples: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        check_schedule(self)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def token_cap(self) -> int | None:
        return self.policy.token_cap(self.layout)

    def step_of_microbatch(self) -> tuple[int, ...]:
        """Step index of each of a rank's micro-batches (the same on every rank)."""
        return tuple(s for s, step in enumerate(self.steps) for _ in range(step.num_microbatches))


# -- construction-time checks (a violation is a bug in vime, not bad input) -----------------
def _fail(number: int, what: str) -> None:
    raise ScheduleInvariantError(f"schedule invariant {number} violated: {what}")


def _flat(nested, count: int = -1) -> np.ndarray:
    return np.fromiter(chain.from_iterable(nested), dtype=np.int64, count=count)


def _check_fields(s: Schedule) -> None:
    """Field types first: a hand-built Schedule with a wrong one is a ``ScheduleError``."""
    for name, kind in (("layout", ParallelLayout), ("policy", BatchingPolicy)):
        if not isinstance(getattr(s, name), kind):
            raise field_error(ScheduleError, name, type_tag(getattr(s, name)),
                              f"is not a {kind.__name__}", "build schedules with build_schedule")
    for name in ("lengths", "sample_group", "steps", "partitions", "micro_batch_indices",
                 "dropped_groups", "dropped_samples"):
        if not isinstance(getattr(s, name), tuple):
            raise field_error(ScheduleError, name, type_tag(getattr(s, name)), "is not a tuple",
                              "build schedules with build_schedule")
    odd = next((k for k, step in enumerate(s.steps) if not isinstance(step, StepPlan)), None)
    if odd is not None:
        raise field_error(ScheduleError, f"steps[{odd}]", type_tag(s.steps[odd]),
                          "is not a StepPlan", "build schedules with build_schedule")


def check_schedule(s: Schedule) -> None:
    _check_fields(s)
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


def _check_rank(s: Schedule, rank: int, total_mbs: int) -> None:
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


def _check_coverage(s: Schedule, n: int, ids: np.ndarray) -> None:
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


def _check_cap(s: Schedule, lengths: np.ndarray, mbs: list, sizes: np.ndarray,
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


def _step_of_microbatch(s: Schedule, flat_index: int) -> int:
    ends = list(accumulate(s.layout.dp * step.num_microbatches for step in s.steps))
    return next(k for k, end in enumerate(ends) if flat_index < end)


def _check_siblings(s: Schedule, ids: np.ndarray) -> None:
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
