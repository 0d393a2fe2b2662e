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
splitting and refines by swaps (``vime_pure.rank_balance``). It may spend at most one extra
micro-batch per rank (never under VPP) when the cap would otherwise leave a straggler.

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

from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import numpy as np

from vime_pure.config import BatchingPolicy, ParallelLayout
from vime_pure.errors import ScheduleError

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
        from vime_pure.invariants import check_schedule

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


def build_schedule(
    lengths: Sequence[Any] | np.ndarray,
    group_ids: Sequence[Any] | np.ndarray,
    layout: Any,
    policy: Any,
    flops: Sequence[Any] | np.ndarray | None = None,
) -> Schedule:
    """Plan the steps of one rollout batch. See the module docstring for the algorithm.

    ``lengths[i]``: total tokens of sample ``i`` (prompt + response); ``group_ids[i]``: its
    rollout group (any hashable); ``flops[i]``: optional workload estimate used by
    ``packing="flops"`` / ``balance="flops"`` (default: ``vime_pure.flops.proxy_flops``).
    Arguments are typed loosely on purpose: this is the user boundary, and every value is
    validated here with a ``ScheduleError`` that names the field, instead of a type-check error.
    Raises ``ScheduleError`` for bad input or an infeasible configuration.
    """
    from vime_pure.planner import plan

    return plan(lengths, group_ids, layout, policy, flops)
