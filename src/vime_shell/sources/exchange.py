"""Moving a rollout batch held in parts: metadata to rank 0, the plan to all, each share alone.

The core decides (``vime_pure.data.shares``); this module moves bytes, over one gloo group
(host memory only: on CUDA the default group is NCCL, and a rollout's bytes never belong in GPU
memory) whose members are the trainer ranks and, where the parts sit on engine ranks of their
own, those engine ranks too (the job's ``Sides.span``; they hold parts and train nothing). Per
rollout (``ShareExchange.distribute``)::

    holders (engine leaders, or rank 0)          trainer rank 0             every trainer rank
    1. gather   BatchMeta per chunk ──────────▶  merge_meta, plan_fn
    2. plan                         ◀── SharePlan (+ extra) ──▶            the plan
    3. all-to-all  share_piece per DP rank ─────────────────────────────▶  its share only
    4. assemble                                                            assemble_share

1. **gather**: every holder (an engine leader, or rank 0 for a replay or a filtered batch)
   sends the ``BatchMeta`` of each work-queue chunk its part holds (~46 bytes per sample plus
   ~0.5 KB per chunk, numpy, no ``Sample``) or its error to rank 0; other members send
   nothing;
2. **plan**: rank 0 merges the metadata in global prompt order (``merge_meta``: the batch does
   not depend on which engine claimed which chunk) and calls the caller's ``plan_fn``
   (advantages, checks, the ``Schedule``: the core's functions), and broadcasts the
   ``SharePlan`` (flat arrays, ~33 bytes per sample) with the caller's extra result, or the
   failure, so every member leaves together (no member waits on one that raised);
3. **all-to-all**: each holder cuts from its part the samples every trainer rank trains
   (``share_piece``: the plan's per-chunk offsets and the first prompts of the holder's own
   chunks are the owner map) and one all-to-all moves them: each trainer rank receives exactly
   its DP rank's samples. A piece (``pack_piece``) carries tokens, masks and each recorded
   per-response-token column: rollout and teacher log-probs, top-k distillation's
   ``opd_reverse_kl``. Ranks sharing a DP index (TP / CP / PP peers) each receive the share
   directly from the holders: one collective, every receiver's bytes equal its share, at the
   price of holders sending a DP group's share ``tp*cp*pp`` times (a fan-out inside the DP
   group would save holder bandwidth but add a second collective and per-DP-index groups);
4. **assemble**: the rank's pieces in its execution order (``assemble_share``).

Every wait is the health checks' (``engines.health.wait_until``): a member that died or froze
ends it with the job's verdict. ``ExchangeStats`` counts the bytes each member sent and received
per phase (what ``benchmarks/scale.py``, ``benchmarks/bytes_per_rank.py`` and the gloo tests
read); the parts shipped for inspection (``keep_parts``) are not counted: no run needs them.

Example (world 2, dp 2, engines on both ranks): each leader sends ~46 B per sample of its
part to rank 0, rank 0 broadcasts the plan, and rank 1 receives only the samples of DP rank 1.
"""

import pickle
from datetime import timedelta
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from vime_pure.data.batch import RolloutBatch
from vime_pure.data.columns import RESPONSE_FLOAT_COLUMNS
from vime_pure.data.ragged import offsets_from_lengths
from vime_pure.data.shares import (BatchMeta, RankShare, SharePlan, assemble_share, merge_meta,
                                   share_piece)
from vime_pure.errors import VimeError, relayed
from vime_shell.engines.health import PG_BACKSTOP_S, collective_done, wait_until
from vime_shell.megatron.collectives import RankFailure


class ShareExchangeError(VimeError):
    """A holder failed before its part could be scheduled; names the rank and its error."""


@attrs.define
class ExchangeStats:
    """Bytes this rank moved in its last ``distribute``, per phase."""

    meta_sent: int = 0
    meta_received: int = 0
    plan_bytes: int = 0
    share_sent: int = 0
    share_received: int = 0

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


_COLUMNS = (("sample_ids", np.int64), ("response_starts", np.int64), ("lengths", np.int32),
            ("response_lengths", np.int32))


# Header flags: bit k says column k of RESPONSE_FLOAT_COLUMNS is present (bit 0 rollout
# log-probs, 1 teacher log-probs, 2 reverse-KL estimates); the bits above, shifted down by
# _ROUTE_SHIFT, hold (width + 1) of the routed-expert rows, 0 without them.
_ROUTE_SHIFT = len(RESPONSE_FLOAT_COLUMNS)


