"""``balance="straggler"``: distribute first, then pack per rank, to minimise the slowest rank.

Purpose: in a data-parallel step the rank with the most FLOPs sets the pace. Packing first and
then dealing whole micro-batches to ranks (``"tokens"`` / ``"flops"``) can only move coarse,
unequal chunks: a 32k-token singleton costs ~1.5x the FLOPs of eight 4k samples with the same
tokens. This policy balances individual samples instead:

1. **Distribute**: per step, longest-processing-time first: samples by decreasing FLOPs, each
   to the currently lightest rank (a heap). Ranks holding a very long sample get fewer samples;
   dealing equal counts per rank instead cannot absorb a heavy tail.
2. **Pack per rank** into the target count ``M`` of token-balanced bins (LPT by tokens) when
   that respects the cap, else with first-fit-decreasing.
3. **Equalise counts**: every rank needs the same count ``M`` (a multiple of the VPP
   ``microbatch_group``). ``M`` starts at the aligned lower bound ``ceil(K_lb / dp)`` where
   ``K_lb`` is the step's bin lower bound; ranks above ``M`` hand their emptiest micro-batches'
   samples to the room left on the lightest ranks; ranks below ``M`` split their heaviest
   micro-batches (token-balanced halves). When the samples do not fit, ``M`` grows by one
   multiple and the step is retried.
4. **Refine** by moving or swapping single samples between the heaviest and the lightest rank
   while that lowers the maximum and keeps every micro-batch within the cap.

Trade-off: the count ``M`` can exceed plain FFD's aligned count when per-rank packing wastes more
room than global packing (at most one micro-batch group per rank in the benchmark), in exchange
for per-step FLOPs imbalance near the lower bound ``max(max sample, total / dp)``. Constraints
kept: equal counts per rank, the alignment multiple, the token cap (oversize samples alone),
siblings in one step (the policy works inside a step). Returns None when a step is too small to
give every rank ``M`` samples; the planner then falls back to packing + FLOPs balancing.
"""

import heapq

import numpy as np
from jaxtyping import Float, Int

from vime_pure.scheduling import kernels

REFINE_TOLERANCE = 5e-3  # stop refining once the heaviest rank is within 0.5% of its bound
REFINE_CANDIDATES = 256  # per rank, bounds an exchange search to a 256 x 256 matrix
REFINE_PARTNERS = 4  # light ranks tried for an exchange with the heaviest one
EXTRA_GROUP_THRESHOLD = 0.02  # above 2% over the bound, try one more micro-batch group per rank


def lpt_ranks(work: Float[np.ndarray, " n"], bounds: Int[np.ndarray, " s1"],
              dp: int) -> Int[np.ndarray, " n"]:
    """Rank of every sample: per step (samples ``bounds[s]:bounds[s + 1]``, contiguous), LPT on
    ``work`` (heaviest first, ties by position, to the least-loaded rank, lowest rank on
    ties). A stable sort and a heap per step (cheaper than one 3-key lexsort of the batch).
    Example: work [9, 8, 2, 1] in one step with dp=2 gives ranks [0, 1, 1, 0] (loads 10, 10)."""
    ranks = np.empty(len(work), dtype=np.int64)
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        order = lo + np.argsort(-work[lo:hi], kind="stable")
        chosen: list[int] = []
        append, replace, heap = chosen.append, heapq.heapreplace, [(0.0, r) for r in range(dp)]
        for value in work[order].tolist():
            load, r = heap[0]
            append(r)
            replace(heap, (load + value, r))
        ranks[order] = chosen
    return ranks


