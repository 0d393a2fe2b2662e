"""The fully-async pools over several engine ranks: one shared queue of draws, how a claim
ticket names a group, when a pool may start one more, and how the trainer joins the pools'
parts, counts and resume points (pure, torch-free).

Every engine rank draws the same prompt blocks of ``B = --rollout-batch-size`` prompts (the
prompt source is deterministic and identical on every rank), so the pools share nothing but
*which draws are taken*. Draws are claimed in draw order by tickets ``0, 1, 2, ...`` (a
counter in the job's store, :mod:`vime_shell.sources.pool`): ticket ``t`` is prompt
``t % B`` of block ``base + t // B`` (:func:`draw_of`; ``base`` is the block a resumed run
starts from). A group's seeds and ids come from its ``(block, index)``, never from who
claimed it, so the batches depend neither on ``N`` nor on who took what: :func:`merge_order`
puts the parts of a batch back in draw order (and gives each group its place; a pool sends its
groups as chunks of consecutive places, :func:`place_runs`). With static slices (the benchmarks' baseline)
pool ``j`` numbers only its own slice ``pool_share(B, N, j)`` the same way.

A pool keeps at most :func:`pool_capacity` groups in flight (``ceil(B / N)``, its share of a
batch: as many as a static slice; or its share of ``--async-max-concurrent-samples``), and may
start one more only while the groups counted
*live* over all pools (started, minus recycled and filtered: trained or still pending) leave
it fresh enough for the batch it would land in (:func:`admits_live`, the core's
``async_pool.admits`` over the shared count); with ``K = 0`` exactly the ``B`` groups of one
block are ever live beyond the trained ones, so the batches are the synchronous loop's.

Resume points (:func:`merge_resume_states`): the trainer tells every pool the block below
which every group is done (the last merged point's); each pool reports the groups it trained
or filtered from there on and where the prompt source stood at each block it drew; the merged
point is the first block with a group that no pool reports done, so a group in flight, in a
pool's queue or not yet claimed is generated again, and a done one never is, whoever held it.

Example: ``B=5, N=2``: ticket 7 is prompt 2 of block ``base + 1``; with static slices pool 1
(indices 3-4) reads its ticket 3 as prompt 4 of block ``base + 1``; parts with keys
``[(7, 3), (7, 4)]`` and ``[(7, 0), (7, 1), (7, 2)]`` join in order ``[2, 3, 4, 0, 1]``.
"""

from typing import Any

from vime_pure.async_pool import AsyncPoolError, PoolCounts, admits
from vime_pure.async_pool import is_count as _is_count
from vime_pure.config import as_int
from vime_pure.data.shards import prompt_shares
from vime_pure.errors import field_error

_FIX = "pass whole numbers (--rollout-batch-size, --rollout-num-gpus)"


def pool_share(batch_size: Any, num_pools: Any, pool: Any) -> range:
    """The indices of every prompt block that pool ``pool`` of ``num_pools`` generates with
    static slices. Example: ``pool_share(5, 2, 1) == range(3, 5)``; ``pool_share(1, 2, 1)``
    is empty."""
    batch_size = as_int("batch_size", batch_size, 1, AsyncPoolError, _FIX)
    num_pools = as_int("num_pools", num_pools, 1, AsyncPoolError, _FIX)
    pool = as_int("pool", pool, 0, AsyncPoolError, _FIX)
    if pool >= num_pools:
        raise field_error(AsyncPoolError, "pool", pool, f"is not below num_pools={num_pools}",
                          "pass an engine rank of the job")
    return prompt_shares(batch_size, num_pools)[pool]


