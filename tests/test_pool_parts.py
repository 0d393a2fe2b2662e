"""Trainer rank 0's side of the fully-async pools (``vime_shell.sources.pool_parts``): the
pools' groups joined into the batch on rank 0 (``join_pool_parts``) and the same groups kept in
the pools, placed in draw order (``place_pool_parts``) and merged by the exchange from one
chunk per run of consecutive places (``place_runs``), give the same batch bit for bit, the same advantages and the same record,
whichever pool claimed which group and in whatever order it completed them."""

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.property.data_strategies import rollout_outputs
from tests.property.test_shards import assert_same_batch
from vime_pure import BatchingPolicy, ParallelLayout
from vime_pure.data.held_parts import claimed_part, held_rows, join_parts
from vime_pure.data.sample import Sample
from vime_pure.data.shares import merge_meta, plan_shares
from vime_pure.pool_ranks import place_runs
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.pool import GroupPool, pool_claims
from vime_shell.sources.pool_parts import _token_record, join_pool_parts, place_pool_parts

COUNTS = {"pool_started": 0, "pool_trained": 0, "pool_recycled": 0, "pool_filtered": 0}


@st.composite
def pool_parts(draw):
    """One batch of ``B`` groups (one top-level output entry each, drawn at ``(0, i)``) spread
    over 1-3 pools, each pool's groups in a completion order of its own."""
    output = list(draw(rollout_outputs(depth=draw(st.integers(1, 2)))))
    pools = draw(st.integers(1, 3))
    owner = [draw(st.integers(0, pools - 1)) for _ in output]
    parts = []
    for j in range(pools):
        mine = draw(st.permutations([i for i, o in enumerate(owner) if o == j]))
        groups = [((0, i), output[i], draw(st.integers(0, 2))) for i in mine]
        state = {"block": 0, "starts": [[0, 0, 0], [1, len(output), 1]],
                 "done": [[0, i] for i in mine]}
        parts.append(("part", 3, groups, dict(COUNTS, pool_trained=len(mine)), state))
    return output, parts


@settings(max_examples=60, deadline=None)
@given(pool_parts())
def test_groups_kept_in_the_pools_give_the_batch_joined_on_rank_0(case):
    output, parts = case
    cfg = TrainConfig(rollout_batch_size=len(output), global_batch_size=1)
    joined = join_pool_parts(cfg, parts)
    held = [(tag, k, [(key, None, v) for key, _, v in groups], counts, state)
            for tag, k, groups, counts, state in parts]
    placed = place_pool_parts(cfg, held)
    assert placed[3] == joined[3] and placed[4] == joined[4]  # record, resume point
    chunks = [claimed_part([(first, [part[2][i][1] for i in run])
                            for first, run in place_runs(places)],
                           normalization=cfg.reward_normalization())
              for places, part in zip(placed[6], parts)]
    kept = [(p, m) for p, m in chunks if p is not None]
    meta, _ = plan_shares(merge_meta([m for _, ms in kept for m in ms]), ParallelLayout(dp=1),
                          BatchingPolicy(global_batch_size=1, max_tokens_per_gpu=10**6,
                                         allow_partial_step=True),
                          normalization=cfg.reward_normalization())
    batch = joined[2]
    np.testing.assert_array_equal(meta.advantages, batch.advantages)
    assert_same_batch(join_parts([p for p, _ in kept], meta,
                                 rows=held_rows([ms for _, ms in kept])), batch)


def test_places_are_each_groups_position_in_draw_order():
    """The module's example: pool 0 holds (3, 0), (3, 3), (3, 1) in completion order, pool 1
    holds (3, 2): their places are [0, 3, 1] and [2]."""
    state = {"block": 3, "starts": [[3, 0, 0], [4, 4, 1]], "done": []}
    parts = [("held", 5, [((3, 0), None, 1), ((3, 3), None, 1), ((3, 1), None, 0)],
              COUNTS, state),
             ("held", 5, [((3, 2), None, 1)], COUNTS, state)]
    reply = place_pool_parts(TrainConfig(rollout_batch_size=4, global_batch_size=4), parts)
    assert reply[:3] == ("held", 5, None) and reply[6] == [[0, 3, 1], [2]]
    assert reply[3]["weight_version"] == 0
    assert (reply[3]["pool_part_engine_rank_0"], reply[3]["pool_part_engine_rank_1"]) == (3, 1)


def test_a_pool_masks_the_tokens_staler_than_its_bound_and_records_the_rest():
    """In-flight updates: the pool takes a group for batch k with its stale tokens masked
    (``GroupPool._bound_tokens``), its versions those of the tokens it trains, and the
    trained tokens counted per staleness for the record (``token_staleness/<s>``)."""
    pool = SimpleNamespace(bound=1, stale_tokens=0, token_staleness={})
    spans = Sample(tokens=[7, 1, 2, 3, 4], response_length=4, loss_mask=[1, 1, 0, 1],
                   token_versions=[2, 2, -1, 3], weight_versions=[2, 3])
    old = Sample(tokens=[7, 5], response_length=1, token_versions=[1], weight_versions=[1])
    plain = Sample(tokens=[7, 6], response_length=1, weight_versions=[3])  # not recorded
    GroupPool._bound_tokens(pool, [[spans, old, plain]], 4)
    assert spans.loss_mask == [0, 0, 0, 1] and spans.weight_versions == [3]
    assert old.loss_mask == [0] and old.weight_versions == [1]  # nothing left: its last
    assert plain.loss_mask is None and plain.weight_versions == [3]
    assert pool.stale_tokens == 3 and pool.token_staleness == {1: 1}
    parts = [("held", 4, [], {"pool_paused_requests": 2, "pool_stale_tokens_masked": 3,
                              "pool_token_staleness": {1: 1, 0: 3}}, {})]
    assert _token_record(parts) == {"token_staleness/0": 0.75, "token_staleness/1": 0.25,
                                    "token_staleness_max": 1, "stale_tokens_masked": 3}


def test_a_pool_keeps_its_share_of_async_max_concurrent_samples_in_flight():
    one = SimpleNamespace(is_leader=lambda r: True, engine_of=lambda r: r, num_engines=1)
    assert pool_claims(None, 16, one, 0, False)[1] == 16  # one batch's groups, as before
    assert pool_claims(None, 16, one, 0, False, 16)[1] == 16
    assert pool_claims(None, 16, one, 0, False, 38)[1] == 38
    # ... and admits against it (plus one batch ready), not a fixed two batches
    assert pool_claims(None, 16, one, 0, False)[0].in_flight == 16
    assert pool_claims(None, 16, one, 0, False, 38)[0].in_flight == 38
    two = SimpleNamespace(is_leader=lambda r: True, engine_of=lambda r: r, num_engines=2)
    claims, capacity = pool_claims(None, 16, two, 1, True, 38)
    assert capacity == claims.in_flight == 19  # static slices: its share
