"""How many bytes of a rollout batch one rank may receive: metadata plus its own share.

The yardstick of "one batch shape: parts everywhere" (issue 32): no trainer rank should
receive more of a rollout than the batch's metadata and the samples it trains itself. From
the merged ``BatchMeta`` and the ``SharePlan`` (``vime_pure.data.shares``), without a token:

1. **metadata** (``metadata_bytes``): the ``BatchMeta`` columns (46 bytes per sample, 8 more
   for the advantages a whole batch carries, a bool per id, ``PART_BYTES`` per part), an envelope per part for the record around them
   (``META_ENVELOPE_BYTES``: class and field names, one array header per column, the reply
   tuple), ``ID_BYTES`` per original group and prompt id, and the plan's arrays
   (``SharePlan.nbytes``) that every rank receives. The parts are the plan's (its
   ``part_starts``), so a ``BatchMeta`` of the whole batch as one part (``part_meta``, e.g.
   of a gathered batch) gives the same count as the merged one;
2. **share** (``share_bytes``): what the all-to-all delivers to DP rank ``d``, as
   ``vime_shell.sources.exchange.pack_piece`` lays it out: a ``PIECE_HEADER_BYTES`` header per
   holder's piece, ``SAMPLE_BYTES`` per sample (id and response start int64, lengths int32),
   int32 tokens, uint8 loss masks, float32 per response token for each recorded
   ``RESPONSE_FLOAT_COLUMNS`` column (rollout and teacher log-probs, reverse-KL estimates),
   int16 routed experts (``route_width`` per token) under routing replay;
3. **bound** (``rank_bound``): 1 + 2.

Example: 16 samples in 1 part, DP rank 0 trains 8 of them with 40 tokens of which 20 are
response tokens, log-probs recorded: its share is 32 + 8 * 24 + 40 * 4 + 20 * 5 = 484 bytes.
"""

import numpy as np

from vime_pure.data.columns import RESPONSE_FLOAT_COLUMNS
from vime_pure.data.shares import PRESENCE_FLAGS, BatchMeta, SharePlan
from vime_pure.errors import RolloutBatchError, field_error

PIECE_HEADER_BYTES = 32  # 4 int64: samples, tokens, response tokens, flags
SAMPLE_BYTES = 24  # sample id and response start (int64), length and response length (int32)
TOKEN_BYTES = 4  # int32
MASK_BYTES = 1  # uint8
FLOAT_BYTES = 4  # float32, per response token of each RESPONSE_FLOAT_COLUMNS column
ROUTE_BYTES = 2  # int16 per routed expert
ADVANTAGE_BYTES = 8  # float64, in a whole batch's metadata (a replay's, a filtered batch's)
# a part's size, response tokens, outputs, first prompt and tool calls (int64 each)
PART_BYTES = 40
_PART_ARRAYS = ("part_sizes", "part_response_tokens", "part_outputs", "part_starts",
                "part_tool_calls")
# A pickled BatchMeta around its columns (measured ~1 KB: ~20 numpy headers, the record's
# class and field names, the holder's ("ok", (...)) reply), doubled.
META_ENVELOPE_BYTES = 2048
ID_BYTES = 32  # one original group or prompt id pickled (an int, or a short string)


def metadata_bytes(meta: BatchMeta, plan: SharePlan) -> int:
    """The bytes of the batch's metadata: its columns, one envelope per part, its original
    ids, and the plan (module docstring)."""
    ids = len(meta.group_id_values) + len(meta.prompt_group_values)
    # per sample and per id; advantages always counted (a whole batch's travel with it)
    columns = (meta.nbytes - sum(getattr(meta, name).nbytes for name in _PART_ARRAYS
                                 if getattr(meta, name) is not None)
               - (0 if meta.advantages is None else meta.advantages.nbytes)
               + ADVANTAGE_BYTES * meta.num_samples)
    parts = len(plan.part_starts)
    return columns + (PART_BYTES + META_ENVELOPE_BYTES) * parts + ID_BYTES * ids + plan.nbytes


def share_bytes(meta: BatchMeta, plan: SharePlan, dp_rank: int, *, holders: int | None = None,
                route_width: int = 0) -> int:
    """The bytes DP rank ``dp_rank``'s share occupies on the wire (module docstring);
    ``holders``: how many holders send it a piece (default: one per part of the plan, the
    most);
    ``route_width``: routed experts per token (layers x top-k) under routing replay."""
    if meta.has_routes and route_width <= 0:
        raise field_error(RolloutBatchError, "route_width", route_width,
                          "is needed: the batch carries routed experts",
                          "pass the layers x top-k of the rollout's routed experts")
    ids = plan.schedule.rank_sample_ids(dp_rank)
    tokens = int(meta.lengths[ids].astype(np.int64).sum())
    response = int(meta.response_lengths[ids].astype(np.int64).sum())
    floats = sum(getattr(meta, PRESENCE_FLAGS[name]) for name in RESPONSE_FLOAT_COLUMNS)
    per_response = MASK_BYTES + FLOAT_BYTES * floats
    per_token = TOKEN_BYTES + (ROUTE_BYTES * route_width if meta.has_routes else 0)
    pieces = len(plan.part_starts) if holders is None else holders
    return (PIECE_HEADER_BYTES * pieces + SAMPLE_BYTES * len(ids) + per_token * tokens
            + per_response * response)


def rank_bound(meta: BatchMeta, plan: SharePlan, dp_rank: int, *, holders: int | None = None,
               route_width: int = 0) -> int:
    """The most bytes of the rollout a rank of DP index ``dp_rank`` should receive: the
    batch's metadata plus its own share."""
    return metadata_bytes(meta, plan) + share_bytes(meta, plan, dp_rank, holders=holders,
                                                    route_width=route_width)


def batch_bytes(meta: BatchMeta, plan: SharePlan, *, route_width: int = 0) -> int:
    """Every DP rank's share together (one holder each): the batch's samples on the wire,
    what a rank holding the whole batch received at least (in this layout)."""
    return sum(share_bytes(meta, plan, d, holders=1, route_width=route_width)
               for d in range(plan.schedule.layout.dp))
