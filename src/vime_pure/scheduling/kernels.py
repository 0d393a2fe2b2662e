"""Packing, alignment and partitioning kernels of the scheduler, all O(N log N) or better.

All kernels work on integer/float arrays of one step and return bins as lists of positions
into those arrays. They are deterministic: ties break by position. Their outputs are defined by
the plain textbook algorithms (kept, deliberately naive, in ``benchmarks/reference.py`` as the
property-test oracle); the fast versions here return the same bins in the same order.

- ``first_fit(sizes, cap)``: items in positional order, each into the first bin with room; an
  item larger than ``cap`` gets a bin of its own that nothing else joins. A max-segment tree over
  bin rooms finds "the first bin with room" in O(log B).
- ``first_fit_decreasing(sizes, cap)``: first-fit over items sorted by size, largest first (ties
  by position). First-fit equals "fill bin 1 by scanning the items in order and taking every item
  that still fits, then bin 2 with the rest, ...". With items sorted, "the next item that fits"
  is a bisection plus a skip over taken items (a union-find "next free" list), so each item costs
  O(log N) in C plus amortised O(1) in Python.
- ``flops_balanced_pack(sizes, work, cap, num_bins)``: LPT by ``work`` into ``num_bins`` bins,
  each item into the least-loaded bin that still has token room (a heap); a new bin opens only
  when none has room. The token cap holds (oversize items are singletons).
- ``split_to_multiple(bins, sizes, multiple)``: split the heaviest multi-item bins (a heap) into
  size-balanced halves until the bin count is a multiple of ``multiple``.
- ``karmarkar_karp_equal(weights, parts)``: largest differencing with equal cardinality.
- ``lpt_partition(weights, parts)``: greedy longest-processing-time with a heap.
- ``strided(count, parts)``: round-robin.
"""

import heapq
from bisect import bisect_left

import numpy as np
from jaxtyping import Float, Int, Shaped

Bins = list[list[int]]


def decreasing_order(sizes: Shaped[np.ndarray, " n"]) -> list[int]:
    """Positions sorted by size, largest first; ties keep positional order."""
    return np.argsort(-np.asarray(sizes), kind="stable").tolist()


def ffd_sorted(order: list[int], sorted_sizes: list[int], cap: int) -> Bins:
    """FFD of items already sorted by size, largest first: ``sorted_sizes[k]`` is the size of
    item ``order[k]``. Returns bins of items (values of ``order``) in FFD's opening order."""
    n = len(order)
    over = 0  # oversize items come first in decreasing order and each sits alone
    while over < n and sorted_sizes[over] > cap:
        over += 1
    bins: Bins = [[order[k]] for k in range(over)]
    neg = [-s for s in sorted_sizes]  # ascending, for bisect
    nxt = list(range(n + 1))  # nxt[k] == k: item k is free; else a pointer towards the next free
    first = over
    while first < n:
        k = first  # the largest free item opens the next bin
        while nxt[k] != k:
            nxt[k] = nxt[nxt[k]]
            k = nxt[k]
        if k == n:
            break
        nxt[k] = k + 1
        room = cap - sorted_sizes[k]
        current = [order[k]]
        first = lo = k + 1
        while True:
            j = bisect_left(neg, -room, lo)  # first item with size <= room
            while nxt[j] != j:  # skip taken items (path halving)
                nxt[j] = nxt[nxt[j]]
                j = nxt[j]
            if j == n:
                break
            nxt[j] = j + 1
            room -= sorted_sizes[j]
            current.append(order[j])
            lo = j + 1
        bins.append(current)
    return bins


