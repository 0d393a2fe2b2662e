"""``balance="straggler"``: distribute first, then pack per rank, to minimise the slowest rank.

Purpose: in a data-parallel step the rank with the most FLOPs sets the pace. Packing first and
then dealing whole micro-batches to ranks (``"tokens"`` / ``"flops"``) can only move coarse,
unequal chunks: a 32k-token singleton costs ~1.5x the FLOPs of eight 4k samples with the same
tokens. This policy balances individual samples instead:

1. **Distribute**: per step, longest-processing-time first: samples by decreasing FLOPs, each
   to the currently lightest rank (a heap). Ranks holding a very long sample get fewer samples;
   dealing equal counts per rank instead cannot absorb a heavy tail.
2. **Pack per rank** with first-fit-decreasing under the token cap.
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

from vime_pure import kernels

REFINE_TOLERANCE = 5e-3  # stop refining once the heaviest rank is within 0.5% of its bound


def lpt_ranks(work: Float[np.ndarray, " n"], step_of: Int[np.ndarray, " n"],
              bounds: Int[np.ndarray, " s1"], dp: int) -> Int[np.ndarray, " n"]:
    """Rank of every sample: per step, LPT on ``work`` (heaviest first, to the least-loaded
    rank, lowest rank on ties). One sort for all steps, then a heap per step.
    Example: work [9, 8, 2, 1] in one step with dp=2 gives ranks [0, 1, 1, 0] (loads 10, 10)."""
    n = len(work)
    order = np.lexsort((np.arange(n), -work, step_of))
    values = work[order].tolist()
    chosen: list[int] = []
    append, replace = chosen.append, heapq.heapreplace
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        heap = [(0.0, r) for r in range(dp)]
        for value in values[lo:hi]:
            load, r = heap[0]
            append(r)
            replace(heap, (load + value, r))
    ranks = np.empty(n, dtype=np.int64)
    ranks[order] = chosen
    return ranks


def balance_step(order: list[int], ranks: list[int], sizes: Int[np.ndarray, " n"],
                 work: Float[np.ndarray, " n"], cap: int, dp: int, multiple: int
                 ) -> tuple[list[list[int]], kernels.Bins] | None:
    """Per-rank micro-batches of one step. ``order``: positions sorted by (rank, size
    descending); ``ranks[k]``: the rank of ``order[k]``. Returns (bin numbers per rank, bins)."""
    size_list = sizes.tolist()
    cuts = np.searchsorted(np.asarray(ranks), np.arange(dp + 1)).tolist()
    per_rank = [kernels.ffd_sorted(order[a:b], [size_list[i] for i in order[a:b]], cap)
                for a, b in zip(cuts[:-1], cuts[1:])]
    count = _bin_lower_bound(sizes, cap)
    m = max(-(-count // dp), 1)
    m = -(-m // multiple) * multiple
    while m * dp <= len(size_list):
        equal = _equalise(per_rank, m, sizes, work, cap)
        if equal is not None:
            _refine(equal, sizes, work, cap)
            bins = [b for rank in equal for b in rank]
            return [list(range(r * m, (r + 1) * m)) for r in range(dp)], bins
        m += multiple
    return None


def _bin_lower_bound(sizes: np.ndarray, cap: int) -> int:
    """No packing uses fewer bins: oversize items sit alone, and no two items over cap/2 share."""
    fits = sizes <= cap
    over = int((~fits).sum())
    by_volume = -(-int(sizes[fits].sum()) // cap)
    big = int(((sizes > cap // 2 + cap % 2) & fits).sum()) if cap > 1 else int(fits.sum())
    return over + max(by_volume, big)


def _equalise(per_rank: list[kernels.Bins], m: int, sizes: np.ndarray, work: np.ndarray,
              cap: int) -> list[kernels.Bins] | None:
    """Bring every rank to exactly ``m`` bins, or None if the overflow does not fit."""
    ranks = [[list(b) for b in bins] for bins in per_rank]
    pool: list[int] = []
    for bins in ranks:
        if len(bins) > m:
            bins.sort(key=lambda b: -int(sizes[b].sum()))  # stable: keeps FFD order on ties
            pool.extend(i for b in bins[m:] for i in b)
            del bins[m:]
    if pool:
        if not _place(ranks, pool, m, sizes, work, cap):
            return None
    for r, bins in enumerate(ranks):
        if len(bins) < m:
            split = kernels.split_to_count(bins, sizes, m)
            if split is None:
                return None
            ranks[r] = split
    return ranks


def _place(ranks: list[kernels.Bins], pool: list[int], m: int, sizes: np.ndarray,
           work: np.ndarray, cap: int) -> bool:
    """Put ``pool`` items (largest first) into bins with room on the lightest possible rank,
    opening a bin on a rank below ``m`` bins when no room is left anywhere."""
    owner = np.array([r for r, bins in enumerate(ranks) for _ in bins], dtype=np.int64)
    ref = [(r, j) for r, bins in enumerate(ranks) for j in range(len(bins))]
    room = np.array([cap - int(sizes[b].sum()) for bins in ranks for b in bins], dtype=np.int64)
    load = np.array([float(work[[i for b in bins for i in b]].sum()) for bins in ranks])
    for i in sorted(pool, key=lambda j: (-int(sizes[j]), j)):
        size = int(sizes[i])
        fit = np.flatnonzero(room >= size) if size <= cap else np.zeros(0, dtype=np.int64)
        if fit.size:
            slot = int(fit[np.argmin(load[owner[fit]])])
            r, j = ref[slot]
            ranks[r][j].append(i)
            room[slot] -= size
        else:
            short = [r for r in range(len(ranks)) if len(ranks[r]) < m]
            if not short:
                return False
            r = min(short, key=lambda q: (load[q], q))
            ranks[r].append([i])
            owner = np.append(owner, r)
            ref.append((r, len(ranks[r]) - 1))
            room = np.append(room, cap - size)
        load[r] += float(work[i])
    return True


def _refine(ranks: list[kernels.Bins], sizes: np.ndarray, work: np.ndarray, cap: int) -> None:
    """Move or swap single samples from the heaviest to the lightest rank while that lowers the
    heaviest rank's load (in place). Every micro-batch stays non-empty and within the cap."""
    load = np.array([float(work[[i for b in bins for i in b]].sum()) for bins in ranks])
    # No assignment beats max(heaviest sample, mean load); stop close to that bound.
    bound = max(float(load.mean()), float(work.max(initial=0.0))) * (1 + REFINE_TOLERANCE)
    for _ in range(2 * len(ranks)):
        a, b = int(np.argmax(load)), int(np.argmin(load))
        gap = float(load[a] - load[b])
        if a == b or load[a] <= bound:
            return
        best = _best_exchange(ranks[a], ranks[b], sizes, work, cap, gap)
        if best is None:
            return
        (ja, ia), (jb, ib), delta = best
        ranks[a][ja].remove(ia)
        ranks[b][jb].append(ia)
        if ib >= 0:
            ranks[b][jb].remove(ib)
            ranks[a][ja].append(ib)
        load[a] -= delta
        load[b] += delta


