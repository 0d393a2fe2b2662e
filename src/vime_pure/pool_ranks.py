"""The fully-async pool over several engine ranks: which groups each rank's pool owns, and how
the trainer joins the pools' parts, counts and resume points (pure, torch-free).

Every engine rank draws the same prompt blocks of ``B = --rollout-batch-size`` prompts (the
prompt source is deterministic and identical on every rank); pool ``j`` of ``N`` owns the
groups ``(block, i)`` with ``i`` in ``pool_share(B, N, j)``, a contiguous slice (the same
split as the synchronous engines' ``prompt_shares``; uneven when ``N`` does not divide ``B``,
empty for ``j >= B``). A group's seeds and ids still come from ``(block, i)``, so the batches
do not depend on ``N``: :func:`merge_order` puts the parts back in draw order.

Resume points: a pool's point names its oldest block with an unfinished group of its own;
:func:`merge_resume_states` turns the ``N`` points into one exact point of the same shape
(the oldest block over all pools, and every group that is done, a pool's groups before its
own oldest open block included), so a checkpoint resumes with any ``N``.

Example: ``B=5, N=2``: pool 0 owns indices 0-2, pool 1 indices 3-4; parts with keys
``[(7, 3), (7, 4)]`` and ``[(7, 0), (7, 1), (7, 2)]`` join in order ``[2, 3, 4, 0, 1]``.
"""

from typing import Any

from vime_pure.async_pool import AsyncPoolError, PoolCounts
from vime_pure.async_pool import is_count as _is_count
from vime_pure.config import as_int
from vime_pure.data.shards import prompt_shares
from vime_pure.errors import field_error

_FIX = "pass whole numbers (--rollout-batch-size, --rollout-num-gpus)"


def pool_share(batch_size: Any, num_pools: Any, pool: Any) -> range:
    """The indices of every prompt block that pool ``pool`` of ``num_pools`` generates.
    Example: ``pool_share(5, 2, 1) == range(3, 5)``; ``pool_share(1, 2, 1)`` is empty."""
    batch_size = as_int("batch_size", batch_size, 1, AsyncPoolError, _FIX)
    num_pools = as_int("num_pools", num_pools, 1, AsyncPoolError, _FIX)
    pool = as_int("pool", pool, 0, AsyncPoolError, _FIX)
    if pool >= num_pools:
        raise field_error(AsyncPoolError, "pool", pool, f"is not below num_pools={num_pools}",
                          "pass an engine rank of the job")
    return prompt_shares(batch_size, num_pools)[pool]


def _group_keys(name: str, value: Any) -> list[tuple[int, int]]:
    """``value`` as ``(block, index)`` pairs of whole numbers >= 0, else the typed error."""
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(k, (list, tuple)) and len(k) == 2 and all(map(_is_count, k))
            for k in value):
        raise field_error(AsyncPoolError, name, value, "is not a list of (block, index) pairs "
                          "of whole numbers >= 0", "pass the pools' group keys")
    return [(int(b), int(i)) for b, i in value]


def merge_order(keys: Any) -> tuple[int, ...]:
    """Positions of the groups ``keys`` (``(block, index)``, the pools' parts concatenated) in
    draw order; a group present twice is an error (it would train twice).
    Example: ``merge_order([(1, 2), (0, 3), (1, 0)]) == (1, 2, 0)``."""
    keys = _group_keys("groups (block, index)", keys)
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise field_error(AsyncPoolError, "groups (block, index)", twice, "came from more than "
                          "one pool part", "report this: each group belongs to one pool")
    return tuple(sorted(range(len(keys)), key=keys.__getitem__))


def sum_counts(counts: Any) -> PoolCounts:
    """The pools' counts added up (``started = trained + recycled + filtered + pending``
    holds for the sum when it holds for each)."""
    if not isinstance(counts, (list, tuple)) or not all(isinstance(c, PoolCounts)
                                                         for c in counts):
        raise field_error(AsyncPoolError, "counts", counts, "is not a list of PoolCounts",
                          "pass each pool's counts")
    total = PoolCounts()
    for c in counts:
        total = total.add(started=c.started, trained=c.trained, recycled=c.recycled,
                          filtered=c.filtered)
    return total


def merge_resume_states(states: Any, shares: Any) -> dict:
    """One resume point for all pools: ``states[j]`` is pool ``j``'s (``{"block", "offset",
    "draws", "done"}``), ``shares[j]`` its indices. Pools owning nothing are ignored.

    The merged block is the oldest open one; ``offset``/``draws`` are where the source stood
    before it (the same on every rank, the prompts being the same); ``done`` lists every
    group from that block on that is trained or filtered, including a pool's groups in
    blocks before its own open block (all done). Example: pool 0 at block 3 with done
    ``[[4, 0]]``, pool 1 (indices 2-3) at block 2 with nothing done: block 2, done
    ``[[2, 0], [2, 1], [4, 0]]``.
    """
    _check_states(states, shares)
    live = [(s, tuple(share)) for s, share in zip(states, shares) if len(share)]
    if not live:
        raise field_error(AsyncPoolError, "pool shares", list(shares), "are all empty",
                          "pass at least one pool with groups")
    first = min(live, key=lambda item: int(item[0]["block"]))[0]
    block = int(first["block"])
    done: set[tuple[int, int]] = set()
    for state, share in live:
        done.update((int(b), int(i)) for b, i in state["done"] if int(b) >= block)
        done.update((b, i) for b in range(block, int(state["block"])) for i in share)
    return {"block": block, "offset": int(first["offset"]), "draws": int(first["draws"]),
            "done": sorted([b, i] for b, i in done)}


def _check_states(states: Any, shares: Any) -> None:
    """One resume point per pool (whole numbers, done pairs) and one share of indices each."""
    fields = ("block", "offset", "draws")
    if not isinstance(states, (list, tuple)) or not isinstance(shares, (list, tuple)) \
            or len(states) != len(shares) or not all(
                isinstance(s, dict) and all(_is_count(s.get(f)) for f in fields)
                for s in states) or not all(
                isinstance(sh, (range, list, tuple)) and all(map(_is_count, sh))
                for sh in shares):
        raise field_error(AsyncPoolError, "pool resume states", states, "are not one "
                          '{"block", "offset", "draws", "done"} point (whole numbers) per '
                          "pool share", "pass each pool's GroupPool.resume_state and share")
    for state in states:
        _group_keys("done", state.get("done"))
