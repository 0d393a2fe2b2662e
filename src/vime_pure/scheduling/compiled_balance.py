"""numba twin of ``rank_balance.balance_step`` (``balance="straggler"``), imported on demand.

Same algorithm, step by step, as the pure oracle in ``vime_pure.scheduling.rank_balance``:
LPT bins per rank (or FFD), equalise the counts (trim, place the pool, eject, split), refine
by moves and swaps. The tie rules are the oracle's: stable sorts, the first minimum or maximum,
heaps keyed by ``(value, index)``, float sums left to right in the same order (per bin, then
over the rank's bins), so both return the same bins in the same order (property-tested in
``tests/property/test_compiled_kernels.py`` on tie-heavy inputs). A bin is an int64 array; a
rank is a list of bins; a change builds a new array, as the oracle builds a new list.

Example: ``balance_step_flat(order, ranks, sizes, work, cap, dp, multiple)`` returns
``((items, offsets), m)`` with ``dp * m`` bins rank by rank, or None when the step is too small.
"""

import heapq

import numpy as np

from vime_pure.scheduling.compiled_kernels import (_compiled, _ffd_sorted, _sorted_ints,
                                                   _split_to_count)
from vime_pure.scheduling.rank_balance import (EXTRA_GROUP_THRESHOLD, REFINE_CANDIDATES,
                                               REFINE_PARTNERS, REFINE_TOLERANCE, first_count)


@_compiled
def _empty_rank():
    return [np.empty(0, dtype=np.int64) for _ in range(0)]


@_compiled
def _tokens(b, sizes):
    total = 0
    for i in b:
        total += sizes[i]
    return total


@_compiled
def _load(bins, work):
    acc = 0.0
    for b in bins:
        part = 0.0
        for i in b:
            part += work[i]
        acc += part
    return acc


@_compiled
def _without(b, x):
    return b[b != x].copy()


@_compiled
def _with(b, x):
    out = np.empty(len(b) + 1, dtype=np.int64)
    out[:len(b)] = b
    out[len(b)] = x
    return out


@_compiled
def _lpt_bins(items, item_sizes, m, cap):
    """``rank_balance.lpt_bins``; an empty list for its None."""
    out = _empty_rank()
    if len(items) < m:
        return out
    bins = [[np.int64(0) for _ in range(0)] for _ in range(m)]
    heap = [(np.int64(0), np.int64(j)) for j in range(m)]
    for k in range(len(items)):
        tokens, j = heap[0]
        if tokens != 0 and tokens + item_sizes[k] > cap:
            return out
        bins[j].append(items[k])
        heapq.heapreplace(heap, (tokens + item_sizes[k], j))
    for j in range(m):
        out.append(np.array(bins[j], dtype=np.int64))
    return out


@_compiled
def _pack_ranks(order, cuts, sizes, m, cap):
    per_rank = []
    for r in range(len(cuts) - 1):
        items = order[cuts[r]:cuts[r + 1]].copy()
        item_sizes = sizes[items]
        bins = _empty_rank()
        if item_sizes.sum() <= m * cap:
            bins = _lpt_bins(items, item_sizes, m, cap)
        if not len(bins):
            flat, offsets = _ffd_sorted(items, item_sizes, cap)
            for b in range(len(offsets) - 1):
                bins.append(flat[offsets[b]:offsets[b + 1]].copy())
        per_rank.append(bins)
    return per_rank


@_compiled
def _split_rank(bins, sizes, m):
    """``kernels.split_to_count`` of one rank's bins; an empty list for its None."""
    lens = np.array([len(b) for b in bins], dtype=np.int64)
    if lens.sum() < m:
        return _empty_rank()
    if len(bins) >= m:
        return bins
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lens)
    items = np.empty(offsets[-1], dtype=np.int64)
    for j in range(len(bins)):
        items[offsets[j]:offsets[j + 1]] = bins[j]
    flat, out_offsets = _split_to_count(items, offsets, sizes, np.int64(m))
    out = _empty_rank()
    for j in range(len(out_offsets) - 1):
        out.append(flat[out_offsets[j]:out_offsets[j + 1]].copy())
    return out


@_compiled
def _eject(slot_of, room, size, sizes, cap):
    """The smallest placed item lighter than ``size`` whose removal makes room (lowest
    position on ties), or -1."""
    if size > cap:
        return -1
    best = -1
    for i in range(len(sizes)):
        s = slot_of[i]
        if s >= 0 and sizes[i] < size and room[s] + sizes[i] >= size:
            if best < 0 or sizes[i] < sizes[best]:
                best = i
    return best