def _items(bins: kernels.Bins, sizes: np.ndarray, work: np.ndarray):
    item = np.array([i for b in bins for i in b], dtype=np.int64)
    slot = np.array([j for j, b in enumerate(bins) for _ in b], dtype=np.int64)
    tokens = np.array([int(sizes[b].sum()) for b in bins], dtype=np.int64)
    count = np.array([len(b) for b in bins], dtype=np.int64)
    return item, slot, tokens, count


def _best_exchange(heavy: kernels.Bins, light: kernels.Bins, sizes: np.ndarray,
                   work: np.ndarray, cap: int, gap: float):
    """The move or swap whose FLOPs transfer is closest to ``gap / 2`` (None if none helps)."""
    ia, sa, ta, ca = _items(heavy, sizes, work)
    ib, sb, tb, cb = _items(light, sizes, work)
    wa, wb = work[ia], work[ib]
    # Swaps: x from heavy bin sa, y from light bin sb; a bin left with one sample may exceed cap.
    delta = wa[:, None] - wb[None, :]
    fit_a = (ta[sa][:, None] - sizes[ia][:, None] + sizes[ib][None, :] <= cap) | (ca[sa] == 1)[:, None]
    fit_b = (tb[sb][None, :] - sizes[ib][None, :] + sizes[ia][:, None] <= cap) | (cb[sb] == 1)[None, :]
    score = np.where((delta > 0) & (delta < gap) & fit_a & fit_b, np.abs(delta - gap / 2), np.inf)
    # Moves: x into the light bin with the most room, if x's bin keeps a sample.
    room = cap - tb
    target = int(np.argmax(room))
    movable = (ca[sa] > 1) & (sizes[ia] <= room[target]) & (wa < gap) & (wa > 0)
    move_score = np.where(movable, np.abs(wa - gap / 2), np.inf)
    k = int(np.argmin(score)) if score.size else -1
    best_swap = score.flat[k] if k >= 0 else np.inf
    best_move = int(np.argmin(move_score)) if move_score.size else -1
    if best_move >= 0 and move_score[best_move] <= best_swap and np.isfinite(move_score[best_move]):
        x = best_move
        return (int(sa[x]), int(ia[x])), (target, -1), float(wa[x])
    if not np.isfinite(best_swap):
        return None
    x, y = divmod(k, len(ib))
    return (int(sa[x]), int(ia[x])), (int(sb[y]), int(ib[y])), float(wa[x] - wb[y])
