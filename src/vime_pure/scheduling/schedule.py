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

Storage: a ``Schedule`` holds flat arrays: ``sample_ids`` is every micro-batch's global sample
indices concatenated (step by step, rank by rank, micro-batch by micro-batch) and
``mb_offsets`` cuts it into micro-batches; ``step_microbatches`` / ``step_groups`` give each
step's per-rank micro-batch count and group count. The nested views (``steps``, ``partitions``,
``micro_batch_indices``) and the tuples ``lengths``, ``sample_group`` and ``dropped_samples``
are built on first access and cached, so a schedule that is only consumed through arrays never
pays for 64k Python tuples.

Invariants (checked when a ``Schedule`` is constructed, asserted by the tests):

1. Every rank has the same ``num_microbatches`` in every step.
2. Flattening ``micro_batch_indices[rank]`` gives ``0 .. len(partitions[rank]) - 1`` (the
   views are derived from one array, so this holds by construction; the offsets are checked).
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
from functools import cached_property

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


def _frozen_int64(value: object, name: str) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype != np.int64:
        raise field_error(ScheduleError, name, type_tag(value), "is not a 1-D int64 array",
                          "build schedules with build_schedule")
    value.flags.writeable = False  # a schedule that exists stays valid
    return value


_ARRAY_EQ = attrs.cmp_using(eq=np.array_equal)


@attrs.frozen(slots=False)  # slots off: the cached views live in the instance dict
class Schedule:
    """A validated schedule; construction checks every invariant in the module docstring.

    Arrays (the storage): ``sample_ids[mb_offsets[m]:mb_offsets[m + 1]]`` is micro-batch ``m``
    in (step, rank, micro-batch) order; ``step_microbatches[k]`` is step ``k``'s per-rank
    count and ``step_groups[k]`` its group count; ``lengths_array`` / ``group_array`` /
    ``dropped_array`` are per-sample lengths, dense group numbers and dropped samples.
    Views (built on access, cached): ``steps``; ``partitions[rank]``, the rank's global sample
    indices in execution order (all steps); ``micro_batch_indices[rank]``, per micro-batch, local
    positions into ``partitions[rank]``; ``lengths``, ``sample_group``, ``dropped_samples`` as
    tuples. ``dropped_groups``: original ids of groups not trained.
    Example: 3 samples of lengths 5, 7, 3 in 3 groups, dp=1, one micro-batch each: ``sample_ids``
    ``[1, 0, 2]``, ``mb_offsets`` ``[0, 1, 2, 3]``, ``step_microbatches`` ``[3]``.
    """

    layout: ParallelLayout
    policy: BatchingPolicy
    lengths_array: np.ndarray = attrs.field(eq=_ARRAY_EQ)
    group_array: np.ndarray = attrs.field(eq=_ARRAY_EQ)
    sample_ids: np.ndarray = attrs.field(eq=_ARRAY_EQ)
    mb_offsets: np.ndarray = attrs.field(eq=_ARRAY_EQ)
    step_microbatches: np.ndarray = attrs.field(eq=_ARRAY_EQ)
    step_groups: np.ndarray = attrs.field(eq=_ARRAY_EQ)
    dropped_groups: tuple[Hashable, ...]
    dropped_array: np.ndarray = attrs.field(eq=_ARRAY_EQ)

    def __attrs_post_init__(self) -> None:
        check_schedule(self)

    @property
    def num_steps(self) -> int:
        return len(self.step_microbatches)

    @property
    def token_cap(self) -> int | None:
        return self.policy.token_cap(self.layout)

    def step_of_microbatch(self) -> tuple[int, ...]:
        """Step index of each of a rank's micro-batches (the same on every rank)."""
        return tuple(np.repeat(np.arange(self.num_steps), self.step_microbatches).tolist())

    def step_mb_range(self, step: int) -> tuple[int, int]:
        """Flat micro-batch numbers ``[lo, hi)`` of ``step`` (all ranks, rank-major)."""
        return int(self._step_mb_starts[step]), int(self._step_mb_starts[step + 1])

    @cached_property
    def _step_mb_starts(self) -> np.ndarray:
        starts = np.zeros(self.num_steps + 1, dtype=np.int64)
        np.cumsum(self.step_microbatches * self.layout.dp, out=starts[1:])
        return starts

    @cached_property
    def _mb_tuples(self) -> list[MicroBatch]:
        ids, ends = self.sample_ids.tolist(), self.mb_offsets.tolist()
        return [tuple(ids[a:b]) for a, b in zip(ends[:-1], ends[1:])]

    @cached_property
    def steps(self) -> tuple[StepPlan, ...]:
        mbs, out = self._mb_tuples, []
        for k, (count, groups) in enumerate(zip(self.step_microbatches.tolist(),
                                                self.step_groups.tolist())):
            lo = int(self._step_mb_starts[k])
            ranks = tuple(tuple(mbs[lo + r * count: lo + (r + 1) * count])
                          for r in range(self.layout.dp))
            out.append(StepPlan(num_groups=groups, num_microbatches=count, microbatches=ranks))
        return tuple(out)

    @cached_property
    def partitions(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(ids.tolist()) for ids in self._rank_ids)

    @cached_property
    def micro_batch_indices(self) -> tuple[tuple[MicroBatch, ...], ...]:
        out = []
        for sizes in self._rank_sizes:
            ends = np.cumsum(sizes).tolist()
            out.append(tuple(tuple(range(a, b)) for a, b in zip([0, *ends[:-1]], ends)))
        return tuple(out)

    @cached_property
    def _rank_of_mb(self) -> np.ndarray:
        """Rank of every flat micro-batch (steps are rank-major)."""
        if not self.num_steps:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.repeat(np.arange(self.layout.dp), c)
                               for c in self.step_microbatches.tolist()])

    @cached_property
    def _rank_sizes(self) -> list[np.ndarray]:
        """Per rank, the sizes of its micro-batches in execution order."""
        sizes = np.diff(self.mb_offsets)
        return [sizes[self._rank_of_mb == r] for r in range(self.layout.dp)]

    @cached_property
    def _rank_ids(self) -> list[np.ndarray]:
        """Per rank, its global sample indices in execution order."""
        rank_of_id = np.repeat(self._rank_of_mb, np.diff(self.mb_offsets))
        order = np.argsort(rank_of_id, kind="stable")
        cuts = np.searchsorted(rank_of_id[order], np.arange(1, self.layout.dp))
        return np.split(self.sample_ids[order], cuts)

    def rank_sample_ids(self, rank: int) -> np.ndarray:
        """``partitions[rank]`` as an int64 array, without building tuples."""
        return self._rank_ids[rank]

    @cached_property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.lengths_array.tolist())

    @cached_property
    def sample_group(self) -> tuple[int, ...]:
        return tuple(self.group_array.tolist())

    @cached_property
    def dropped_samples(self) -> tuple[int, ...]:
        return tuple(self.dropped_array.tolist())