@_compiled
def _place(ranks, pool, m, sizes, work, cap):
    ref_r = [np.int64(0) for _ in range(0)]
    ref_j = [np.int64(0) for _ in range(0)]
    room_list = [np.int64(0) for _ in range(0)]
    slot_of = np.full(len(sizes), -1, dtype=np.int64)
    for r in range(len(ranks)):
        for j in range(len(ranks[r])):
            for i in ranks[r][j]:
                slot_of[i] = len(ref_r)
            ref_r.append(r)
            ref_j.append(j)
            room_list.append(cap - _tokens(ranks[r][j], sizes))
    room = np.array(room_list, dtype=np.int64)
    load = np.array([_load(bins, work) for bins in ranks])
    queue = [(-sizes[i], i) for i in pool]
    heapq.heapify(queue)
    while len(queue):
        neg, i = heapq.heappop(queue)
        size = -neg
        slot = -1
        if size <= cap:
            for q in range(len(ref_r)):
                if room[q] >= size and (slot < 0 or load[ref_r[q]] < load[ref_r[slot]]):
                    slot = q
        if slot >= 0:
            r, j = ref_r[slot], ref_j[slot]
            ranks[r][j] = _with(ranks[r][j], i)
            room[slot] -= size
        else:
            r = -1
            for q in range(len(ranks)):
                if len(ranks[q]) < m and (r < 0 or load[q] < load[r]):
                    r = q
            if r >= 0:
                ranks[r].append(np.array([i], dtype=np.int64))
                slot = len(ref_r)
                ref_r.append(r)
                ref_j.append(len(ranks[r]) - 1)
                grown = np.empty(len(room) + 1, dtype=np.int64)
                grown[:len(room)] = room
                grown[len(room)] = cap - size
                room = grown
            else:
                y = _eject(slot_of, room, size, sizes, cap)
                if y < 0:
                    return False
                slot = slot_of[y]
                r, j = ref_r[slot], ref_j[slot]
                ranks[r][j] = _with(_without(ranks[r][j], y), i)
                room[slot] -= size - sizes[y]
                load[r] -= work[y]
                slot_of[y] = -1
                heapq.heappush(queue, (-sizes[y], y))
        slot_of[i] = slot
        load[r] += work[i]
    return True


@_compiled
def _equalise(per_rank, m, sizes, work, cap):
    """``rank_balance._equalise``; (False, ranks) for its None."""
    ranks = []
    pool = [np.int64(0) for _ in range(0)]
    for bins in per_rank:
        kept = _empty_rank()
        if len(bins) > m:
            tokens = np.array([_tokens(b, sizes) for b in bins], dtype=np.int64)
            by = np.argsort(-tokens, kind="mergesort")
            for k in range(len(by)):
                if k < m:
                    kept.append(bins[by[k]])
                else:
                    for i in bins[by[k]]:
                        pool.append(i)
        else:
            for b in bins:
                kept.append(b)
        ranks.append(kept)
    if len(pool) and not _place(ranks, pool, m, sizes, work, cap):
        return False, ranks
    for r in range(len(ranks)):
        if len(ranks[r]) < m:
            split = _split_rank(ranks[r], sizes, m)
            if not len(split):
                return False, ranks
            ranks[r] = split
    return True, ranks


@_compiled
def _items(bins, sizes):
    count = np.array([len(b) for b in bins], dtype=np.int64)
    tokens = np.array([_tokens(b, sizes) for b in bins], dtype=np.int64)
    item = np.empty(count.sum(), dtype=np.int64)
    slot = np.empty(count.sum(), dtype=np.int64)
    k = 0
    for j in range(len(bins)):
        for i in bins[j]:
            item[k] = i
            slot[k] = j
            k += 1
    return item, slot, tokens, count


@_compiled
def _nearest(key):
    return _sorted_ints(np.argsort(key, kind="mergesort")[:REFINE_CANDIDATES])


@_compiled
def _best_exchange(heavy, light, sizes, work, cap, gap):
    """``rank_balance._best_exchange``: (found, heavy bin, x, light bin, y or -1, delta)."""
    ia, sa, ta, ca = _items(heavy, sizes)
    ib, sb, tb, cb = _items(light, sizes)
    wa, wb = work[ia], work[ib]
    half = gap / 2
    if len(ia) > REFINE_CANDIDATES:
        keep = _nearest(np.abs(wa - half))
        ia, sa, wa = ia[keep], sa[keep], wa[keep]
    if len(ib) > REFINE_CANDIDATES:
        keep = _nearest(wb)
        ib, sb, wb = ib[keep], sb[keep], wb[keep]
    za, zb = sizes[ia], sizes[ib]
    best, bx, by = np.inf, -1, -1
    for x in range(len(ia)):
        single_a = ca[sa[x]] == 1
        for y in range(len(ib)):
            delta = wa[x] - wb[y]
            if not (delta > 0 and delta < gap):
                continue
            if not (ta[sa[x]] - za[x] + zb[y] <= cap or single_a):
                continue
            if not (tb[sb[y]] - zb[y] + za[x] <= cap or cb[sb[y]] == 1):
                continue
            score = abs(delta - half)
            if score < best:
                best, bx, by = score, x, y
    target = np.argmax(cap - tb)
    room = cap - tb[target]
    move, mx = np.inf, -1
    for x in range(len(ia)):
        if ca[sa[x]] > 1 and za[x] <= room and wa[x] < gap and wa[x] > 0:
            score = abs(wa[x] - half)
            if score < move:
                move, mx = score, x
    if mx >= 0 and move <= best:
        return True, sa[mx], ia[mx], np.int64(target), np.int64(-1), wa[mx]
    if bx < 0:
        return False, np.int64(0), np.int64(0), np.int64(0), np.int64(0), 0.0
    return True, sa[bx], ia[bx], sb[by], ib[by], wa[bx] - wb[by]


