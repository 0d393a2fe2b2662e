"""Deliberately naive reference implementations, written by us, run the way the anchors run them.

Two uses:

1. **Oracle** for the property tests: ``naive_first_fit``, ``naive_first_fit_decreasing`` and
   ``naive_flops_balanced_pack`` are the textbook definitions (linear scan over open bins) that
   the fast kernels in ``vime_pure.scheduling.kernels`` must reproduce bin for bin.
2. **Baseline** for the benchmark: ``reference_schedule`` plans the same steps with the quadratic
   algorithms of slime/miles-style schedulers (their structure, not their code): first-fit that
   scans every open bin, an alignment splitter that rescans every bin per split, and FLOPs
   packing by Karmarkar-Karp over N singleton states (which ignores the token cap, as the anchors
   do). It returns plain nested lists and checks nothing, so its timings flatter it.
"""

import heapq


from vime_pure.scheduling.kernels import largest_differencing


def naive_first_fit(sizes, cap: int, order=None) -> list[list[int]]:
    """Each item (in ``order``) into the first open bin with room; oversize items sit alone."""
    bins: list[list[int]] = []
    room: list[int] = []  # -1 marks a closed oversize singleton
    for i in range(len(sizes)) if order is None else order:
        size = int(sizes[i])
        if size > cap:
            bins.append([i])
            room.append(-1)
            continue
        for b, r in enumerate(room):
            if r >= size:
                bins[b].append(i)
                room[b] = r - size
                break
        else:
            bins.append([i])
            room.append(cap - size)
    return bins


def naive_first_fit_decreasing(sizes, cap: int) -> list[list[int]]:
    order = sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i))
    return naive_first_fit(sizes, cap, order)


def naive_flops_balanced_pack(sizes, work, cap: int, num_bins: int) -> list[list[int]]:
    """LPT by ``work``: each item to the least-loaded bin with token room (linear scan)."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    tokens = [0] * num_bins
    load = [0.0] * num_bins
    for i in sorted(range(len(work)), key=lambda j: (-float(work[j]), j)):
        size = int(sizes[i])
        if size > cap:
            bins.append([i])
            tokens.append(size)
            load.append(float(work[i]))
            continue
        best = -1
        for b in range(len(bins)):
            if tokens[b] + size <= cap and (best < 0 or load[b] < load[best]):
                best = b
        if best < 0:
            bins.append([])
            tokens.append(0)
            load.append(0.0)
            best = len(bins) - 1
        bins[best].append(i)
        tokens[best] += size
        load[best] += float(work[i])
    return [sorted(b) for b in bins if b]


def naive_split_to_multiple(bins, sizes, multiple: int):
    """Split the heaviest multi-item bin, found by rescanning every bin, until aligned."""
    bins = [list(b) for b in bins]
    target = -(-len(bins) // multiple) * multiple
    while len(bins) < target:
        best, best_sum = -1, -1
        for pos, b in enumerate(bins):
            total = sum(int(sizes[i]) for i in b)
            if len(b) > 1 and total > best_sum:
                best, best_sum = pos, total
        if best < 0:
            return None
        items = sorted(bins[best], key=lambda j: (-int(sizes[j]), j))
        halves, sums = ([], []), [0, 0]
        for i in items:
            side = 0 if sums[0] <= sums[1] else 1
            halves[side].append(i)
            sums[side] += int(sizes[i])
        bins[best] = sorted(halves[0])
        bins.append(sorted(halves[1]))
    return bins


def naive_karmarkar_karp(weights, parts: int, equal: bool) -> list[list[int]]:
    """Largest differencing. ``equal``: rows of ``parts`` items (equal counts); otherwise one
    state per item (N singleton states), as the anchors run it for FLOPs packing."""
    order = sorted(range(len(weights)), key=lambda i: (-float(weights[i]), i))
    heap = []
    if equal:
        rows = [order[r:r + parts] for r in range(0, len(order), parts)]
    else:
        rows = [[i] for i in order]
    for k, row in enumerate(rows):
        state = [(float(weights[i]), [i]) for i in row] + [(0.0, [])] * (parts - len(row))
        state.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(state[0][0] - state[-1][0]), k, state))
    # The merge step is the same as vime's; the naivety is the N singleton states above.
    return largest_differencing(heap, parts)


def reference_schedule(lengths, group_ids, dp: int, multiple: int, gbs: int, cap: int,
                       mode: str, flops=None, allow_partial: bool = True):
    """Plan steps like the anchors: ``mode`` is "strided" / "tokens" (first-fit-decreasing,
    rescanning splitter, then round-robin or KK on bin tokens) or "flops" (KK over singleton
    states into the first-fit bin count, then KK on bin FLOPs). Returns per step, per rank, the
    micro-batches as lists of global sample indices."""
    members: dict = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    groups = list(members.values())
    cut = len(groups) if allow_partial else len(groups) // gbs * gbs
    steps = []
    for start in range(0, cut, gbs):
        partial = start + gbs > len(groups)
        samples = [i for g in groups[start:start + gbs] for i in g]
        sizes = [int(lengths[i]) for i in samples]
        bins = naive_first_fit_decreasing(sizes, cap)
        if mode == "flops":
            work = [float(flops[i]) for i in samples]
            count = -(-len(bins) // multiple) * multiple
            bins = [b for b in naive_karmarkar_karp(work, count, equal=False) if b]
        bins = naive_split_to_multiple(bins, sizes, multiple)
        if bins is None:  # too few samples to align: a partial step is dropped
            if partial:
                break
            raise ValueError(f"step at group {start} cannot be aligned to {multiple}")
        if mode == "strided":
            parts = [list(range(r, len(bins), dp)) for r in range(dp)]
        else:
            per = sizes if mode == "tokens" else [float(flops[i]) for i in samples]
            weights = [sum(per[i] for i in b) for b in bins]
            parts = naive_karmarkar_karp(weights, dp, equal=True)
        steps.append([[[samples[i] for i in bins[j]] for j in part] for part in parts])
    return steps




def naive_lpt(weights, parts: int) -> list[list[int]]:
    """Heaviest first, each to the part with the least load (first such part on ties)."""
    loads = [0.0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(weights)), key=lambda j: (-float(weights[j]), j)):
        p = min(range(parts), key=lambda q: (loads[q], q))
        out[p].append(i)
        loads[p] += float(weights[i])
    return [sorted(items) for items in out]