# -- construction-time checks (a violation is a bug in vime, not bad input) -----------------
def _fail(number: int, what: str) -> None:
    raise ScheduleInvariantError(f"schedule invariant {number} violated: {what}")


def _check_fields(s: Schedule) -> None:
    """Field types first: a hand-built Schedule with a wrong one is a ``ScheduleError``."""
    for name, kind in (("layout", ParallelLayout), ("policy", BatchingPolicy)):
        if not isinstance(getattr(s, name), kind):
            raise field_error(ScheduleError, name, type_tag(getattr(s, name)),
                              f"is not a {kind.__name__}", "build schedules with build_schedule")
    for name in ("lengths_array", "group_array", "sample_ids", "mb_offsets", "step_microbatches",
                 "step_groups", "dropped_array"):
        _frozen_int64(getattr(s, name), name)
    if not isinstance(s.dropped_groups, tuple):
        raise field_error(ScheduleError, "dropped_groups", type_tag(s.dropped_groups),
                          "is not a tuple", "build schedules with build_schedule")


def check_schedule(s: Schedule) -> None:
    _check_fields(s)
    dp, counts = s.layout.dp, s.step_microbatches
    if len(s.step_groups) != len(counts):
        _fail(1, f"{len(counts)} steps have micro-batch counts but {len(s.step_groups)} have "
                 "group counts")
    if counts.size and counts.min() < 1:
        _fail(1, f"step {int(np.argmax(counts < 1))} has no micro-batches")
    odd = np.flatnonzero(counts % s.layout.microbatch_multiple)
    if odd.size:
        _fail(6, f"step {int(odd[0])}: {int(counts[odd[0]])} per rank is not a multiple of "
                 f"microbatch_group={s.layout.microbatch_multiple}")
    offsets, ids = s.mb_offsets, s.sample_ids
    if len(offsets) != dp * int(counts.sum()) + 1 or offsets[0] != 0 or offsets[-1] != len(ids):
        _fail(1, f"{len(offsets) - 1} micro-batches for dp={dp} and per-rank counts "
                 f"{counts.tolist()[:8]}")
    sizes = np.diff(offsets)
    if sizes.size and sizes.min() < 1:
        _fail(2, f"micro-batch {int(np.argmax(sizes < 1))} is empty")
    if len(s.group_array) != len(s.lengths_array):
        _fail(3, f"{len(s.group_array)} group numbers for {len(s.lengths_array)} samples")
    _check_coverage(s, len(s.lengths_array), ids)
    _check_cap(s, sizes, ids)
    _check_siblings(s, ids)


