"""Typed per-step statistics of a schedule: loads, imbalance, cap use, and lower bounds.

One function, :func:`measure_step`, measures a step given as nested micro-batches
(``step[rank][j]`` = sample indices), so a ``Schedule`` (``vime schedule``, ``metrics.jsonl``)
and the benchmarks' naive reference are judged by the same code and the same bounds:

- micro-batch lower bound: ``oversize + ceil(tokens of the other samples / cap)``. A sample over
  the cap sits alone in its micro-batch (the scheduler's rule), so plain ``ceil(step tokens /
  cap)`` is *not* a bound when such samples exist. ``microbatch_bound_aligned`` rounds it up to
  the layout's ``align_multiple``; no valid schedule of the step uses fewer micro-batches (a
  property test asserts it). Static packing: the bound is the count it must form.
- imbalance ``max rank load / mean rank load`` (1.0 is perfect) in tokens and FLOPs, and its
  lower bound ``max(max item, total / dp) / (total / dp)``, the best any assignment could reach;
- cap use: the mean fill ``step tokens / (micro-batches * cap)``; cap violations: multi-sample
  micro-batches over the cap (0 for a valid ``Schedule``).

Example: cap 1000, samples 1500, 600, 500, 400 on dp=2: 1500 is oversize, the rest (1500
tokens) needs 2 micro-batches, so the bound is 1 + 2 = 3, aligned 4 (2 per rank); plain
``ceil(3000 / 1000) = 3`` would be right here only by luck. Rank loads 1000/600: imbalance 1.25.
"""

from collections.abc import Sequence
from itertools import chain

import attrs
import numpy as np

from vime_pure.scheduling.flops import proxy_flops
from vime_pure.scheduling.schedule import Schedule


@attrs.frozen
class StepStats:
    """Statistics of one step (tokens, and FLOPs from the given or proxy estimate)."""

    step: int
    num_groups: int
    num_samples: int
    microbatches_per_rank: int  # the most any rank holds (equal on every rank of a Schedule)
    num_microbatches: int  # over all ranks
    microbatch_bound: int  # oversize singletons + ceil(other tokens / cap), all ranks
    microbatch_bound_aligned: int  # the bound rounded up to align_multiple, all ranks
    microbatch_lower_bound: int  # per rank: microbatch_bound_aligned / dp
    oversize_samples: int  # samples longer than the cap (each alone in a micro-batch)
    max_rank_tokens: int
    mean_rank_tokens: float
    token_imbalance: float
    token_imbalance_bound: float
    flops_imbalance: float
    flops_imbalance_bound: float
    cap_use: float | None  # mean micro-batch fill; None under static packing
    max_microbatch_tokens: int
    over_cap_multi: int  # multi-sample micro-batches over the cap (always 0 for a valid Schedule)


def _imbalance(loads: np.ndarray) -> float:
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0


def _bound(items: np.ndarray, dp: int) -> float:
    mean = float(items.sum()) / dp
    return max(float(items.max()), mean) / mean if mean > 0 else 1.0