def first_fit_decreasing(sizes: Int[np.ndarray, " n"], cap: int) -> Bins:
    """First-fit-decreasing of ``sizes`` under ``cap``. Example: sizes [300, 800, 200, 700],
    cap 1000 gives bins [[1, 2], [3, 0]] (800+200, 700+300)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")
    return ffd_sorted(order.tolist(), sizes[order].tolist(), cap)


def first_fit(sizes: Int[np.ndarray, " n"], cap: int) -> Bins:
    """First-fit of ``sizes`` in positional order under ``cap``. Example: sizes [300, 800, 200,
    700], cap 1000 gives [[0, 2], [1], [3]]."""
    values = np.asarray(sizes, dtype=np.int64).tolist()
    fitting = [s for s in values if s <= cap]
    # First-fit leaves at most one bin at most half full, so it opens <= 2*sum/cap + 1 bins.
    bound = min(len(fitting), 2 * sum(fitting) // cap + 2) if fitting else 1
    leaves = 1 << max(bound - 1, 0).bit_length()
    tree = [cap] * (2 * leaves)  # max room per subtree; unopened bins have full room
    bins: Bins = []
    slot: list[int] = []  # tree leaf -> index in ``bins``
    for i, s in enumerate(values):
        if s > cap:
            bins.append([i])
            continue
        node = 1
        while node < leaves:  # descend to the leftmost leaf with room >= s
            node <<= 1
            if tree[node] < s:
                node += 1
        leaf = node - leaves
        if leaf == len(slot):
            slot.append(len(bins))
            bins.append([i])
        else:
            bins[slot[leaf]].append(i)
        tree[node] -= s
        node >>= 1
        while node:
            best = tree[2 * node] if tree[2 * node] > tree[2 * node + 1] else tree[2 * node + 1]
            if tree[node] == best:
                break
            tree[node] = best
            node >>= 1
    return bins


def flops_balanced_pack(
    sizes: Int[np.ndarray, " n"], work: Float[np.ndarray, " n"], cap: int, num_bins: int
) -> Bins:
    """Spread ``work`` evenly over ``num_bins`` bins without breaking the token ``cap``.
    Returns the non-empty bins, each sorted by position.

    Bins too full for the current item are parked in a max-heap by room and come back as soon
    as an item fits, so each item costs O(log B) amortised when work grows with size (it does
    for every FLOPs model), instead of a scan past every full bin.
    """
    size_list = np.asarray(sizes, dtype=np.int64).tolist()
    work_list = np.asarray(work, dtype=np.float64).tolist()
    bins: Bins = [[] for _ in range(num_bins)]
    room = [cap] * num_bins
    load = [0.0] * num_bins
    active = [(0.0, b) for b in range(num_bins)]  # (load, bin): least-loaded, lowest index
    parked: list[tuple[int, int]] = []  # (-room, bin) of bins that lacked room
    push, pop = heapq.heappush, heapq.heappop
    for i in decreasing_order(work):
        size = size_list[i]
        if size > cap:
            bins.append([i])
            room.append(-1)
            load.append(work_list[i])
            continue
        while parked and -parked[0][0] >= size:
            b = pop(parked)[1]
            push(active, (load[b], b))
        while active and room[active[0][1]] < size:
            b = pop(active)[1]
            push(parked, (-room[b], b))
        if active:
            best = pop(active)[1]
        else:
            best = len(bins)
            bins.append([])
            room.append(cap)
            load.append(0.0)
        bins[best].append(i)
        room[best] -= size
        load[best] += work_list[i]
        push(active, (load[best], best))
    return [sorted(b) for b in bins if b]


def balanced_halves(items: list[int], sizes: Int[np.ndarray, " n"]) -> tuple[list[int], list[int]]:
    """Split ``items`` into two non-empty halves with near-equal size sums (greedy LPT).
    Example: sizes 500, 400, 300, 200 split into [500, 200] and [400, 300]."""
    return _halves(items, sizes.tolist())


def _halves(items: list[int], size_list: list[int]) -> tuple[list[int], list[int]]:
    halves: tuple[list[int], list[int]] = ([], [])
    sums = [0, 0]
    for i in sorted(items, key=lambda j: (-size_list[j], j)):
        side = 0 if sums[0] <= sums[1] else 1
        halves[side].append(i)
        sums[side] += size_list[i]
    return sorted(halves[0]), sorted(halves[1])


def split_to_multiple(bins: Bins, sizes: Int[np.ndarray, " n"], multiple: int) -> Bins | None:
    """Split heaviest multi-item bins until ``len(bins) % multiple == 0``; None if impossible."""
    return split_to_count(bins, sizes, -(-len(bins) // multiple) * multiple)


def split_to_count(bins: Bins, sizes: Int[np.ndarray, " n"], target: int) -> Bins | None:
    """Split the heaviest multi-item bins (by token sum) until there are ``target`` bins, each
    into token-balanced halves; ties break by bin position. None when there are fewer than
    ``target`` items. Example: bins [[0, 1], [2]] with sizes [5, 4, 6] and target 3 give
    [[0], [2], [1]]."""
    if sum(map(len, bins)) < target:
        return None
    bins = list(bins)  # halves are new lists: the caller's bins are never mutated
    if len(bins) >= target:
        return bins
    size_list = np.asarray(sizes).tolist()
    get = size_list.__getitem__
    heap = [(-sum(map(get, b)), pos) for pos, b in enumerate(bins) if len(b) > 1]
    heapq.heapify(heap)
    while len(bins) < target:
        _, pos = heapq.heappop(heap)
        left, right = _halves(bins[pos], size_list)
        bins[pos] = left
        bins.append(right)
        for p in (pos, len(bins) - 1):
            if len(bins[p]) > 1:
                heapq.heappush(heap, (-sum(map(get, bins[p])), p))
    return bins


def karmarkar_karp_equal(weights: Float[np.ndarray, " k"], parts: int) -> list[list[int]]:
    """Partition positions of ``weights`` into ``parts`` sets of equal cardinality, balanced.

    Items sorted by weight are cut into rows of ``parts`` items; each row is a state of
    ``parts`` singleton sets. Largest differencing then repeatedly merges the two states with
    the largest spread, pairing the heaviest set of one with the lightest of the other, so every
    set keeps one item per row and all sets end with ``len(weights) / parts`` items.
    Example: weights [8, 7, 6, 5, 4, 3], parts 2 gives sums 17 and 16.
    """
    count = len(weights)
    if count % parts:
        raise ValueError(f"{count} items cannot be split into {parts} equal parts")
    order = decreasing_order(weights)
    values = np.asarray(weights, dtype=np.float64).tolist()
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for row in range(count // parts):
        state = [(values[i], [i]) for i in order[row * parts:(row + 1) * parts]]
        heapq.heappush(heap, (-(state[0][0] - state[-1][0]), row, state))
    return largest_differencing(heap, parts)


State = list[tuple[float, list[int]]]  # ``parts`` (load, items) sets, heaviest first


def largest_differencing(heap: list[tuple[float, int, State]], parts: int) -> list[list[int]]:
    """Merge states until one is left; ``heap`` holds ``(-spread, key, state)`` entries.

    Each merge pairs the heaviest set of one state with the lightest of the other; the merged
    state keeps the smaller key, so ties break by position. Returns the final sets' sorted items
    (``parts`` empty sets for an empty heap).
    """
    while len(heap) > 1:
        _, key_a, a = heapq.heappop(heap)
        _, key_b, b = heapq.heappop(heap)
        merged = [(a[j][0] + b[parts - 1 - j][0], a[j][1] + b[parts - 1 - j][1])
                  for j in range(parts)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), min(key_a, key_b), merged))
    return [sorted(items) for _, items in heap[0][2]] if heap else [[] for _ in range(parts)]


def lpt_partition(weights: Float[np.ndarray, " k"], parts: int) -> list[list[int]]:
    """Greedy LPT: heaviest item first, each to the least-loaded part (lowest index on ties).
    Counts may differ between parts. Example: [5, 4, 3, 3, 3], 2 parts gives {5, 3}, {4, 3, 3}."""
    values = np.asarray(weights, dtype=np.float64).tolist()
    heap = [(0.0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in decreasing_order(weights):
        load, p = heap[0]
        out[p].append(i)
        heapq.heapreplace(heap, (load + values[i], p))
    return [sorted(items) for items in out]


def strided(count: int, parts: int) -> list[list[int]]:
    """Round-robin: item ``j`` goes to part ``j % parts``."""
    return [list(range(p, count, parts)) for p in range(parts)]