def pool_capacity(batch_size: Any, num_pools: Any) -> int:
    """Groups one pool keeps in flight: its share of a batch, ``ceil(B / N)`` (at least 1).
    Example: ``pool_capacity(5, 2) == 3``; ``pool_capacity(1, 2) == 1``."""
    batch_size = as_int("batch_size", batch_size, 1, AsyncPoolError, _FIX)
    num_pools = as_int("num_pools", num_pools, 1, AsyncPoolError, _FIX)
    return -(-batch_size // num_pools)


def draw_of(ticket: Any, base_block: Any, indices: Any) -> tuple[int, int]:
    """The draw ``(block, index)`` that claim ``ticket`` names: tickets number the draws of
    ``indices`` (a whole block, or a static slice) block after block from ``base_block``.
    Example: ``draw_of(7, 2, range(5)) == (3, 2)``; ``draw_of(3, 0, range(3, 5)) == (1, 4)``."""
    ticket = as_int("ticket", ticket, 0, AsyncPoolError, _FIX)
    base_block = as_int("base_block", base_block, 0, AsyncPoolError, _FIX)
    if not isinstance(indices, (range, list, tuple)) or not len(indices) or not all(
            map(_is_count, indices)):
        raise field_error(AsyncPoolError, "indices", indices, "is not a non-empty list of "
                          "prompt indices", "pass the block's indices or the pool's share")
    return base_block + ticket // len(indices), int(indices[ticket % len(indices)])


def admits_live(*, live_before: Any, batches_sent: Any, start_version: Any,
                engine_version: Any, batch_size: Any, max_staleness: Any,
                in_flight: Any = None) -> bool:
    """Whether one more group may start, ``live_before`` groups being live over all pools
    (started minus recycled and filtered; this pool has sent ``batches_sent`` parts, so at
    least ``B * batches_sent`` of them are trained): ``async_pool.admits`` with the pending
    ones as its queue, ``in_flight`` groups allowed in flight over the pools (default ``B``).
    It lands in batch ``start_version + live_before // B`` at the earliest.
    Example: ``B=4, K=0``, nothing sent, 4 live at version 0: False until the sync."""
    live_before, batches_sent, batch_size = (
        as_int(name, value, lo, AsyncPoolError, _FIX) for name, value, lo in (
            ("live_before", live_before, 0), ("batches_sent", batches_sent, 0),
            ("batch_size", batch_size, 1)))
    return admits(batches_sent=batches_sent, start_version=start_version,
                  engine_version=engine_version,
                  queued=max(live_before - batch_size * batches_sent, 0),
                  batch_size=batch_size, max_staleness=max_staleness, in_flight=in_flight)


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


def place_runs(places: Any) -> list[tuple[int, list[int]]]:
    """A pool's groups at their ``places`` in the batch (draw order; ``places[i]`` is the
    pool's group ``i``'s) as chunks of consecutive places: ``(first place, the groups' indices
    in place order)`` per chunk, so a pool that claimed a run of draws sends one chunk's
    metadata for it, not one per group. A place given twice is an error.
    Example: ``place_runs([4, 0, 1, 5, 7]) == [(0, [1, 2]), (4, [0, 3]), (7, [4])]``."""
    places = [as_int("place", p, 0, AsyncPoolError, "pass the places place_pool_parts gave")
              for p in places]
    if len(set(places)) != len(places):
        raise field_error(AsyncPoolError, "places", places, "name one place twice",
                          "report this: each group has its own place in the batch")
    runs: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(places)), key=places.__getitem__):
        if runs and places[runs[-1][1][-1]] + 1 == places[i]:
            runs[-1][1].append(i)
        else:
            runs.append((places[i], [i]))
    return runs


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


def merge_resume_states(states: Any, batch_size: Any) -> dict:
    """One resume point for all pools. ``states[j]`` is pool ``j``'s: ``{"block": w, "starts":
    [[block, offset, draws], ...], "done": [[block, index], ...]}``, where every group before
    block ``w`` is done (the trainer's last merged point), ``starts`` says where the prompt
    source stood before each block the pool drew (its next one included) and ``done`` lists
    the groups it trained or filtered from ``w`` on.

    The merged block is the first one from ``w`` on with a group no pool reports done (in
    flight, in a queue, or never claimed: generated again on resume); ``offset``/``draws``
    are where the source stood before it (the same on every pool that drew it); ``done``
    lists every done group from there on. Example (``B = 2``): pool 0 done ``[[3, 0], [4,
    0]]``, pool 1 done ``[[3, 1]]``, both from block 3: block 4, done ``[[4, 0]]``.
    """
    batch_size = as_int("batch_size", batch_size, 1, AsyncPoolError, _FIX)
    _check_states(states)
    done = {key for s in states for key in _group_keys("done", s["done"])}
    block = max(int(s["block"]) for s in states)
    while all((block, i) in done for i in range(batch_size)):
        block += 1
    starts = {int(b): (int(o), int(d)) for s in states for b, o, d in s["starts"]}
    if block not in starts:
        raise field_error(AsyncPoolError, "pool resume states", states, f"name no prompt "
                          f"source position for block {block}, the first with an open group",
                          "report this: the pool that drew that block reports where it began")
    offset, draws = starts[block]
    return {"block": block, "offset": offset, "draws": draws,
            "done": sorted([b, i] for b, i in done if b >= block)}


def _check_states(states: Any) -> None:
    """One resume point per pool: whole numbers, ``(block, offset, draws)`` triples, done
    pairs."""
    if not isinstance(states, (list, tuple)) or not states or not all(
            isinstance(s, dict) and _is_count(s.get("block"))
            and isinstance(s.get("starts"), (list, tuple)) and all(
                isinstance(t, (list, tuple)) and len(t) == 3 and all(map(_is_count, t))
                for t in s["starts"]) for s in states):
        raise field_error(AsyncPoolError, "pool resume states", states, 'are not one {"block", '
                          '"starts", "done"} point (whole numbers) per pool',
                          "pass each pool's GroupPool.resume_state")
    for state in states:
        _group_keys("done", state.get("done"))
