"""Moving a rollout batch held in parts: metadata to rank 0, the plan to all, each share alone.

The core decides (``vime_pure.data.shares``); this module moves bytes, over one gloo group of
the trainer's world (host memory only: on CUDA the default group is NCCL, and a rollout's bytes
never belong in GPU memory). Per rollout (``ShareExchange.distribute``):

1. **gather**: every holder (an engine leader, or rank 0 for a replay or a filtered batch)
   sends the ``BatchMeta`` of each work-queue chunk its part holds (~46 bytes per sample plus
   ~0.5 KB per chunk, numpy, no ``Sample``) or its error to rank 0; other ranks send ``None``;
2. **plan**: rank 0 merges the metadata in global prompt order (``merge_meta``: the batch
   does not depend on which engine claimed which chunk) and calls the caller's ``plan_fn`` (advantages,
   checks, the ``Schedule``: the core's functions), and broadcasts the ``SharePlan`` (flat
   arrays, ~33 bytes per sample) with the caller's extra result, or the failure, so every rank
   leaves together (no rank waits on a rank that raised);
3. **all-to-all**: each holder cuts from its part the samples every rank trains
   (``share_piece``: the plan's per-chunk offsets and the first prompts of the holder's own
   chunks are the owner map) and one ``all_to_all_single`` moves them: each rank receives exactly its
   DP rank's samples. Ranks sharing a DP index (TP / CP / PP peers) each receive the share
   directly from the holders: one collective, every receiver's bytes equal its share, at the
   price of holders sending a DP group's share ``tp*cp*pp`` times (a fan-out inside the DP
   group would save holder bandwidth but add a second collective and per-DP-index groups);
4. **assemble**: the rank's pieces in its execution order (``assemble_share``).

``ExchangeStats`` counts the bytes each rank sent and received per phase (what
``benchmarks/scale.py`` and the gloo test read).

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
from vime_pure.data.ragged import offsets_from_lengths
from vime_pure.data.shares import (BatchMeta, RankShare, SharePlan, assemble_share, merge_meta,
                                   share_piece)
from vime_pure.errors import VimeError, relayed
from vime_shell.engines.health import PG_BACKSTOP_S
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


def pack_piece(piece: RankShare) -> np.ndarray:
    """A piece as one byte array: a 4-int header, the per-sample columns, tokens (int32),
    masks (uint8), log-probs (float32, when recorded), routed experts (int16 rows, MoE routing
    replay). Advantages travel in the plan."""
    lp, routes = piece.rollout_log_probs, piece.rollout_routed_experts
    # flags: bit 0 log-probs present; the rest (width + 1) of the routed-expert rows, if any
    flags = int(lp is not None) + (0 if routes is None else 2 * (routes.shape[1] + 1))
    header = np.array([piece.num_samples, len(piece.tokens), len(piece.loss_masks), flags],
                      dtype=np.int64)
    parts = [header, *(getattr(piece, n).astype(t, copy=False) for n, t in _COLUMNS),
             piece.tokens, piece.loss_masks, *(() if lp is None else (lp,)),
             *(() if routes is None else (np.ascontiguousarray(routes).reshape(-1),))]
    return np.concatenate([p.view(np.uint8) for p in parts])


def unpack_piece(buf: np.ndarray, plan: SharePlan) -> RankShare:
    """The inverse of :func:`pack_piece`; the advantages come from the plan."""
    n, t, r, flags = (int(x) for x in buf[:32].view(np.int64))
    has_lp, width = flags & 1, flags // 2 - 1
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
    log_probs = take(r, np.float32) if has_lp else None
    routes = take(t * width, np.int16).reshape(t, width) if width >= 0 else None
    lengths, response_lengths = cols["lengths"], cols["response_lengths"]
    return RankShare(sample_ids=cols["sample_ids"], response_starts=cols["response_starts"],
                     lengths=lengths, response_lengths=response_lengths, tokens=tokens,
                     token_offsets=offsets_from_lengths(lengths), loss_masks=masks,
                     response_offsets=offsets_from_lengths(response_lengths),
                     rollout_log_probs=log_probs,
                     advantages=plan.advantages[cols["sample_ids"]],
                     rollout_routed_experts=routes)


class ShareExchange:
    """One run's exchange on one rank (build on every rank: ``new_group`` is collective)."""

    def __init__(self, dp_rank: int, *, timeout_s: float = PG_BACKSTOP_S):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.dp_rank = dp_rank
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        dps: list[Any] = [None] * self.world
        dist.all_gather_object(dps, dp_rank, group=self.group)
        self.dp_of = [int(d) for d in dps]  # DP index of every rank
        self.stats = ExchangeStats()

    def distribute(self, part: RolloutBatch | None,
                   meta: Sequence[BatchMeta],
                   plan_fn: Callable[[BatchMeta | None], tuple[SharePlan | None, Any]], *,
                   what: str, error: BaseException | None = None,
                   failure: type[VimeError] = ShareExchangeError,
                   name_of: Callable[[int], str] = lambda r: f"rank {r}"
                   ) -> tuple[SharePlan | None, RankShare | None, Any]:
        """Collective: ``(plan, this rank's share, extra)`` on every rank (module docstring).

        ``part`` / ``meta``: this rank's part and its chunks' metadata, in the part's order
        (empty on non-holders);
        ``error``: this rank's own failure in producing them (reported, then re-raised here);
        ``plan_fn(merged)`` runs on rank 0 and returns ``(plan or None, extra)``: a None plan
        (nothing to train, e.g. every prompt filtered) returns ``(None, None, extra)``
        everywhere. A failure anywhere raises on every rank: the failing rank its own error,
        rank 0 a ``failure`` naming each failed holder (``name_of(rank)``), the others
        ``RankFailure`` naming ``what``; nobody waits for a rank that raised."""
        self.stats = ExchangeStats()
        metas = tuple(meta)
        mine = (("error", f"{type(error).__name__}: {error}") if error is not None
                else ("ok", metas) if metas else None)
        gathered = self._gather(mine)  # rank 0's list, None elsewhere
        box: list[tuple[str, Any] | None] = [None]
        if gathered is not None:
            box = [self._plan(gathered, plan_fn, error, failure, name_of)]
        kind, payload = self._broadcast(box)
        if error is not None:
            raise error
        if kind != "ok":
            raise RankFailure(f"{what} failed on rank 0: {payload}")
        plan, extra = payload
        if plan is None:
            return None, None, extra
        starts = (np.concatenate([m.part_starts for m in metas]) if metas
                  else np.zeros(0, dtype=np.int64))  # a rank that holds no part
        share = self._all_to_all(part, starts, plan)
        return plan, share, extra

    # -- phases ----------------------------------------------------------------------------
    def _gather(self, mine: tuple | None) -> list | None:
        if self.world == 1:
            return [mine]
        self.stats.meta_sent = 0 if mine is None else len(pickle.dumps(mine, protocol=5))
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, out, dst=0, group=self.group)
        if out is not None:
            self.stats.meta_received = sum(len(pickle.dumps(o, protocol=5)) for o in out
                                           if o is not None) - self.stats.meta_sent
        return out

    def _plan(self, gathered: list, plan_fn, own_error, failure, name_of) -> tuple[str, Any]:
        """Rank 0: ``("ok", (plan, extra))`` or ``("error", exception)``."""
        failed = [(name_of(r), g[1]) for r, g in enumerate(gathered)
                  if g is not None and g[0] != "ok"]
        if failed:
            return "error", own_error or failure(relayed(
                "rollout generation", failed, "see that rank's own error line (its traceback "
                "with --log-level debug)"))
        holders = [r for r, g in enumerate(gathered) if g is not None]
        try:
            merged = (merge_meta([m for r in holders for m in gathered[r][1]]) if holders
                      else None)
            plan, extra = plan_fn(merged)
        except Exception as exc:  # noqa: BLE001 - every rank hears of it below
            return "error", exc
        return "ok", (plan, extra)

    def _broadcast(self, box: list) -> tuple[str, Any]:
        """Rank 0's verdict to every rank, ``(kind, payload)``; rank 0 raises its own failure
        after sending it."""
        kind, payload = box[0] if self.rank == 0 else (None, None)
        error = payload if kind == "error" else None
        if error is not None:
            box = [("error", f"{type(error).__name__}: {error}")]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        if error is not None:
            raise error
        if box[0][0] == "ok":
            self.stats.plan_bytes = 0 if box[0][1][0] is None else box[0][1][0].nbytes
        return box[0]

    def _all_to_all(self, part: RolloutBatch | None, starts: np.ndarray,
                    plan: SharePlan) -> RankShare:
        """Every holder's pieces to every rank; this rank's share."""
        pieces_out: list[np.ndarray] = []
        if part is not None:
            by_dp = {dp: pack_piece(share_piece(part, plan, dp, starts=starts))
                     for dp in set(self.dp_of)}
            pieces_out = [by_dp[self.dp_of[d]] for d in range(self.world)]
        if self.world == 1:
            received = pieces_out
        else:
            received = self._exchange(pieces_out)
        self.stats.share_sent = sum(len(b) for b in pieces_out)
        self.stats.share_received = sum(len(b) for b in received)
        return assemble_share([unpack_piece(b, plan) for b in received if len(b)], plan,
                              self.dp_rank)

    def _exchange(self, pieces_out: list[np.ndarray]) -> list[np.ndarray]:
        sizes = torch.tensor([len(b) for b in pieces_out] if pieces_out else [0] * self.world,
                             dtype=torch.int64)
        incoming = torch.empty(self.world, dtype=torch.int64)
        dist.all_to_all_single(incoming, sizes, group=self.group)
        send = torch.from_numpy(np.concatenate(pieces_out) if pieces_out
                                else np.zeros(0, np.uint8))
        recv = torch.empty(int(incoming.sum()), dtype=torch.uint8)
        dist.all_to_all_single(recv, send, incoming.tolist(), sizes.tolist(), group=self.group)
        cuts = np.cumsum(incoming.numpy())[:-1]
        return np.split(recv.numpy(), cuts)
