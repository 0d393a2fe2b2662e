"""numba twins of the scheduler kernels (``pip install 'vime[fast]'``); imported only on demand.

Never imported by ``import vime_pure``: ``vime_pure.scheduling.registry`` imports this module the
first time a schedule is built with numba installed, and numba compiles the kernels then, or
loads them from its on-disk cache (``cache=True``; measured here, CPU: 17-27 s for one
policy's kernels the first time, 43-49 s with the straggler balancer's, well under a second
afterwards; ``registry`` says why small batches never pay it).

Every kernel returns exactly what its pure-Python twin in ``vime_pure.scheduling.kernels``
returns, in the flat form ``(items, offsets)``: bin ``b`` holds ``items[offsets[b]:offsets[b+1]]``
in the pure kernel's order. The pure kernels stay the oracle: ``tests/property/
test_compiled_kernels.py`` asserts equality on random, tie-heavy inputs.

Example: ``ffd_flat(np.array([300, 800, 200, 700]), 1000)`` gives items ``[1, 2, 3, 0]`` and
offsets ``[0, 2, 4]``, the flat form of FFD's ``[[1, 2], [3, 0]]``.
"""

import contextlib
import fcntl
import heapq
import inspect
import os
import tempfile
import threading
import time

import numpy as np
from numba import njit

# numba's disk cache is not safe for two processes that compile different signatures of one
# function at once: each reads the function's index, both name their machine code data file 1,
# and a later load maps one signature to the other's code ("NRT_adapt_ndarray_to_python:
# 'descr' is NULL", or a wrong result). DP ranks building schedules on a fresh cache, or two
# pytest-xdist workers, do exactly that. So every compile or cache load of a vime kernel holds
# one file lock per user and machine: the second process waits, then loads what the first one
# wrote. The lock is the only I/O of the core besides numba's own cache.
COMPILE_LOCK = os.path.join(tempfile.gettempdir(), f"vime-numba-compile-{os.getuid()}.lock")
COMPILE_LOCK_WAIT_S = 900.0  # the slowest first compile measured is ~50 s (module docstring)
_lock_owner = threading.RLock()
_lock_depth = 0


@contextlib.contextmanager
def compile_lock():
    """Hold the kernels' cross-process compile lock (``COMPILE_LOCK``); re-entrant within a
    process (a compile types its callees, which compile under the same lock). Raises
    TimeoutError after ``COMPILE_LOCK_WAIT_S`` seconds, naming the file."""
    global _lock_depth
    path, wait_s = COMPILE_LOCK, COMPILE_LOCK_WAIT_S  # read now: a test points them elsewhere
    with _lock_owner:
        if _lock_depth:
            _lock_depth += 1
            try:
                yield
            finally:
                _lock_depth -= 1
            return
        with open(path, "a") as handle:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"waited {wait_s:.0f} s for {path}, the lock another process holds "
                            "while numba compiles vime's scheduler kernels. Fix: find that "
                            "process (`fuser` on the file) and let it finish or stop it; or set "
                            "VIME_KERNELS=pure.") from None
                    time.sleep(0.05)
            _lock_depth = 1
            try:
                yield
            finally:
                _lock_depth = 0  # closing the file releases the flock


def _compiled(fn, name: str | None = None):
    """``njit`` with numba's disk cache, every compile under ``compile_lock``. Under the tests'
    jaxtyping import hook ``fn`` arrives wrapped in a runtime type checker that numba can
    neither compile nor cache: unwrap it. ``name`` renames the function numba sees, so two
    closures of one ``def`` get their own cache files (numba names them by qualified name)."""
    py = inspect.unwrap(fn)
    if name is not None:
        py.__name__ = py.__qualname__ = name
    dispatcher = njit(cache=True)(py)
    plain = dispatcher.compile

    def compile_locked(sig):  # numba calls .compile for every new signature, Python or nopython
        with compile_lock():
            return plain(sig)

    dispatcher.compile = compile_locked  # type: ignore[method-assign]  # one dispatcher only
    return dispatcher


