"""Bin-packing facts the scheduler's micro-batch counts are checked against.

Every function here takes item sizes and a cap; an item larger than the cap ("oversize") sits
alone in a bin of its own, as in the scheduler, so every count splits into
``oversize + count of the fitting items``.

- ``lower_bound``: ``oversize + ceil(sum of fitting items / cap)``; no packing does better.
- ``optimal_count``: the exact optimum, by dynamic programming over subsets (small inputs only).
- ``ffd_upper_bound`` / ``first_fit_upper_bound``: the tight worst-case bounds of first-fit
  decreasing (Dósa 2007: ``FFD <= 11/9 OPT + 6/9``) and first-fit (Dósa and Sgall 2013:
  ``FF <= floor(17/10 OPT)``), from the exact optimum.
- ``any_fit_upper_bound``: any packing in which no two bins fit together (first-fit and FFD
  are such packings) has ``B <= 1`` or ``B * cap < 2 * sum`` bins: pairing every bin with the
  next one (cyclically) counts each bin twice, and each pair holds more than ``cap``.
- ``align_up``: the count rounded up to a multiple, as the planner's alignment does.
"""

from collections.abc import Sequence

EXACT_LIMIT = 12  # optimal_count is O(2^n * n): ~50k steps at 12 fitting items


def split_oversize(sizes: Sequence[int], cap: int) -> tuple[int, list[int]]:
    """(number of items over the cap, the sizes of the others)."""
    fitting = [int(s) for s in sizes if s <= cap]
    return len(sizes) - len(fitting), fitting


def lower_bound(sizes: Sequence[int], cap: int) -> int:
    over, fitting = split_oversize(sizes, cap)
    return over + -(-sum(fitting) // cap)


def align_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def optimal_count(sizes: Sequence[int], cap: int) -> int:
    """The fewest bins of ``cap`` holding ``sizes`` (oversize items alone).

    ``best[mask]`` is the lexicographically smallest (bins, fill of the last bin) over every
    order of placing the items of ``mask`` one after another, opening a new bin when the next
    item does not fit. Some order (bin by bin of an optimal packing) reaches the optimum, and a
    smaller pair never extends to a larger one, so ``best[all][0]`` is the optimum.
    """
    over, fitting = split_oversize(sizes, cap)
    n = len(fitting)
    if n > EXACT_LIMIT:
        raise ValueError(f"{n} fitting items: optimal_count is exponential, keep it <= "
                         f"{EXACT_LIMIT}")
    if n == 0:
        return over
    best = [(0, cap)] * (1 << n)  # the empty set: no bin yet (a full "bin 0" opens bin 1)
    for mask in range(1, 1 << n):
        result = None
        rest = mask
        while rest:
            low = rest & -rest
            rest ^= low
            bins, fill = best[mask ^ low]
            s = fitting[low.bit_length() - 1]
            cand = (bins, fill + s) if fill + s <= cap else (bins + 1, s)
            if result is None or cand < result:
                result = cand
        best[mask] = result
    return over + best[-1][0]


def optimal_count_by_enumeration(sizes: Sequence[int], cap: int) -> int:
    """The same optimum by trying every partition of the fitting items (tiny inputs only)."""
    over, fitting = split_oversize(sizes, cap)
    best = len(fitting)

    def place(k: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if k == len(fitting):
            best = len(loads)
            return
        for b in range(len(loads)):
            if loads[b] + fitting[k] <= cap:
                loads[b] += fitting[k]
                place(k + 1, loads)
                loads[b] -= fitting[k]
        place(k + 1, loads + [fitting[k]])

    place(0, [])
    return over + best


def ffd_upper_bound(sizes: Sequence[int], cap: int) -> int:
    """Dósa's tight bound ``FFD <= 11/9 OPT + 6/9`` on the fitting items, plus the oversize."""
    over, fitting = split_oversize(sizes, cap)
    return over + (11 * optimal_count(fitting, cap) + 6) // 9


def first_fit_upper_bound(sizes: Sequence[int], cap: int) -> int:
    """Dósa and Sgall's tight bound ``FF <= floor(1.7 OPT)`` on the fitting items, plus the
    oversize."""
    over, fitting = split_oversize(sizes, cap)
    return over + 17 * optimal_count(fitting, cap) // 10


def any_fit_upper_bound(sizes: Sequence[int], cap: int) -> int:
    """The most bins a packing can have when no two of its bins fit together in one: 0 or 1
    for at most one bin, else the largest ``B`` with ``B * cap < 2 * sum``; plus the
    oversize."""
    over, fitting = split_oversize(sizes, cap)
    if not fitting:
        return over
    return over + max(1, -(-2 * sum(fitting) // cap) - 1)
