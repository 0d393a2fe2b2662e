"""Typed per-step statistics of a ``Schedule``: loads, imbalance, cap use, and lower bounds.

Loads are per DP rank. A step's imbalance is ``max rank load / mean rank load`` (1.0 is perfect);
its lower bound is ``max(max micro-batch-free item, total / dp) / (total / dp)``, the best any
assignment of these samples could reach. Cap use is the mean fill of the step's micro-batches,
``step tokens / (micro-batches * cap)``.

Example: a step whose two ranks hold 1000 and 600 tokens has mean 800 and imbalance 1.25.
"""

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
    microbatches_per_rank: int
    microbatch_lower_bound: int  # ceil(step tokens / cap), aligned up; or the static count
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


def step_stats(schedule: Schedule, flops: np.ndarray | None = None) -> tuple[StepStats, ...]:
    """Per-step statistics; ``flops`` defaults to ``proxy_flops(lengths)``."""
    lengths = np.asarray(schedule.lengths, dtype=np.int64)
    work = proxy_flops(lengths) if flops is None else np.asarray(flops, dtype=np.float64)
    cap = schedule.token_cap
    multiple = schedule.layout.align_multiple
    dp = schedule.layout.dp
    out = []
    for k, step in enumerate(schedule.steps):
        mb_tokens = [[int(lengths[list(mb)].sum()) for mb in rank] for rank in step.microbatches]
        rank_tokens = np.array([sum(r) for r in mb_tokens], dtype=np.float64)
        rank_flops = np.array([sum(float(work[list(mb)].sum()) for mb in rank)
                               for rank in step.microbatches])
        members = np.array([i for rank in step.microbatches for mb in rank for i in mb])
        flat = [t for r in mb_tokens for t in r]
        total = int(lengths[members].sum())
        if cap is None:
            bound, cap_use, over = step.num_microbatches * dp, None, 0
        else:
            bound = -(-max(-(-total // cap), 1) // multiple) * multiple
            cap_use = total / (len(flat) * cap)
            over = sum(1 for rank in step.microbatches for mb, t in zip(rank, [
                int(lengths[list(m)].sum()) for m in rank]) if len(mb) > 1 and t > cap)
        out.append(StepStats(
            step=k, num_groups=step.num_groups, num_samples=int(members.size),
            microbatches_per_rank=step.num_microbatches, microbatch_lower_bound=bound // dp,
            max_rank_tokens=int(rank_tokens.max()), mean_rank_tokens=float(rank_tokens.mean()),
            token_imbalance=_imbalance(rank_tokens),
            token_imbalance_bound=_bound(lengths[members].astype(np.float64), dp),
            flops_imbalance=_imbalance(rank_flops), flops_imbalance_bound=_bound(work[members], dp),
            cap_use=cap_use, max_microbatch_tokens=max(flat), over_cap_multi=over,
        ))
    return tuple(out)


@attrs.frozen
class PolicySummary:
    """Whole-schedule summary of one policy, for side-by-side comparison.

    ``microbatches``: total over steps and ranks; ``microbatch_bound``: the sum over steps of
    ``ceil(step tokens / cap)`` (unaligned); ``microbatch_bound_aligned`` rounds each step's
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


def summarize(schedule: Schedule, flops: np.ndarray | None = None) -> PolicySummary:
    """Summarise ``schedule``. Example: one step, dp=2, rank loads 1000/600 tokens gives
    ``token_imbalance_mean == 1.25``."""
    stats = step_stats(schedule, flops)
    lengths = np.asarray(schedule.lengths, dtype=np.int64)
    cap = schedule.token_cap
    bound = aligned = 0
    padded = real = 0
    multiple = schedule.layout.align_multiple
    for step in schedule.steps:
        mbs = [list(mb) for rank in step.microbatches for mb in rank]
        tokens = sum(int(lengths[mb].sum()) for mb in mbs)
        step_bound = -(-tokens // cap) if cap else len(mbs)
        bound += step_bound
        aligned += -(-step_bound // multiple) * multiple
        padded += sum(len(mb) * int(lengths[mb].max()) for mb in mbs)
        real += tokens
    return PolicySummary(
        microbatches=sum(s.microbatches_per_rank for s in stats) * schedule.layout.dp,
        microbatch_bound=bound, microbatch_bound_aligned=aligned,
        token_imbalance_mean=float(np.mean([s.token_imbalance for s in stats])),
        token_imbalance_worst=max(s.token_imbalance for s in stats),
        token_imbalance_bound=float(np.mean([s.token_imbalance_bound for s in stats])),
        flops_imbalance_mean=float(np.mean([s.flops_imbalance for s in stats])),
        flops_imbalance_worst=max(s.flops_imbalance for s in stats),
        flops_imbalance_bound=float(np.mean([s.flops_imbalance_bound for s in stats])),
        pad_waste=padded / real - 1.0 if real else 0.0,
        over_cap_multi=sum(s.over_cap_multi for s in stats),
        dropped_groups=len(schedule.dropped_groups),
    )