@_compiled
def _ffd_sorted(order, sorted_sizes, cap):
    n = len(order)
    items = np.empty(n, dtype=np.int64)
    offsets = np.empty(n + 1, dtype=np.int64)
    offsets[0] = 0
    nb, pos = 0, 0
    over = 0
    while over < n and sorted_sizes[over] > cap:
        items[pos] = order[over]
        pos += 1
        nb += 1
        offsets[nb] = pos
        over += 1
    neg = -sorted_sizes
    nxt = np.arange(n + 1)
    first = over
    while first < n:
        k = first
        while nxt[k] != k:
            nxt[k] = nxt[nxt[k]]
            k = nxt[k]
        if k == n:
            break
        nxt[k] = k + 1
        room = cap - sorted_sizes[k]
        items[pos] = order[k]
        pos += 1
        first = lo = k + 1
        while True:
            j = lo + np.searchsorted(neg[lo:], -room)  # first item with size <= room
            while nxt[j] != j:
                nxt[j] = nxt[nxt[j]]
                j = nxt[j]
            if j == n:
                break
            nxt[j] = j + 1
            room -= sorted_sizes[j]
            items[pos] = order[j]
            pos += 1
            lo = j + 1
        nb += 1
        offsets[nb] = pos
    return items, offsets[:nb + 1].copy()


def ffd_sorted_flat(order: np.ndarray, sorted_sizes: np.ndarray, cap: int):
    """``kernels.ffd_sorted`` in flat form."""
    return _ffd_sorted(np.asarray(order, dtype=np.int64),
                       np.asarray(sorted_sizes, dtype=np.int64), np.int64(cap))


