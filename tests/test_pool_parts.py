"""Trainer rank 0's side of the fully-async pools (``vime_shell.sources.pool_parts``): the
pools' groups joined into the batch on rank 0 (``join_pool_parts``) and the same groups kept in
the pools, placed in draw order (``place_pool_parts``) and merged by the exchange from one
chunk per run of consecutive places (``place_runs``), give the same batch bit for bit, the same advantages and the same record,
whichever pool claimed which group and in whatever order it completed them."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.property.data_strategies import rollout_outputs
from tests.property.test_shards import assert_same_batch
from vime_pure import BatchingPolicy, ParallelLayout
from vime_pure.data.held_parts import claimed_part, held_rows, join_parts
from vime_pure.data.shares import merge_meta, plan_shares
from vime_pure.pool_ranks import place_runs
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.pool_parts import join_pool_parts, place_pool_parts

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