def pack_piece(piece: RankShare) -> np.ndarray:
    """A piece as one byte array: a 4-int header, the per-sample columns, tokens (int32),
    masks (uint8), the recorded ``RESPONSE_FLOAT_COLUMNS`` (float32 each: log-probs,
    teacher log-probs, reverse-KL estimates), routed experts (int16 rows, MoE routing
    replay). Advantages travel in the plan."""
    floats = [getattr(piece, name) for name in RESPONSE_FLOAT_COLUMNS]
    routes = piece.rollout_routed_experts
    flags = (sum(1 << k for k, col in enumerate(floats) if col is not None)
             + (0 if routes is None else (routes.shape[1] + 1) << _ROUTE_SHIFT))
    header = np.array([piece.num_samples, len(piece.tokens), len(piece.loss_masks), flags],
                      dtype=np.int64)
    parts = [header, *(getattr(piece, n).astype(t, copy=False) for n, t in _COLUMNS),
             piece.tokens, piece.loss_masks, *(col for col in floats if col is not None),
             *(() if routes is None else (np.ascontiguousarray(routes).reshape(-1),))]
    return np.concatenate([p.view(np.uint8) for p in parts])


def unpack_piece(buf: np.ndarray, plan: SharePlan) -> RankShare:
    """The inverse of :func:`pack_piece`; the advantages come from the plan."""
    n, t, r, flags = (int(x) for x in buf[:32].view(np.int64))
    width = (flags >> _ROUTE_SHIFT) - 1
    pos, cols = 32, {}

    def take(count: int, dtype) -> np.ndarray:
        nonlocal pos
        size = count * np.dtype(dtype).itemsize
        out = buf[pos:pos + size].view(dtype)
        pos += size
        return out

    for name, dtype in _COLUMNS:
        cols[name] = take(n, dtype).astype(np.int64)
    tokens, masks = take(t, np.int32), take(r, np.uint8)
    floats = {name: take(r, np.float32) if flags >> k & 1 else None
              for k, name in enumerate(RESPONSE_FLOAT_COLUMNS)}
    routes = take(t * width, np.int16).reshape(t, width) if width >= 0 else None
    lengths, response_lengths = cols["lengths"], cols["response_lengths"]
    return RankShare(sample_ids=cols["sample_ids"], response_starts=cols["response_starts"],
                     lengths=lengths, response_lengths=response_lengths, tokens=tokens,
                     token_offsets=offsets_from_lengths(lengths), loss_masks=masks,
                     response_offsets=offsets_from_lengths(response_lengths),
                     advantages=plan.advantages[cols["sample_ids"]],
                     rollout_routed_experts=routes, **floats)