def microbatch_bound(step_lengths: np.ndarray, cap: int) -> int:
    """Fewest micro-batches any valid packing of these samples can use under ``cap``.

    Example: lengths ``[1500, 600, 500, 400]``, cap 1000: 1 oversize + ceil(1500/1000) = 3.
    """
    over = step_lengths > cap
    return int(over.sum()) + -(-int(step_lengths[~over].sum()) // cap)


def measure_step(step: Sequence[Sequence[Sequence[int]]], lengths: np.ndarray,
                 work: np.ndarray, cap: int | None, dp: int, multiple: int, *, index: int = 0,
                 num_groups: int = 0) -> StepStats:
    """Statistics of one step; ``cap=None`` is static packing (the bound is the count used)."""
    mbs = list(chain.from_iterable(step))
    sizes = np.fromiter(map(len, mbs), dtype=np.int64, count=len(mbs))
    ids = np.fromiter(chain.from_iterable(mbs), dtype=np.int64, count=int(sizes.sum()))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    mb_tokens = np.add.reduceat(lengths[ids], starts)
    mb_work = np.add.reduceat(work[ids], starts)
    rank_of_mb = np.repeat(np.arange(dp), [len(rank) for rank in step])
    rank_tokens = np.bincount(rank_of_mb, weights=mb_tokens, minlength=dp)
    rank_work = np.bincount(rank_of_mb, weights=mb_work, minlength=dp)
    step_lengths = lengths[ids]
    total = int(step_lengths.sum())
    if cap is None:
        bound, oversize, cap_use, over = len(mbs), 0, None, 0
    else:
        bound, oversize = microbatch_bound(step_lengths, cap), int((step_lengths > cap).sum())
        cap_use = total / (len(mbs) * cap)
        over = int(((sizes > 1) & (mb_tokens > cap)).sum())
    aligned = -(-bound // multiple) * multiple
    return StepStats(
        step=index, num_groups=num_groups, num_samples=int(ids.size),
        microbatches_per_rank=max(len(rank) for rank in step), num_microbatches=len(mbs),
        microbatch_bound=bound, microbatch_bound_aligned=aligned,
        microbatch_lower_bound=aligned // dp, oversize_samples=oversize,
        max_rank_tokens=int(rank_tokens.max()), mean_rank_tokens=float(rank_tokens.mean()),
        token_imbalance=_imbalance(rank_tokens),
        token_imbalance_bound=_bound(step_lengths.astype(np.float64), dp),
        flops_imbalance=_imbalance(rank_work), flops_imbalance_bound=_bound(work[ids], dp),
        cap_use=cap_use, max_microbatch_tokens=int(mb_tokens.max()), over_cap_multi=over)


def step_stats(schedule: Schedule, flops: np.ndarray | None = None) -> tuple[StepStats, ...]:
    """Per-step statistics; ``flops`` defaults to ``proxy_flops(lengths)``."""
    lengths = np.asarray(schedule.lengths, dtype=np.int64)
    work = proxy_flops(lengths) if flops is None else np.asarray(flops, dtype=np.float64)
    layout = schedule.layout
    return tuple(measure_step(step.microbatches, lengths, work, schedule.token_cap, layout.dp,
                              layout.align_multiple, index=k, num_groups=step.num_groups)
                 for k, step in enumerate(schedule.steps))


@attrs.frozen
class PolicySummary:
    """Whole-schedule summary of one policy, for side-by-side comparison.

    ``microbatches``: total over steps and ranks; ``microbatch_bound``: the sum over steps of
    the oversize-aware bound (unaligned); ``microbatch_bound_aligned`` rounds each step's
    bound up to the layout's ``align_multiple``. Imbalances are means and worsts over steps of
    max/mean rank load, with the mean of the per-step bounds ``max(max item, total/dp)/(total/dp)``.
    ``pad_waste``: extra tokens if each micro-batch were a padded ``[n, max_len]`` batch, as a
    fraction of real tokens. ``dropped_groups``: groups not trained.
    """

    microbatches: int
    microbatch_bound: int
    microbatch_bound_aligned: int
    token_imbalance_mean: float
    token_imbalance_worst: float
    token_imbalance_bound: float
    flops_imbalance_mean: float
    flops_imbalance_worst: float
    flops_imbalance_bound: float
    pad_waste: float
    over_cap_multi: int
    dropped_groups: int
    oversize_samples: int = 0  # samples over the cap, each alone in its micro-batch
    max_microbatch_tokens: int = 0


def summarize(schedule: Schedule, flops: np.ndarray | None = None) -> PolicySummary:
    """Summarise ``schedule``. Example: one step, dp=2, rank loads 1000/600 tokens gives
    ``token_imbalance_mean == 1.25``."""
    stats = step_stats(schedule, flops)
    lengths = np.asarray(schedule.lengths, dtype=np.int64)
    mbs = [list(mb) for step in schedule.steps for rank in step.microbatches for mb in rank]
    padded = sum(len(mb) * int(lengths[mb].max()) for mb in mbs)
    real = sum(int(lengths[mb].sum()) for mb in mbs)
    return PolicySummary(
        microbatches=sum(s.num_microbatches for s in stats),
        microbatch_bound=sum(s.microbatch_bound for s in stats),
        microbatch_bound_aligned=sum(s.microbatch_bound_aligned for s in stats),
        token_imbalance_mean=float(np.mean([s.token_imbalance for s in stats])),
        token_imbalance_worst=max(s.token_imbalance for s in stats),
        token_imbalance_bound=float(np.mean([s.token_imbalance_bound for s in stats])),
        flops_imbalance_mean=float(np.mean([s.flops_imbalance for s in stats])),
        flops_imbalance_worst=max(s.flops_imbalance for s in stats),
        flops_imbalance_bound=float(np.mean([s.flops_imbalance_bound for s in stats])),
        pad_waste=padded / real - 1.0 if real else 0.0,
        over_cap_multi=sum(s.over_cap_multi for s in stats),
        dropped_groups=len(schedule.dropped_groups),
        oversize_samples=sum(s.oversize_samples for s in stats),
        max_microbatch_tokens=max((s.max_microbatch_tokens for s in stats), default=0),
    )
