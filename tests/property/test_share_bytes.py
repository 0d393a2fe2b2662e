"""The byte bound of one rank (``vime_pure.data.share_bytes``): metadata plus its own share.

Properties, for any per-prompt rollout output cut into engine parts and any schedulable
layout: a DP rank's ``share_bytes`` is exactly the bytes of the pieces the exchange packs for
it (``vime_shell.sources.exchange.pack_piece``, one per holder); the metadata bytes cover every
holder's pickled metadata reply (what rank 0 gathers) plus the plan; the shares add up to the
batch; a rank's bound is the metadata plus its share, below the metadata plus the batch.
"""

import pickle

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.property.test_shares import _pieces, _plan, _same_share, _schedulable, split_outputs
from vime_pure import BatchingPolicy, ParallelLayout, RolloutBatch, Sample
from vime_pure.data.shards import merge_rollout_shares
from vime_pure.data.share_bytes import batch_bytes, metadata_bytes, rank_bound, share_bytes
from vime_pure.data.shares import output_part, part_meta, plan_shares, share_piece
from vime_pure.errors import RolloutBatchError
from vime_shell.sources.exchange import pack_piece, unpack_piece


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
        for piece in pieces:  # the wire format round-trips every column, optional ones too
            _same_share(unpack_piece(pack_piece(piece), plan), piece)
        assert packed == share_bytes(meta, plan, dp, holders=len(parts))
        assert share_bytes(meta, plan, dp, holders=len(parts)) <= share_bytes(meta, plan, dp)
        shares.append(share_bytes(meta, plan, dp, holders=1))
        assert rank_bound(meta, plan, dp) == metadata_bytes(meta, plan) + share_bytes(
            meta, plan, dp)
    assert sum(shares) == batch_bytes(meta, plan)
    assert all(rank_bound(meta, plan, dp, holders=1) <= metadata_bytes(meta, plan)
               + batch_bytes(meta, plan) for dp in range(layout.dp))


@settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow])
@given(split_outputs(), st.data())
def test_the_bound_reads_the_same_from_the_whole_batch_as_from_the_merged_parts(case, data):
    """A rank that sees the whole batch (``gather_batch``) but not the merged metadata gets
    the same bound from ``part_meta`` of it: the parts are the plan's."""
    _, parts = case
    whole = RolloutBatch.from_samples(merge_rollout_shares([p for _, p in parts]))
    layout, policy, _ = _schedulable(data, whole)
    _, meta, plan = _plan(parts, layout, policy)
    one = part_meta(whole)
    for dp in range(layout.dp):
        assert rank_bound(one, plan, dp) == rank_bound(meta, plan, dp)


def test_a_batch_with_routed_experts_needs_their_width():
    """Routing replay's int16 rows are part of a share: the bound refuses to guess them."""
    output = [[Sample(tokens=[1, 2, 3], response_length=2, reward=1.0,
                      rollout_routed_experts=np.tile(np.arange(2, dtype=np.int16), (3, 1, 1)))]]
    part, meta = output_part(output)
    meta, plan = plan_shares(meta, ParallelLayout(dp=1), BatchingPolicy(
        global_batch_size=1, max_tokens_per_gpu=8))
    with pytest.raises(RolloutBatchError, match=r"^route_width=0: is needed"):
        share_bytes(meta, plan, 0)
    assert share_bytes(meta, plan, 0, route_width=2) == share_bytes(
        attrs.evolve(meta, has_routes=False), plan, 0) + 3 * 2 * 2


def test_each_response_float_column_has_its_flag_bit_and_routes_their_width():
    """A piece with reverse-KL estimates and routed experts but no log-probs: flag bit 2 and
    the routes' width + 1 above the three column bits; unpacked, the columns come back."""
    output = [[Sample(tokens=[1, 2, 3], response_length=2, reward=1.0,
                      opd_reverse_kl=[0.75, -1.25],
                      rollout_routed_experts=np.tile(np.arange(2, dtype=np.int16), (3, 1, 1)))]]
    part, meta = output_part(output)
    assert meta.has_opd_reverse_kl and not (meta.has_log_probs or meta.has_teacher)
    meta, plan = plan_shares(meta, ParallelLayout(dp=1), BatchingPolicy(
        global_batch_size=1, max_tokens_per_gpu=8))
    piece = share_piece(part, plan, 0, starts=np.zeros(1, dtype=np.int64))
    packed = pack_piece(piece)
    assert int(packed[:32].view(np.int64)[3]) == 4 + ((2 + 1) << 3)
    assert len(packed) == share_bytes(meta, plan, 0, route_width=2)
    back = unpack_piece(packed, plan)
    assert back.opd_reverse_kl.tolist() == [0.75, -1.25]
    assert back.rollout_log_probs is None and back.teacher_log_probs is None
    _same_share(back, piece)
