"""The schedule built the old way: nested lists from the list kernels, step by step.

``reference_schedule_views`` re-plans a batch with the pure list-based kernels
(``vime_pure.scheduling.kernels``, ``rank_balance``) and plain Python grouping, and builds the
tuples a ``Schedule`` used to store (``steps``, ``partitions``, ``micro_batch_indices``,
``dropped_samples``, ``dropped_groups``) directly from the nested bins, with no flat arrays.
The array-backed ``Schedule`` must expose exactly these views
(``tests/property/test_schedule_properties.py``).
"""

import numpy as np

from vime_pure.scheduling import kernels, rank_balance
from vime_pure.scheduling.flops import proxy_flops


def _groups(group_ids):
    """Groups in first-occurrence order (a None is its own group), members in index order."""
    order: dict = {}
    for i, g in enumerate(group_ids):
        order.setdefault(("own", i) if g is None else g, []).append(i)
    return [(None if type(k) is tuple else k, members) for k, members in order.items()]


def _pack(sizes, work, layout, policy):
    """A step's bins of positions, aligned; None when the step cannot be aligned."""
    n, multiple, cap = len(sizes), layout.align_multiple, policy.token_cap(layout)
    if not policy.dynamic:
        mbs = policy.micro_batch_size
        bins = [list(range(a, min(a + mbs, n))) for a in range(0, n, mbs)]
        return bins if len(bins) % multiple == 0 else None
    if policy.packing == "first_fit":
        bins = kernels.first_fit(sizes, cap)
    else:
        bins = kernels.first_fit_decreasing(sizes, cap)
    if policy.packing == "flops":  # LPT on FLOPs into FFD's aligned count, unless it costs more
        aligned = -(-len(bins) // multiple) * multiple
        packed = kernels.flops_balanced_pack(sizes, work, cap, min(aligned, n))
        if -(-len(packed) // multiple) * multiple <= aligned:
            bins = packed
    if len(bins) % multiple:
        bins = kernels.split_to_count(bins, sizes, -(-len(bins) // multiple) * multiple)
    return bins


def _deal(bins, sizes, work, layout, policy):
    """Bin numbers per rank: round-robin, or equal-count Karmarkar-Karp on bin sums."""
    dp = layout.dp
    if policy.balance == "strided":
        return [list(range(r, len(bins), dp)) for r in range(dp)]
    per_item = sizes.astype(np.float64) if policy.balance == "tokens" else work
    sums = np.array([sum(float(per_item[i]) for i in b) for b in bins])  # left to right
    return kernels.karmarkar_karp_equal(sums, dp)


def _straggler(sizes, work, layout, policy):
    dp = layout.dp
    ranks = rank_balance.lpt_ranks(work, np.array([0, len(sizes)]), dp)
    order = sorted(range(len(sizes)), key=lambda i: (ranks[i], -sizes[i], i))
    out = rank_balance.balance_step(np.array(order, dtype=np.int64), ranks[order], sizes, work,
                                    policy.token_cap(layout), dp, layout.microbatch_multiple)
    return None if out is None else (out[1], out[0])


def _plan_step(samples, lengths, flops, layout, policy):
    """Per rank, the step's micro-batches of global sample ids; None if infeasible."""
    sizes = np.asarray([lengths[i] for i in samples], dtype=np.int64)
    work = np.asarray([flops[i] for i in samples], dtype=np.float64)
    planned = _straggler(sizes, work, layout, policy) if (
        policy.dynamic and policy.balance == "straggler") else None
    if planned is None:
        bins = _pack(sizes, work, layout, policy)
        if bins is None:
            return None
        planned = bins, _deal(bins, sizes, work, layout, policy)
    bins, parts = planned
    return tuple(tuple(tuple(samples[i] for i in bins[b]) for b in rank) for rank in parts)


def reference_schedule_views(lengths, group_ids, layout, policy, flops=None):
    """``(steps, partitions, micro_batch_indices, dropped_samples, dropped_groups)`` as the
    tuple ``Schedule`` held them; ``steps[k]`` is ``(num_groups, microbatches)``. None when
    not even one step can be planned (``build_schedule`` raises then)."""
    lengths = [int(v) for v in lengths]
    flops = proxy_flops(np.asarray(lengths)) if flops is None else np.asarray(flops, float)
    groups, gbs = _groups(group_ids), policy.global_batch_size
    full = len(groups) // gbs
    spans = [(k * gbs, (k + 1) * gbs) for k in range(full)]
    if policy.allow_partial_step and full * gbs < len(groups):
        spans.append((full * gbs, len(groups)))
    steps = []
    for g0, g1 in spans:
        samples = [i for _, members in groups[g0:g1] for i in members]
        ranks = _plan_step(samples, lengths, flops, layout, policy)
        if ranks is None:
            if len(steps) < full:
                return None  # a full step that cannot be planned: build_schedule raises
            break
        steps.append((g1 - g0, ranks))
    if not steps:
        return None
    partitions, local = [], []
    for r in range(layout.dp):
        ids = [i for _, ranks in steps for mb in ranks[r] for i in mb]
        partitions.append(tuple(ids))
        ends = np.cumsum([len(mb) for _, ranks in steps for mb in ranks[r]]).tolist()
        local.append(tuple(tuple(range(a, b)) for a, b in zip([0, *ends[:-1]], ends)))
    kept = spans[len(steps) - 1][1]
    dropped = sorted(i for _, members in groups[kept:] for i in members)
    return (tuple(steps), tuple(partitions), tuple(local), tuple(dropped),
            tuple(g for g, _ in groups[kept:]))
