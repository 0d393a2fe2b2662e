"""The byte bound of one rank (``vime_pure.data.share_bytes``): metadata plus its own share.

Properties, for any per-prompt rollout output cut into engine parts and any schedulable
layout: a DP rank's ``share_bytes`` is exactly the bytes of the pieces the exchange packs for
it (``vime_shell.train.exchange.pack_piece``, one per holder); the metadata bytes cover every
holder's pickled metadata reply (what rank 0 gathers) plus the plan; the shares add up to the
batch; a rank's bound is the metadata plus its share, below the metadata plus the batch.
"""

import pickle

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.property.test_shares import _pieces, _plan, _schedulable, split_outputs
from vime_pure import RolloutBatch
from vime_pure.data.shards import merge_rollout_shares
from vime_pure.data.share_bytes import batch_bytes, metadata_bytes, rank_bound, share_bytes
from vime_pure.data.shares import output_part
from vime_shell.train.exchange import pack_piece


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(split_outputs(), st.data())
def test_share_bytes_are_the_packed_pieces_and_the_bound_covers_the_metadata(case, data):
    """Theorem: the core's count equals the exchange's packing byte for byte, and its
    metadata allowance covers what rank 0 gathers from every holder, so a measured rank
    that receives only metadata and its share stays within ``rank_bound``."""
    _, parts = case
    whole = RolloutBatch.from_samples(merge_rollout_shares([p for _, p in parts]))
    layout, policy, _ = _schedulable(data, whole)
    batches, meta, plan = _plan(parts, layout, policy)
    gathered = sum(len(pickle.dumps(("ok", (output_part(p, start=s)[1],)), protocol=5))
                   for s, p in parts)
    assert gathered + plan.nbytes <= metadata_bytes(meta, plan)
    shares = []
    for dp in range(layout.dp):
        pieces = _pieces(list(zip(parts, batches)), plan, dp)
        packed = sum(len(pack_piece(p)) for p in pieces)
        assert packed == share_bytes(meta, plan, dp, holders=len(parts))
        assert share_bytes(meta, plan, dp, holders=len(parts)) <= share_bytes(meta, plan, dp)
        shares.append(share_bytes(meta, plan, dp, holders=1))
        assert rank_bound(meta, plan, dp) == metadata_bytes(meta, plan) + share_bytes(
            meta, plan, dp)
    assert sum(shares) == batch_bytes(meta, plan)
    assert all(rank_bound(meta, plan, dp, holders=1) <= metadata_bytes(meta, plan)
               + batch_bytes(meta, plan) for dp in range(layout.dp))