def first_count(sizes: Int[np.ndarray, " n"], cap: int, dp: int, multiple: int) -> int:
    """The per-rank count ``M`` the balancer tries first: the aligned ``ceil(K_lb / dp)``.
    Example: sizes [600, 600, 600, 100], cap 1000, dp 2, multiple 1 give 2 (3 bins at least)."""
    m = max(-(-_bin_lower_bound(sizes, cap) // dp), 1)
    return -(-m // multiple) * multiple


def balance_step(order: Int[np.ndarray, " n"], ranks: Int[np.ndarray, " n"],
                 sizes: Int[np.ndarray, " n"], work: Float[np.ndarray, " n"], cap: int, dp: int,
                 multiple: int) -> tuple[list[list[int]], kernels.Bins] | None:
    """Per-rank micro-batches of one step. ``order``: positions sorted by (rank, size
    descending); ``ranks[k]``: the rank of ``order[k]``. Returns (bin numbers per rank, bins).
    The oracle of the compiled twin (``compiled_balance.balance_step_flat``): every tie breaks
    by a stated rule (stable sorts, first minimum, sequential float sums) both implement."""
    step = _Step(sizes, work, cap)
    cuts = np.searchsorted(ranks, np.arange(dp + 1)).tolist()
    order_list = order.tolist()
    slices = [(order_list[a:b], [step.size[i] for i in order_list[a:b]])
              for a, b in zip(cuts[:-1], cuts[1:])]
    ffd: dict[int, kernels.Bins] = {}  # per-rank FFD packing, computed on first need
    m = first_count(sizes, cap, dp, multiple)
    while m * dp <= len(step.size):
        equal = _equalise(_pack_ranks(slices, m, cap, ffd), m, step)
        if equal is None:
            m += multiple
            continue
        best = _refine(equal, step)
        if best > 1 + EXTRA_GROUP_THRESHOLD and multiple == 1 and (m + 1) * dp <= len(step.size):
            # The token cap forces FLOPs onto some ranks at this count: one more micro-batch
            # per rank usually removes the straggler (see the module's trade-off). Under VPP
            # the next count is a whole microbatch_group more per rank: not worth it.
            wider = _equalise(_pack_ranks(slices, m + 1, cap, ffd), m + 1, step)
            if wider is not None and _refine(wider, step) < best - EXTRA_GROUP_THRESHOLD / 2:
                equal, m = wider, m + 1
        bins = [b for rank in equal for b in rank]
        return [list(range(r * m, (r + 1) * m)) for r in range(dp)], bins
    return None


def _pack_ranks(slices: list[tuple[list[int], list[int]]], m: int, cap: int,
                ffd: dict[int, kernels.Bins]) -> list[kernels.Bins]:
    """Every rank's items in ``m`` token-balanced bins (LPT by tokens) when that respects the
    cap, else its first-fit-decreasing packing (which ``_equalise`` then brings to ``m``)."""
    out = []
    for r, (items, item_sizes) in enumerate(slices):
        bins = lpt_bins(items, item_sizes, m, cap) if sum(item_sizes) <= m * cap else None
        if bins is None:
            if r not in ffd:
                ffd[r] = kernels.ffd_sorted(items, item_sizes, cap)
            bins = ffd[r]
        out.append(bins)
    return out


def lpt_bins(items: list[int], item_sizes: list[int], m: int, cap: int) -> kernels.Bins | None:
    """Items (sorted by size, largest first) into exactly ``m`` bins, each to the bin with the
    fewest tokens; None when a bin would be empty or a multi-item bin would exceed ``cap``.
    Example: sizes [9, 5, 4, 3, 1] into 2 bins give [9, 3] and [5, 4, 1]."""
    if len(items) < m:
        return None
    bins: kernels.Bins = [[] for _ in range(m)]
    heap = [(0, j) for j in range(m)]
    for i, size in zip(items, item_sizes):
        tokens, j = heap[0]
        if tokens and tokens + size > cap:
            return None
        bins[j].append(i)
        heapq.heapreplace(heap, (tokens + size, j))
    return bins


class _Step:
    """One step's sizes and work as Python lists (per-bin sums of a few items are cheaper in
    Python than through numpy calls), plus the arrays for vectorised searches."""

    def __init__(self, sizes: np.ndarray, work: np.ndarray, cap: int) -> None:
        self.sizes, self.work, self.cap = sizes, work, cap
        self.size, self.flops = sizes.tolist(), work.tolist()

    def tokens(self, items: list[int]) -> int:
        return sum(map(self.size.__getitem__, items))

    def load(self, bins: kernels.Bins) -> float:
        # 0.0 start: an empty rank's load is a float, so an array of loads stays float64.
        return sum((sum(map(self.flops.__getitem__, b)) for b in bins), 0.0)


def _bin_lower_bound(sizes: np.ndarray, cap: int) -> int:
    """No packing uses fewer bins: oversize items sit alone, and no two items over cap/2 share."""
    fits = sizes <= cap
    over = int((~fits).sum())
    by_volume = -(-int(sizes[fits].sum()) // cap)
    big = int(((sizes > cap // 2 + cap % 2) & fits).sum()) if cap > 1 else int(fits.sum())
    return over + max(by_volume, big)


def _equalise(per_rank: list[kernels.Bins], m: int, step: _Step) -> list[kernels.Bins] | None:
    """Bring every rank to exactly ``m`` bins, or None if the overflow does not fit."""
    ranks = [list(bins) for bins in per_rank]
    pool: list[int] = []
    for bins in ranks:
        if len(bins) > m:
            bins.sort(key=lambda b: -step.tokens(b))  # stable: keeps FFD order on ties
            pool.extend(i for b in bins[m:] for i in b)
            del bins[m:]
    if pool and not _place(ranks, pool, m, step):
        return None
    for r, bins in enumerate(ranks):
        if len(bins) < m:
            split = kernels.split_to_count(bins, step.sizes, m)
            if split is None:
                return None
            ranks[r] = split
    return ranks


def _place(ranks: list[kernels.Bins], pool: list[int], m: int, step: _Step) -> bool:
    """Put ``pool`` items (largest first) into bins with room on the lightest possible rank.
    When no bin has room: open a bin on a rank below ``m`` bins, else eject a smaller item from
    a bin where the swap fits (the smallest such item) and place that one later. Ejected items
    are strictly smaller, so the pool's token total shrinks and the loop ends. New lists replace
    the bins that change, so the caller's per-rank packing is never mutated."""
    ref = [(r, j) for r, bins in enumerate(ranks) for j in range(len(bins))]
    owner = np.array([r for r, _ in ref], dtype=np.int64)
    room = np.array([step.cap - step.tokens(ranks[r][j]) for r, j in ref], dtype=np.int64)
    load = np.array([step.load(bins) for bins in ranks])
    slot_of = np.full(len(step.size), -1, dtype=np.int64)  # bin slot of every placed item
    for slot, (r, j) in enumerate(ref):
        slot_of[ranks[r][j]] = slot
    queue = [(-step.size[i], i) for i in pool]
    heapq.heapify(queue)
    while queue:
        size, i = -queue[0][0], heapq.heappop(queue)[1]
        fit = np.flatnonzero(room >= size) if size <= step.cap else np.zeros(0, dtype=np.int64)
        if fit.size:
            slot = int(fit[np.argmin(load[owner[fit]])])
            r, j = ref[slot]
            ranks[r][j] = [*ranks[r][j], i]
            room[slot] -= size
        elif any(len(bins) < m for bins in ranks):
            r = min((q for q in range(len(ranks)) if len(ranks[q]) < m),
                    key=lambda q: (load[q], q))
            ranks[r].append([i])
            slot = len(ref)
            owner = np.append(owner, r)
            ref.append((r, len(ranks[r]) - 1))
            room = np.append(room, step.cap - size)
        else:
            y = _eject(slot_of, room, size, step)
            if y is None:
                return False
            slot = int(slot_of[y])
            r, j = ref[slot]
            ranks[r][j] = [*(k for k in ranks[r][j] if k != y), i]
            room[slot] -= size - step.size[y]
            load[r] -= step.flops[y]
            slot_of[y] = -1
            heapq.heappush(queue, (-step.size[y], y))
        slot_of[i] = slot
        load[r] += step.flops[i]
    return True


def _eject(slot_of: np.ndarray, room: np.ndarray, size: int, step: _Step) -> int | None:
    """The smallest placed item lighter than ``size`` whose removal makes room for ``size`` in
    its bin (lowest position on ties), or None when no bin allows such a swap."""
    placed = slot_of >= 0
    ok = placed & (step.sizes < size)
    ok[ok] &= room[slot_of[ok]] + step.sizes[ok] >= size
    if size > step.cap or not ok.any():
        return None
    candidates = np.flatnonzero(ok)
    return int(candidates[np.argmin(step.sizes[candidates])])


def _refine(ranks: list[kernels.Bins], step: _Step) -> float:
    """Move or swap single samples from the heaviest to the lightest rank while that lowers the
    heaviest rank's load (in place). Every micro-batch stays non-empty and within the cap.
    Returns the final straggler ratio: heaviest rank load / ``max(heaviest sample, mean)``."""
    loads = [step.load(bins) for bins in ranks]
    load = np.array(loads)
    # No assignment beats max(heaviest sample, mean load); stop close to that bound. The mean
    # is a left-to-right sum (numpy's pairwise one would differ from the compiled twin's).
    bound = max(sum(loads) / len(loads), float(step.work.max(initial=0.0)))
    budget = 2 * len(ranks)  # exchange searches, about 2 per rank
    while budget > 0:
        a = int(np.argmax(load))
        if load[a] <= bound * (1 + REFINE_TOLERANCE):
            break
        # The lightest rank first; when its micro-batches are too full, the next lightest.
        for b in np.argsort(load, kind="stable")[:REFINE_PARTNERS].tolist():
            budget -= 1
            best = _best_exchange(ranks[a], ranks[b], step, float(load[a] - load[b]))
            if b != a and best is not None:
                break
        else:
            break
        (ja, xa), (jb, xb), delta = best
        ranks[a][ja] = [i for i in ranks[a][ja] if i != xa]
        ranks[b][jb] = [*ranks[b][jb], xa]
        if xb >= 0:
            ranks[b][jb] = [i for i in ranks[b][jb] if i != xb]
            ranks[a][ja].append(xb)
        load[a] -= delta
        load[b] += delta
    return float(load.max()) / bound if bound > 0 else 1.0


def _items(bins: kernels.Bins, step: _Step):
    """Items of a rank with their bin, sizes and work; per bin its tokens and item count."""
    item = [i for b in bins for i in b]
    slot = np.array([j for j, b in enumerate(bins) for _ in b], dtype=np.int64)
    tokens = np.array([step.tokens(b) for b in bins], dtype=np.int64)
    count = np.array([len(b) for b in bins], dtype=np.int64)
    return np.array(item, dtype=np.int64), slot, tokens, count


def _nearest(key: np.ndarray) -> np.ndarray:
    """Positions of the ``REFINE_CANDIDATES`` smallest keys (earlier first on ties), sorted."""
    return np.sort(np.argsort(key, kind="stable")[:REFINE_CANDIDATES])


def _best_exchange(heavy: kernels.Bins, light: kernels.Bins, step: _Step, gap: float):
    """The move or swap whose FLOPs transfer is closest to ``gap / 2`` (None if none helps):
    ((heavy bin, sample), (light bin, sample or -1 for a move), FLOPs moved)."""
    ia, sa, ta, ca = _items(heavy, step)
    ib, sb, tb, cb = _items(light, step)
    wa, wb = step.work[ia], step.work[ib]
    # Big ranks: the items nearest the ideal transfer, and the lightest items to take back.
    # Ties at the cut go to the earlier item (a stable sort, not argpartition's arbitrary pick).
    if len(ia) > REFINE_CANDIDATES:
        keep = _nearest(np.abs(wa - gap / 2))
        ia, sa, wa = ia[keep], sa[keep], wa[keep]
    if len(ib) > REFINE_CANDIDATES:
        keep = _nearest(wb)
        ib, sb, wb = ib[keep], sb[keep], wb[keep]
    za, zb, cap = step.sizes[ia], step.sizes[ib], step.cap
    # Swaps: x from heavy bin sa, y from light bin sb; a bin left with one sample may exceed cap.
    delta = wa[:, None] - wb[None, :]
    fit_a = (ta[sa] - za)[:, None] + zb[None, :] <= cap
    fit_a |= (ca[sa] == 1)[:, None]
    fit_b = (tb[sb] - zb)[None, :] + za[:, None] <= cap
    fit_b |= (cb[sb] == 1)[None, :]
    score = np.where((delta > 0) & (delta < gap) & fit_a & fit_b, np.abs(delta - gap / 2), np.inf)
    # Moves: x into the light bin with the most room, if x's bin keeps a sample.
    room = cap - tb
    target = int(np.argmax(room))
    movable = (ca[sa] > 1) & (za <= room[target]) & (wa < gap) & (wa > 0)
    move_score = np.where(movable, np.abs(wa - gap / 2), np.inf)
    k = int(np.argmin(score))
    x = int(np.argmin(move_score))
    if np.isfinite(move_score[x]) and move_score[x] <= score.flat[k]:
        return (int(sa[x]), int(ia[x])), (target, -1), float(wa[x])
    if not np.isfinite(score.flat[k]):
        return None
    x, y = divmod(k, len(ib))
    return (int(sa[x]), int(ia[x])), (int(sb[y]), int(ib[y])), float(wa[x] - wb[y])
