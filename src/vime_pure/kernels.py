"""Packing, alignment and partitioning kernels of the scheduler.

All kernels work on plain integer/float arrays of one step and return bins as lists of
positions into those arrays. They are deterministic: ties break by position.

- ``first_fit(sizes, cap)``: items in the given order, each into the first bin with room;
  an item larger than ``cap`` gets a bin of its own that nothing else joins.
- ``first_fit_decreasing(sizes, cap)``: first-fit over items sorted by size, largest first
  (ties by position). Never uses more bins than ``first_fit`` in practice and is the default.
- ``flops_balanced_pack(sizes, work, cap, num_bins)``: longest-processing-time by ``work`` into
  ``num_bins`` bins, each item into the least-loaded bin that still has token room; a new bin
  opens only when none has room. The token cap is respected (oversize items are singletons).
- ``split_to_multiple(bins, sizes, multiple)``: split the heaviest multi-item bins into
  size-balanced halves until the bin count is a multiple of ``multiple``.
- ``karmarkar_karp_equal(weights, parts)``: largest differencing with equal cardinality
  (``len(weights)`` must be a multiple of ``parts``); every part gets the same number of items.
"""

import heapq
from collections.abc import Sequence

import numpy as np
from jaxtyping import Float, Int, Shaped

Bins = list[list[int]]


def first_fit(sizes: Int[np.ndarray, " n"], cap: int, order: Sequence[int] | None = None) -> Bins:
    """First-fit of ``sizes`` (in ``order``, default positional) under ``cap``."""
    bins: Bins = []
    room: list[int] = []  # remaining room of each bin; -1 marks a closed oversize singleton
    for i in (range(len(sizes)) if order is None else order):
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


def decreasing_order(sizes: Shaped[np.ndarray, " n"]) -> list[int]:
    """Positions sorted by size, largest first; ties keep positional order."""
    return np.argsort(-np.asarray(sizes), kind="stable").tolist()


def first_fit_decreasing(sizes: Int[np.ndarray, " n"], cap: int) -> Bins:
    """First-fit-decreasing of ``sizes`` under ``cap``."""
    return first_fit(sizes, cap, decreasing_order(sizes))


def flops_balanced_pack(
    sizes: Int[np.ndarray, " n"], work: Float[np.ndarray, " n"], cap: int, num_bins: int
) -> Bins:
    """Spread ``work`` evenly over ``num_bins`` bins without breaking the token ``cap``."""
    bins: Bins = [[] for _ in range(num_bins)]
    tokens = [0] * num_bins
    load = [0.0] * num_bins
    for i in decreasing_order(work):
        size = int(sizes[i])
        if size > cap:
            bins.append([i])
            tokens.append(size)
            load.append(float(work[i]))
            continue
        best = -1
        for b in range(len(bins)):
            if tokens[b] >= 0 and tokens[b] + size <= cap and (best < 0 or load[b] < load[best]):
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


def balanced_halves(items: list[int], sizes: Int[np.ndarray, " n"]) -> tuple[list[int], list[int]]:
    """Split ``items`` into two non-empty halves with near-equal size sums (greedy LPT)."""
    halves: tuple[list[int], list[int]] = ([], [])
    sums = [0, 0]
    for i in sorted(items, key=lambda j: (-int(sizes[j]), j)):
        side = 0 if sums[0] <= sums[1] else 1
        halves[side].append(i)
        sums[side] += int(sizes[i])
    return sorted(halves[0]), sorted(halves[1])


def split_to_multiple(bins: Bins, sizes: Int[np.ndarray, " n"], multiple: int) -> Bins | None:
    """Split heaviest multi-item bins until ``len(bins) % multiple == 0``; None if impossible."""
    target = -(-len(bins) // multiple) * multiple
    if sum(len(b) for b in bins) < target:
        return None
    bins = [list(b) for b in bins]
    # Max-heap of splittable bins by token sum; ties break by bin position for determinism.
    heap = [(-int(sizes[b].sum()), pos) for pos, b in enumerate(bins) if len(b) > 1]
    heapq.heapify(heap)
    while len(bins) < target:
        _, pos = heapq.heappop(heap)
        left, right = balanced_halves(bins[pos], sizes)
        bins[pos] = left
        bins.append(right)
        for p in (pos, len(bins) - 1):
            if len(bins[p]) > 1:
                heapq.heappush(heap, (-int(sizes[bins[p]].sum()), p))
    return bins


def karmarkar_karp_equal(weights: Float[np.ndarray, " k"], parts: int) -> list[list[int]]:
    """Partition positions of ``weights`` into ``parts`` sets of equal cardinality, balanced.

    Items sorted by weight are cut into rows of ``parts`` items; each row is a state of
    ``parts`` singleton sets. Largest differencing then repeatedly merges the two states with
    the largest spread, pairing the heaviest set of one with the lightest of the other, so every
    set keeps one item per row and all sets end with ``len(weights) / parts`` items.
    """
    count = len(weights)
    if count % parts:
        raise ValueError(f"{count} items cannot be split into {parts} equal parts")
    order = decreasing_order(weights)
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for row in range(count // parts):
        state = [(float(weights[i]), [i]) for i in order[row * parts:(row + 1) * parts]]
        state.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(state[0][0] - state[-1][0]), row, state))
    while len(heap) > 1:
        _, row_a, a = heapq.heappop(heap)
        _, row_b, b = heapq.heappop(heap)
        merged = [(a[j][0] + b[parts - 1 - j][0], a[j][1] + b[parts - 1 - j][1]) for j in range(parts)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), min(row_a, row_b), merged))
    return [sorted(items) for _, items in heap[0][2]] if heap else [[] for _ in range(parts)]


def strided(count: int, parts: int) -> list[list[int]]:
    """Round-robin: item ``j`` goes to part ``j % parts``."""
    return [list(range(p, count, parts)) for p in range(parts)]