def ffd_flat(sizes: np.ndarray, cap: int):
    """``kernels.first_fit_decreasing`` in flat form."""
    sizes = np.asarray(sizes, dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")
    return ffd_sorted_flat(order, sizes[order], cap)


@_compiled
def _group_by(bin_of, count):
    """Positions grouped by bin, each bin by position (``np.argsort(bin_of, kind="stable")``),
    and every bin's start (``count + 1`` offsets): a counting sort, O(n + count). Example:
    bin_of [1, 0, 1] gives [1, 0, 2] and [0, 1, 3]."""
    starts = np.zeros(count + 1, dtype=np.int64)
    for b in bin_of:
        starts[b + 1] += 1
    for b in range(count):
        starts[b + 1] += starts[b]
    fill = starts[:-1].copy()
    items = np.empty(len(bin_of), dtype=np.int64)
    for i in range(len(bin_of)):
        items[fill[bin_of[i]]] = i
        fill[bin_of[i]] += 1
    return items, starts


@_compiled
def _radix_order(keys):
    """Positions that sort the uint64 ``keys`` ascending, ties by position: an LSD radix sort,
    one stable counting pass per byte of the largest key (two for keys under 65536)."""
    n = len(keys)
    order = np.arange(n)
    spare = np.empty(n, dtype=np.int64)
    count = np.empty(257, dtype=np.int64)
    top = keys.max() if n else np.uint64(0)
    shift = np.uint64(0)
    while shift < np.uint64(64) and (top >> shift) > np.uint64(0):
        count[:] = 0
        for i in range(n):
            count[np.int64((keys[order[i]] >> shift) & np.uint64(255)) + 1] += 1
        for d in range(256):
            count[d + 1] += count[d]
        for i in range(n):
            d = np.int64((keys[order[i]] >> shift) & np.uint64(255))
            spare[count[d]] = order[i]
            count[d] += 1
        order, spare = spare, order
        shift += np.uint64(8)
    return order


@_compiled
def argsort_desc(values):
    """``np.argsort(-values, kind="stable")`` of int64s (largest first, ties by position) as a
    radix sort of ``max - value`` (exact in uint64): 39 us against numpy's 246 us on a
    4096-sample step (the sort was the largest part of FFD there). Example: [5, 9, 5, 1]
    gives [1, 0, 2, 3]."""
    keys = np.empty(len(values), dtype=np.uint64)
    if len(values):
        top = np.uint64(values.max())
        for i in range(len(values)):
            keys[i] = top - np.uint64(values[i])
    return _radix_order(keys)


@_compiled
def _radix_sorted(values):
    """``np.sort`` of int64s by the radix sort (no numba quicksort to compile beside it)."""
    keys = np.empty(len(values), dtype=np.uint64)
    if len(values):
        low = np.uint64(values.min())
        for i in range(len(values)):
            keys[i] = np.uint64(values[i]) - low
    return values[_radix_order(keys)]


@_compiled
def _sorted_ints(values):
    """``np.sort`` of int64s: an insertion sort up to 32 values (a Karmarkar-Karp part has a
    handful: the radix sort's 257 counters would cost more), else the radix sort. Example:
    [7, -2, 3] gives [-2, 3, 7]."""
    out = values.copy()
    _sort_by_value(out)
    return out


@_compiled
def _sort_by_value(region):
    """Sort the ints of ``region`` in place: insertion sort for the few items of a
    micro-batch (no allocation), a full sort for many."""
    k = len(region)
    if k > 32:
        region[:] = _radix_sorted(region)
        return
    for t in range(1, k):
        item = region[t]
        u = t - 1
        while u >= 0 and region[u] > item:
            region[u + 1] = region[u]
            u -= 1
        region[u + 1] = item


@_compiled
def _sort_by_size(region, sizes):
    """Sort ``region`` in place by (size descending, value), as ``_sort_by_value``."""
    k = len(region)
    if k > 32:
        region[:] = _radix_sorted(region)
        region[:] = region[argsort_desc(sizes[region])]
        return
    for t in range(1, k):
        item = region[t]
        u = t - 1
        while u >= 0:
            other = region[u]
            if not (sizes[other] < sizes[item] or (sizes[other] == sizes[item]
                                                    and other > item)):
                break
            region[u + 1] = other
            u -= 1
        region[u + 1] = item


@_compiled
def _split_to_count(items, offsets, sizes, target):
    # Every bin is a range of one buffer. The first time a bin is split its range is sorted by
    # (size descending, position), the order ``kernels._halves`` deals; its halves are then
    # written back as two adjacent ranges, each still in that order, so no half is ever sorted
    # again and nothing is allocated per split. Split bins are sorted by position at the end.
    # This deals exactly as ``kernels._halves``, which re-sorts the half it splits every time.
    nbins = len(offsets) - 1
    buf = items.copy()
    start = np.empty(target, dtype=np.int64)
    count = np.empty(target, dtype=np.int64)
    total = np.empty(target, dtype=np.int64)
    dealt = np.zeros(target, dtype=np.bool_)
    heap = [(np.int64(0), np.int64(0)) for _ in range(0)]
    for b in range(nbins):
        start[b], count[b] = offsets[b], offsets[b + 1] - offsets[b]
        total[b] = sizes[buf[start[b]:start[b] + count[b]]].sum()
        if count[b] > 1:
            heap.append((-total[b], np.int64(b)))
    heapq.heapify(heap)
    tmp = np.empty(len(items), dtype=np.int64)
    for new in range(nbins, target):
        b = heapq.heappop(heap)[1]
        lo, k = start[b], count[b]
        region = buf[lo:lo + k]
        if not dealt[b]:
            _sort_by_size(region, sizes)
        s0, s1, n0, n1 = 0, 0, 0, 0
        for t in range(k):
            item = region[t]
            if s0 <= s1:
                region[n0] = item
                n0 += 1
                s0 += sizes[item]
            else:
                tmp[n1] = item
                n1 += 1
                s1 += sizes[item]
        region[n0:] = tmp[:n1]
        count[b], total[b], dealt[b] = n0, s0, True
        start[new], count[new], total[new], dealt[new] = lo + n0, n1, s1, True
        for q in (b, new):
            if count[q] > 1:
                heapq.heappush(heap, (-total[q], np.int64(q)))
    out_offsets = np.zeros(target + 1, dtype=np.int64)
    out_offsets[1:] = np.cumsum(count)
    out = np.empty(out_offsets[-1], dtype=np.int64)
    for b in range(target):
        seg = out[out_offsets[b]:out_offsets[b + 1]]
        seg[:] = buf[start[b]:start[b] + count[b]]
        if dealt[b]:
            _sort_by_value(seg)
    return out, out_offsets


def split_to_count_flat(items: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, target: int):
    """``kernels.split_to_count`` in flat form; None when there are fewer than ``target``
    items. Bins already at ``target`` or more come back unchanged."""
    if len(items) < target:
        return None
    if len(offsets) - 1 >= target:
        return items, offsets
    return _split_to_count(np.asarray(items, dtype=np.int64), np.asarray(offsets, dtype=np.int64),
                           np.asarray(sizes, dtype=np.int64), np.int64(target))


@_compiled
def _karmarkar_karp(values, order, parts):
    rows = len(values) // parts
    # Sets: one per item at first; a state is a row of ``parts`` set ids, heaviest first.
    load = np.empty(len(values), dtype=np.float64)
    nxt = np.full(len(values), -1, dtype=np.int64)  # linked list of each set's items
    tail = np.arange(len(values))
    state = np.empty((rows, parts), dtype=np.int64)
    heap = []
    for r in range(rows):
        for j in range(parts):
            i = order[r * parts + j]
            state[r, j] = i
            load[i] = values[i]
        heap.append((-(load[state[r, 0]] - load[state[r, parts - 1]]), r, r))
    heapq.heapify(heap)
    merged = np.empty(parts, dtype=np.int64)
    loads = np.empty(parts, dtype=np.float64)
    while len(heap) > 1:
        _, key_a, a = heapq.heappop(heap)
        _, key_b, b = heapq.heappop(heap)
        for j in range(parts):
            x, y = state[a, j], state[b, parts - 1 - j]
            load[x] = load[x] + load[y]
            nxt[tail[x]] = y
            tail[x] = tail[y]
            merged[j] = x
            loads[j] = load[x]
        by = np.argsort(-loads, kind="mergesort")
        for j in range(parts):
            state[a, j] = merged[by[j]]
        key = min(key_a, key_b)
        heapq.heappush(heap, (-(load[state[a, 0]] - load[state[a, parts - 1]]), key, a))
    final = heap[0][2]
    out = np.empty((parts, rows), dtype=np.int64)
    for j in range(parts):
        t, i = 0, state[final, j]
        while i != -1:
            out[j, t] = i
            t += 1
            i = nxt[i]
        out[j] = _sorted_ints(out[j])
    return out


def karmarkar_karp_parts(weights: np.ndarray, parts: int) -> np.ndarray:
    """``kernels.karmarkar_karp_equal`` as a ``[parts, len(weights) // parts]`` array."""
    values = np.asarray(weights, dtype=np.float64)
    if len(values) % parts:
        raise ValueError(f"{len(values)} items cannot be split into {parts} equal parts")
    if not len(values):
        return np.zeros((parts, 0), dtype=np.int64)
    order = np.argsort(-values, kind="stable")
    return _karmarkar_karp(values, order.astype(np.int64), np.int64(parts))


@_compiled
def _heap_push(keys, index, size, key, i):
    """Push ``(key, i)`` onto the binary min-heap in ``keys[:size]``, ``index[:size]``
    (ordered like tuples: key, then index); returns the new size."""
    pos = size
    while pos > 0:
        parent = (pos - 1) // 2
        if keys[parent] < key or (keys[parent] == key and index[parent] < i):
            break
        keys[pos], index[pos] = keys[parent], index[parent]
        pos = parent
    keys[pos], index[pos] = key, i
    return size + 1


@_compiled
def _heap_pop(keys, index, size):
    """Remove the heap's minimum; returns its index and the new size."""
    top = index[0]
    size -= 1
    key, i = keys[size], index[size]
    pos = 0
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        if child + 1 < size and (keys[child + 1] < keys[child] or (
                keys[child + 1] == keys[child] and index[child + 1] < index[child])):
            child += 1
        if keys[child] < key or (keys[child] == key and index[child] < i):
            keys[pos], index[pos] = keys[child], index[child]
            pos = child
        else:
            break
    if size > 0:
        keys[pos], index[pos] = key, i
    return top, size


@_compiled
def _flops_pack(order, sizes, work, cap, num_bins, limit):
    # Two array heaps, as ``heapq`` keeps them in the pure kernel: every bin is in at most one
    # of them once, so (key, bin) entries are unique and any correct heap pops the same bin.
    # ``limit``: give up as soon as more than ``limit`` bins are non-empty (bins never empty
    # again, so the result would have more): returns no items and ``limit + 2`` offsets, i.e.
    # ``limit + 1`` bins, which a caller comparing the count with ``limit`` rejects. The planner
    # passes FFD's aligned count (a larger result is discarded for FFD's bins), which stops E's
    # steps after a quarter of their samples; ``flops_pack_flat`` passes no effective limit.
    n = len(order)
    most = num_bins + n
    room = np.full(most, cap, dtype=np.int64)
    load = np.zeros(most, dtype=np.float64)
    bin_of = np.empty(n, dtype=np.int64)
    count = num_bins
    active_key = np.empty(most, dtype=np.float64)  # (load, bin): least-loaded, lowest index
    active_bin = np.arange(most)
    active_key[:num_bins] = 0.0
    active = num_bins  # all zero keys in index order: already a heap
    parked_key = np.empty(most, dtype=np.int64)  # (-room, bin) of bins lacking room
    parked_bin = np.empty(most, dtype=np.int64)
    parked = np.int64(0)  # not a literal: one _heap_pop signature
    fresh = np.ones(most, dtype=np.bool_)  # bins holding nothing yet
    nonempty = 0
    for i in order:
        size = sizes[i]
        if size > cap:
            bin_of[i] = count
            room[count] = -1
            load[count] = work[i]
            count += 1
            nonempty += 1
            if nonempty > limit:
                return np.zeros(0, dtype=np.int64), np.zeros(limit + 2, dtype=np.int64)
            continue
        while parked and -parked_key[0] >= size:
            b, parked = _heap_pop(parked_key, parked_bin, parked)
            active = _heap_push(active_key, active_bin, active, load[b], b)
        while active and room[active_bin[0]] < size:
            b, active = _heap_pop(active_key, active_bin, active)
            parked = _heap_push(parked_key, parked_bin, parked, -room[b], b)
        if active:
            best, active = _heap_pop(active_key, active_bin, active)
        else:
            best = count
            count += 1
        if fresh[best]:
            fresh[best] = False
            nonempty += 1
            if nonempty > limit:
                return np.zeros(0, dtype=np.int64), np.zeros(limit + 2, dtype=np.int64)
        bin_of[i] = best
        room[best] -= size
        load[best] += work[i]
        active = _heap_push(active_key, active_bin, active, load[best], best)
    items, starts = _group_by(bin_of, count)  # by bin, each bin by position
    offsets = np.empty(count + 1, dtype=np.int64)
    offsets[0], used = 0, 0
    for b in range(count):
        if starts[b + 1] > starts[b]:  # unused parked bins are dropped, as the pure kernel does
            used += 1
            offsets[used] = starts[b + 1]
    return items, offsets[:used + 1].copy()


def flops_pack_flat(sizes: np.ndarray, work: np.ndarray, cap: int, num_bins: int):
    """``kernels.flops_balanced_pack`` in flat form."""
    work = np.asarray(work, dtype=np.float64)
    order = np.argsort(-work, kind="stable").astype(np.int64)
    return _flops_pack(order, np.asarray(sizes, dtype=np.int64), work, np.int64(cap),
                       np.int64(num_bins), np.int64(num_bins + len(order)))


@_compiled
def _sorted_by(key, order):
    """Whether ``order`` is ``np.argsort(-key, kind="stable")``: ``key`` non-increasing along
    it, ties by increasing position (that order is unique, so this is exact; a NaN fails).
    O(n), against O(n log n) for the sort: FLOPs that grow with length (every ``FlopsModel``)
    give FFD's size order back, so FLOPs packing reuses it. Example: key [3., 5., 3.],
    order [1, 0, 2] gives True; order [1, 2, 0] gives False."""
    for k in range(len(order) - 1):
        a, b = key[order[k]], key[order[k + 1]]
        if not (a > b or (a == b and order[k] < order[k + 1])):
            return False
    return True


@_compiled
def _lpt_ranks(work, bounds, dp):
    # A binary heap of (load, rank) in two arrays: its minimum is unique (ranks differ), so
    # it picks what ``heapq`` picks, without tuple lists.
    ranks = np.empty(len(work), dtype=np.int64)
    heap_load = np.empty(dp, dtype=np.float64)
    heap_rank = np.empty(dp, dtype=np.int64)
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        heap_load[:] = 0.0
        heap_rank[:] = np.arange(dp)
        order = lo + np.argsort(-work[lo:hi], kind="mergesort")
        for i in order:
            ranks[i] = heap_rank[0]
            load, rank = heap_load[0] + work[i], heap_rank[0]
            pos = 0
            while True:  # sift the root down
                child = 2 * pos + 1
                if child >= dp:
                    break
                if child + 1 < dp and (heap_load[child + 1] < heap_load[child] or (
                        heap_load[child + 1] == heap_load[child]
                        and heap_rank[child + 1] < heap_rank[child])):
                    child += 1
                if heap_load[child] < load or (heap_load[child] == load
                                               and heap_rank[child] < rank):
                    heap_load[pos], heap_rank[pos] = heap_load[child], heap_rank[child]
                    pos = child
                else:
                    break
            heap_load[pos], heap_rank[pos] = load, rank
    return ranks


def lpt_ranks(work: np.ndarray, bounds: np.ndarray, dp: int) -> np.ndarray:
    """``rank_balance.lpt_ranks``: per step, each sample (heaviest first) to the lightest rank."""
    return _lpt_ranks(np.asarray(work, dtype=np.float64), np.asarray(bounds, dtype=np.int64),
                      np.int64(dp))


@_compiled
def _first_fit(sizes, cap):
    # The pure kernel's max-segment tree over bin rooms, same bound on the bins it can open.
    n = len(sizes)
    fitting_count, fitting_sum = 0, 0
    for i in range(n):
        if sizes[i] <= cap:
            fitting_count += 1
            fitting_sum += sizes[i]
    bound = min(fitting_count, 2 * fitting_sum // cap + 2) if fitting_count else 1
    leaves, width = 1, max(bound - 1, 0)
    while width:
        leaves <<= 1
        width >>= 1
    tree = np.full(2 * leaves, cap, dtype=np.int64)
    slot = np.full(leaves, -1, dtype=np.int64)  # tree leaf -> bin number
    bin_of = np.empty(n, dtype=np.int64)
    opened, used_leaves = 0, 0
    for i in range(n):
        s = sizes[i]
        if s > cap:
            bin_of[i] = opened
            opened += 1
            continue
        node = 1
        while node < leaves:
            node <<= 1
            if tree[node] < s:
                node += 1
        leaf = node - leaves
        if leaf == used_leaves:
            slot[leaf] = opened
            opened += 1
            used_leaves += 1
        bin_of[i] = slot[leaf]
        tree[node] -= s
        node >>= 1
        while node:
            best = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == best:
                break
            tree[node] = best
            node >>= 1
    return _group_by(bin_of, opened)  # by bin, then position; every opened bin holds an item


def first_fit_flat(sizes: np.ndarray, cap: int):
    """``kernels.first_fit`` in flat form."""
    return _first_fit(np.asarray(sizes, dtype=np.int64), np.int64(cap))