class ShareExchange:
    """One run's exchange on one member of ``group``: a gloo process group whose first members
    are the trainer ranks in rank order (member 0, trainer rank 0, plans), then any holders of
    their own (engine ranks: ``dp_rank`` None, they send pieces and receive none). ``group``
    None: the trainer ranks' own (``new_group``, collective: build it on every trainer rank).
    Works over a raw ``ProcessGroupGloo`` too (``torch.distributed``'s object collectives
    need a registered group; these use the group's own operations)."""

    def __init__(self, dp_rank: int | None, *, group: Any = None,
                 timeout_s: float = PG_BACKSTOP_S):
        if group is None:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        self.dp_rank = dp_rank
        self._dp_of: list[int | None] | None = None  # every member's DP index (first use)
        self.stats = ExchangeStats()
        self.parts: list[tuple[RolloutBatch, tuple[BatchMeta, ...]]] = []  # keep_parts only
        # Member 0, after a rollout: (member, its chunks' first prompts, their samples) per
        # holder, in each part's order; None elsewhere.
        self.holders: list[tuple[int, list[int], list[int]]] | None = None

    @property
    def dp_of(self) -> list[int | None]:
        """The DP index of every member (None: a holder of its own); collective on first use."""
        if self._dp_of is None:
            mine = -1 if self.dp_rank is None else self.dp_rank
            self._dp_of = [None if d < 0 else d for d in self._all_gather_int(mine)]
        return self._dp_of

    def distribute(self, part: RolloutBatch | None,
                   meta: Sequence[BatchMeta],
                   plan_fn: Callable[[BatchMeta | None], tuple[SharePlan | None, Any]] | None,
                   *, what: str, error: BaseException | None = None,
                   failure: type[VimeError] = ShareExchangeError,
                   name_of: Callable[[int], str] = lambda r: f"rank {r}",
                   keep_parts: bool = False
                   ) -> tuple[SharePlan | None, RankShare | None, Any]:
        """Collective: ``(plan, this rank's share, extra)`` on every member (module docstring).

        ``part`` / ``meta``: this member's part and its chunks' metadata, in the part's order
        (empty on non-holders);
        ``error``: this member's own failure in producing them (reported, then re-raised here);
        ``plan_fn(merged)`` runs on member 0 (None elsewhere) and returns ``(plan or None,
        extra)``: a None plan (nothing to train, e.g. every prompt filtered) returns ``(None,
        None, extra)`` everywhere. A failure anywhere raises on every member: the failing one
        its own error, member 0 a ``failure`` naming each failed holder (``name_of(member)``),
        the others ``RankFailure`` naming ``what``; nobody waits for a member that raised.
        ``keep_parts`` (member 0's counts): every trainer rank also receives every holder's
        part and metadata (``self.parts``: for inspection, ``RolloutEvent.gather_batch``;
        never on the training path)."""
        self.stats = ExchangeStats()
        self.parts = []
        self.holders = None
        try:
            return self._distribute(part, tuple(meta), plan_fn, what, error, failure, name_of,
                                    keep_parts)
        except ShareExchangeError as exc:  # a member is gone: this member's own failure,
            if error is not None:  # if any, says more (the bridge's, naming the rank)
                raise error from exc
            raise

    def _distribute(self, part: RolloutBatch | None, metas: tuple[BatchMeta, ...],
                    plan_fn: Callable[[BatchMeta | None], tuple[SharePlan | None, Any]] | None,
                    what: str, error: BaseException | None, failure: type[VimeError],
                    name_of: Callable[[int], str], keep_parts: bool
                    ) -> tuple[SharePlan | None, RankShare | None, Any]:
        mine = (("error", f"{type(error).__name__}: {error}") if error is not None
                else ("ok", metas) if metas else None)
        gathered = self._gather(mine)  # member 0's list, None elsewhere
        box: tuple[str, Any] | None = None
        if gathered is not None:
            assert plan_fn is not None  # member 0 plans: the step passes its planning
            box = self._plan(gathered, plan_fn, error, failure, name_of, keep_parts)
        kind, payload = self._broadcast(box, what)
        if error is not None:
            raise error
        if kind != "ok":
            raise RankFailure(f"{what} failed on rank 0: {payload}")
        plan, extra, shipped = payload
        if plan is None:
            return None, None, extra
        starts = (np.concatenate([m.part_starts for m in metas]) if metas
                  else np.zeros(0, dtype=np.int64))  # a member that holds no part
        share = self._all_to_all(part, starts, plan, what)
        if shipped:
            self.parts = self._ship_parts(part, metas, what)
        return plan, share, extra

    # -- phases ----------------------------------------------------------------------------
    def _gather(self, mine: tuple | None) -> list | None:
        data = b"" if mine is None else pickle.dumps(mine, protocol=5)
        self.stats.meta_sent = 0 if self.rank == 0 else len(data)
        received = self._bytes_to(data, [0], "the holders' metadata")
        if self.rank != 0:
            return None
        self.stats.meta_received = sum(len(b) for b in received[1:])
        return [pickle.loads(b.tobytes()) if len(b) else None for b in received]

    def _plan(self, gathered: list, plan_fn, own_error, failure, name_of,
              keep_parts: bool) -> tuple[str, Any]:
        """Member 0: ``("ok", (plan, extra, keep_parts))`` or ``("error", exception)``."""
        failed = [(name_of(r), g[1]) for r, g in enumerate(gathered)
                  if g is not None and g[0] != "ok"]
        if failed:
            return "error", own_error or failure(relayed(
                "rollout generation", failed, "see that rank's own error line (its traceback "
                "with --log-level debug)"))
        holders = [r for r, g in enumerate(gathered) if g is not None]
        # Who holds which chunks, in each part's order (a dump of parts records it).
        self.holders = [(r, [int(s) for m in gathered[r][1] for s in m.part_starts],
                         [int(n) for m in gathered[r][1] for n in m.part_sizes])
                        for r in holders]
        try:
            merged = (merge_meta([m for r in holders for m in gathered[r][1]]) if holders
                      else None)
            plan, extra = plan_fn(merged)
        except Exception as exc:  # noqa: BLE001 - every member hears of it below
            return "error", exc
        return "ok", (plan, extra, keep_parts)

    def _broadcast(self, box: tuple[str, Any] | None, what: str) -> tuple[str, Any]:
        """Member 0's verdict to every member, ``(kind, payload)``; member 0 raises its own
        failure after sending it."""
        error = box[1] if box is not None and box[0] == "error" else None
        if error is not None:
            box = ("error", f"{type(error).__name__}: {error}")
        if self.world > 1:
            data = pickle.dumps(box, protocol=5) if self.rank == 0 else b""
            box = pickle.loads(self._broadcast_bytes(data, f"{what}: the plan"))
        if error is not None:
            raise error
        assert box is not None
        if box[0] == "ok":
            self.stats.plan_bytes = 0 if box[1][0] is None else box[1][0].nbytes
        return box

    def _all_to_all(self, part: RolloutBatch | None, starts: np.ndarray,
                    plan: SharePlan, what: str) -> RankShare | None:
        """Every holder's pieces to every trainer rank; this rank's share (None on a holder of
        its own)."""
        dp_of = self.dp_of  # collective on first use: every member, holder or not
        pieces_out: list[np.ndarray] = [_EMPTY] * self.world
        if part is not None:
            by_dp = {dp: pack_piece(share_piece(part, plan, dp, starts=starts))
                     for dp in set(dp_of) if dp is not None}
            pieces_out = [_EMPTY if d is None else by_dp[d] for d in dp_of]
        received = (pieces_out if self.world == 1
                    else self._exchange(pieces_out, f"{what}: the shares"))
        self.stats.share_sent = sum(len(b) for b in pieces_out)
        self.stats.share_received = sum(len(b) for b in received)
        if self.dp_rank is None:
            return None
        return assemble_share([unpack_piece(b, plan) for b in received if len(b)], plan,
                              self.dp_rank)

    def _ship_parts(self, part: RolloutBatch | None, metas: tuple[BatchMeta, ...],
                    what: str) -> list[tuple[RolloutBatch, tuple[BatchMeta, ...]]]:
        """Every holder's part and metadata to every trainer rank (``keep_parts``)."""
        data = b"" if part is None else pickle.dumps((part, metas), protocol=5)
        trainers = [r for r, d in enumerate(self.dp_of) if d is not None]
        received = self._bytes_to(data, trainers, f"{what}: the parts for inspection")
        return [pickle.loads(b.tobytes()) for b in received if len(b)]

    # -- the group's own operations (a raw ProcessGroupGloo has no object collectives) -------
    def _wait(self, work: Any, what: str) -> None:
        try:
            wait_until(collective_done(work), f"{what} (the share exchange)")
        except RuntimeError as exc:  # gloo: a member's connection closed
            raise ShareExchangeError(
                f"{what} (the share exchange): a member of the exchange is gone "
                f"({str(exc)[:160]}). Fix: see that rank's error; the run stops on every "
                "rank.") from exc

    def _all_gather_int(self, value: int) -> list[int]:
        if self.world == 1:
            return [value]
        out = [[torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]]
        self._wait(self.group.allgather(out, [torch.tensor([value], dtype=torch.int64)]),
                   "every member's DP index")
        return [int(t[0]) for t in out[0]]

    def _bytes_to(self, data: bytes, members: list[int], what: str) -> list[np.ndarray]:
        """``data`` from every member to each of ``members``: there, one array per member
        (member order); elsewhere nothing."""
        buf = np.frombuffer(data, dtype=np.uint8)
        if self.world == 1:
            return [buf]
        pieces = [buf if r in members else _EMPTY for r in range(self.world)]
        received = self._exchange(pieces, what)
        return received if self.rank in members else []

    def _broadcast_bytes(self, data: bytes, what: str) -> bytes:
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(self.group.broadcast([size], _root()), what)
        payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
                   else torch.empty(int(size[0]), dtype=torch.uint8))
        self._wait(self.group.broadcast([payload], _root()), what)
        return payload.numpy().tobytes()

    def _exchange(self, pieces_out: list[np.ndarray], what: str) -> list[np.ndarray]:
        """One all-to-all of byte arrays: ``pieces_out[r]`` to member ``r``; what each member
        sent this one, in member order."""
        sizes = torch.tensor([len(b) for b in pieces_out], dtype=torch.int64)
        incoming = torch.empty(self.world, dtype=torch.int64)
        self._wait(self.group.alltoall_base(incoming, sizes, [1] * self.world,
                                            [1] * self.world, dist.AllToAllOptions()), what)
        send = torch.from_numpy(np.concatenate(pieces_out))
        recv = torch.empty(int(incoming.sum()), dtype=torch.uint8)
        self._wait(self.group.alltoall_base(recv, send, incoming.tolist(), sizes.tolist(),
                                            dist.AllToAllOptions()), what)
        cuts = np.cumsum(incoming.numpy())[:-1]
        return np.split(recv.numpy(), cuts)


_EMPTY = np.zeros(0, dtype=np.uint8)


def _root() -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options