def _check_coverage(s: Schedule, n: int, ids: np.ndarray) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        _fail(3, f"a scheduled sample index is outside 0..{n - 1}")
    dropped_ids = s.dropped_array
    if dropped_ids.size and (dropped_ids.min() < 0 or dropped_ids.max() >= n):
        _fail(3, f"a dropped sample index is outside 0..{n - 1}")
    seen = np.bincount(ids, minlength=n)
    if seen.max(initial=0) > 1:
        _fail(3, f"sample {int(np.argmax(seen > 1))} is scheduled more than once")
    dropped = np.zeros(n, dtype=bool)
    dropped[dropped_ids] = True
    if np.any(dropped & (seen > 0)):
        _fail(3, "a dropped sample is also scheduled")
    missing = np.flatnonzero(~dropped & (seen == 0))
    if missing.size:
        _fail(3, f"sample {int(missing[0])} is neither scheduled nor reported as dropped")
    if dropped_ids.size and len(np.unique(s.group_array[dropped_ids])) != len(s.dropped_groups):
        _fail(3, "dropped_samples and dropped_groups disagree")


def _check_cap(s: Schedule, sizes: np.ndarray, ids: np.ndarray) -> None:
    cap = s.token_cap
    if cap is None or not ids.size:
        return
    tokens = np.add.reduceat(s.lengths_array[ids], s.mb_offsets[:-1])
    bad = np.flatnonzero((sizes > 1) & (tokens > cap))
    if bad.size:
        m = int(bad[0])
        mb = tuple(ids[s.mb_offsets[m]:s.mb_offsets[m + 1]].tolist())
        step = int(np.searchsorted(s._step_mb_starts, m, side="right")) - 1
        _fail(4, f"step {step}: micro-batch {mb} has {int(tokens[m])} tokens > cap {cap}")


def _check_siblings(s: Schedule, ids: np.ndarray) -> None:
    groups = s.group_array
    per_step = s.mb_offsets[s._step_mb_starts[1:]] - s.mb_offsets[s._step_mb_starts[:-1]]
    step_of = np.repeat(np.arange(s.num_steps, dtype=np.int64), per_step)
    scheduled = groups[ids]
    # One step per group, without a sort: scatter each sample's step onto its group (some
    # sibling's write wins); a group in one step reads its own step back from every sample.
    group_step = np.full(int(groups.max(initial=-1)) + 1, -1, dtype=np.int64)
    group_step[scheduled] = step_of
    if np.any(group_step[scheduled] != step_of):
        _straddling(scheduled, step_of)
    held = np.bincount(group_step[group_step >= 0], minlength=s.num_steps)
    wrong = np.flatnonzero(held != s.step_groups)
    if wrong.size:
        k = int(wrong[0])
        _fail(5, f"step {k} says {int(s.step_groups[k])} groups but holds {int(held[k])}")
    # A group is either wholly in one step or wholly dropped: compare per-group counts.
    if len(groups):
        kept = np.bincount(scheduled, minlength=len(group_step))
        size = np.bincount(groups)
        partial = np.flatnonzero((kept > 0) & (kept < size))
        if partial.size:
            _fail(5, f"group {int(partial[0])} is partly scheduled")


def _straddling(scheduled: np.ndarray, step_of: np.ndarray) -> None:
    """Name the first group (in group order) whose samples sit in two steps."""
    by_group = np.argsort(scheduled, kind="stable")
    g_sorted, s_sorted = scheduled[by_group], step_of[by_group]
    split = np.flatnonzero((g_sorted[1:] == g_sorted[:-1]) & (s_sorted[1:] != s_sorted[:-1]))
    _fail(5, f"group {int(g_sorted[split[0]])} straddles steps {int(s_sorted[split[0]])} and "
             f"{int(s_sorted[split[0] + 1])}")