@_compiled
def _refine(ranks, sizes, work, cap):
    """``rank_balance._refine`` (in place); the final straggler ratio."""
    load = np.array([_load(bins, work) for bins in ranks])
    mean = 0.0
    for value in load:
        mean += value
    mean /= len(load)
    heaviest = max(work.max(), 0.0) if len(work) else 0.0
    bound = max(mean, heaviest)
    budget = 2 * len(ranks)
    while budget > 0:
        a = np.argmax(load)
        if load[a] <= bound * (1 + REFINE_TOLERANCE):
            break
        found, b = False, -1
        ja, xa, jb, xb, delta = np.int64(0), np.int64(0), np.int64(0), np.int64(0), 0.0
        for partner in np.argsort(load, kind="mergesort")[:REFINE_PARTNERS]:
            budget -= 1
            if partner != a:
                found, ja, xa, jb, xb, delta = _best_exchange(
                    ranks[a], ranks[partner], sizes, work, cap, load[a] - load[partner])
                if found:
                    b = partner
                    break
        if not found:
            break
        ranks[a][ja] = _without(ranks[a][ja], xa)
        ranks[b][jb] = _with(ranks[b][jb], xa)
        if xb >= 0:
            ranks[b][jb] = _without(ranks[b][jb], xb)
            ranks[a][ja] = _with(ranks[a][ja], xb)
        load[a] -= delta
        load[b] += delta
    return load.max() / bound if bound > 0 else 1.0


@_compiled
def _flatten(ranks):
    count = 0
    nbins = 0
    for bins in ranks:
        for b in bins:
            count += len(b)
            nbins += 1
    items = np.empty(count, dtype=np.int64)
    offsets = np.zeros(nbins + 1, dtype=np.int64)
    k, pos = 0, 0
    for bins in ranks:
        for b in bins:
            items[pos:pos + len(b)] = b
            pos += len(b)
            k += 1
            offsets[k] = pos
    return items, offsets


@_compiled
def _balance_step(order, cuts, sizes, work, cap, m, multiple):
    dp, n = len(cuts) - 1, len(sizes)
    while m * dp <= n:
        ok, equal = _equalise(_pack_ranks(order, cuts, sizes, m, cap), m, sizes, work, cap)
        if not ok:
            m += multiple
            continue
        best = _refine(equal, sizes, work, cap)
        if best > 1 + EXTRA_GROUP_THRESHOLD and multiple == 1 and (m + 1) * dp <= n:
            ok, wider = _equalise(_pack_ranks(order, cuts, sizes, m + 1, cap), m + 1, sizes,
                                  work, cap)
            if ok and _refine(wider, sizes, work, cap) < best - EXTRA_GROUP_THRESHOLD / 2:
                equal, m = wider, m + 1
        items, offsets = _flatten(equal)
        return True, items, offsets, m
    return False, np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), m


def balance_step_flat(order: np.ndarray, ranks: np.ndarray, sizes: np.ndarray, work: np.ndarray,
                      cap: int, dp: int, multiple: int):
    """``rank_balance.balance_step`` as ``((items, offsets), m)`` or None."""
    sizes = np.asarray(sizes, dtype=np.int64)
    cuts = np.searchsorted(ranks, np.arange(dp + 1)).astype(np.int64)
    m = first_count(sizes, cap, dp, multiple)
    ok, items, offsets, m = _balance_step(
        np.asarray(order, dtype=np.int64), cuts, sizes, np.asarray(work, dtype=np.float64),
        np.int64(cap), np.int64(m), np.int64(multiple))
    return ((items, offsets), int(m)) if ok else None


@_compiled
def _bin_lower_bound(sizes, cap):
    """``rank_balance._bin_lower_bound``."""
    over, volume, big, fits = 0, 0, 0, 0
    half = cap // 2 + cap % 2
    for s in sizes:
        if s > cap:
            over += 1
        else:
            fits += 1
            volume += s
            if s > half:
                big += 1
    if cap <= 1:
        big = fits
    return over + max(-(-volume // cap), big)
