"""RolloutBatch columns and per-rank shards: invariants, round trip through the schedule."""

import attrs
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from vime_pure import (BatchingPolicy, ParallelLayout, RolloutBatch, RolloutBatchError, Sample,
                       ScheduleError, flatten_rollout_output, group_mask_sums, schedule_for,
                       shard)
from tests.data_invariants import assert_rolloutbatch_invariants, assert_shard_invariants
from tests.property.data_strategies import rollout_outputs, schedule_configs


@given(rollout_outputs())
def test_from_samples_builds_valid_columns_that_reproduce_the_samples(output):
    """``from_samples`` copies each flattened sample's fields into its rows, so the columns
    hold RolloutBatch's invariants and give every sample back."""
    flat = flatten_rollout_output(output)
    batch = RolloutBatch.from_samples(output)
    assert_rolloutbatch_invariants(batch, flat.samples, flat.group_ids)


@given(rollout_outputs(depth=1), st.data())
def test_shards_concatenated_in_schedule_order_reproduce_the_rows(output, data):
    """``shard`` only slices the batch's rows along the schedule's partitions, which cover the
    kept samples exactly once, so concatenating the slices gives the rows back."""
    batch = RolloutBatch.from_samples(output)
    layout, policy = data.draw(schedule_configs(batch.num_groups))
    try:
        sched = schedule_for(batch, layout, policy)
    except ScheduleError:
        assume(False)
    shards = shard(batch, sched)
    assert_shard_invariants(shards, batch, sched)
    # Concatenating every step's micro-batches rank by rank covers exactly the kept rows.
    order = [i for step in sched.steps for rank in step.microbatches for mb in rank for i in mb]
    got = np.concatenate([sh.sample_indices[sh.rows(j)] for s in range(sched.num_steps)
                          for sh in shards for j in sh.microbatches_of_step(s)])
    assert got.tolist() == order
    assert sorted(order + list(sched.dropped_samples)) == list(range(batch.num_samples))
    tokens = np.concatenate([sh.tokens for sh in shards])
    rows = np.concatenate([sh.sample_indices for sh in shards])
    assert tokens.tolist() == [t for i in rows.tolist() for t in batch.sample_tokens(i).tolist()]


def test_docstring_example():
    batch = RolloutBatch.from_samples([[
        Sample(tokens=[1, 2, 3], response_length=2, reward=1.0),
        Sample(tokens=[1, 2, 4, 5], response_length=2, reward=0.0)]])
    assert batch.token_offsets.tolist() == [0, 3, 7]
    assert batch.group_ids.tolist() == [0, 1] and batch.prompt_groups.tolist() == [0, 0]
    assert batch.group_mask_sums.tolist() == [2.0, 2.0]
    np.testing.assert_allclose(batch.advantages, [1.0, -1.0], atol=1e-5)


def test_group_mask_sums_come_from_the_loss_helper():
    out = [[Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 0], reward=1.0, group_id=4),
            Sample(tokens=[5, 6, 7], response_length=3, reward=1.0, group_id=4),
            Sample(tokens=[8, 9], response_length=1, reward=0.0, remove_sample=True)]]
    batch = RolloutBatch.from_samples(out)
    masks = [[1, 0], [1, 1, 1], [0]]
    np.testing.assert_array_equal(batch.group_mask_sums, group_mask_sums(
        [4, 4, 0], [[float(v) for v in m] for m in masks]))
    assert batch.group_mask_sums.tolist() == [4.0, 4.0, 0.0]
    assert batch.original_group_ids() == [4, 4, 0]  # fallback 0 does not collide with 4


def _two_rank_batch():
    out = [[Sample(tokens=list(range(1, 4 + k % 5)), response_length=1 + k % 2, reward=float(k % 3),
                   rollout_log_probs=[-0.5] * (1 + k % 2)) for k in range(4 * p, 4 * p + 4)]
           for p in range(4)]
    return RolloutBatch.from_samples(out)


def test_microbatch_access_path_for_the_trainer():
    batch = _two_rank_batch()
    sched = schedule_for(batch, ParallelLayout(dp=2), BatchingPolicy(global_batch_size=8,
                                                                       max_tokens_per_gpu=8))
    shards = shard(batch, sched)
    assert_shard_invariants(shards, batch, sched)
    mb = shards[1].microbatch(0)
    assert mb.num_groups == sched.steps[0].num_groups == 8
    assert mb.rollout_log_probs is not None
    resp = mb.loss_mask > 0
    assert (mb.rollout_log_probs[resp] == -0.5).all() and (mb.rollout_log_probs[~resp] == 0).all()
    assert mb.positions[mb.cu_seqlens[:-1]].tolist() == [0] * len(mb.sample_indices)


def test_dropped_groups_are_not_sharded_but_reported():
    batch = _two_rank_batch()  # 16 groups of one sample; 3 steps of 5 drop one group
    sched = schedule_for(batch, ParallelLayout(dp=1), BatchingPolicy(global_batch_size=5,
                                                                       max_tokens_per_gpu=8))
    shards = shard(batch, sched)
    assert len(sched.dropped_samples) == 1
    assert sched.dropped_samples[0] not in shards[0].sample_indices.tolist()
    assert list(shards[0].num_groups) == [5, 5, 5]


def test_shard_rejects_a_schedule_of_another_batch():
    batch = _two_rank_batch()
    other = RolloutBatch.from_samples([[Sample(tokens=[1, 2], response_length=1, reward=0.0)]])
    sched = schedule_for(other, ParallelLayout(dp=1), BatchingPolicy(global_batch_size=1,
                                                                       max_tokens_per_gpu=8))
    with pytest.raises(RolloutBatchError, match="built for another batch"):
        shard(batch, sched)


def test_columns_are_read_only_and_cross_checked():
    batch = _two_rank_batch()
    with pytest.raises(ValueError, match="read-only"):
        batch.tokens[0] = 5
    with pytest.raises(RolloutBatchError, match=r"RolloutBatch.rewards has shape \(3,\)"):
        attrs.evolve(batch, rewards=np.zeros(3))
    with pytest.raises(RolloutBatchError, match=r"tokens is float64\[.*expected a 1-D int32"):
        attrs.evolve(batch, tokens=batch.tokens.astype(np.float64))
    siblings = RolloutBatch.from_samples([[Sample(tokens=[1, 2], response_length=1, reward=1.0,
                                                  group_id="g")] * 2])
    with pytest.raises(RolloutBatchError, match=r"advantages\[1\]=0.5 .*siblings share one value"):
        attrs.evolve(siblings, advantages=np.array([0.0, 0.5]))
    with pytest.raises(RolloutBatchError, match=r"rewards\[0\]=nan .*finite"):
        attrs.evolve(siblings, rewards=np.array([np.nan, np.nan]))
    with pytest.raises(RolloutBatchError, match=r"group_mask_sums\[0\]"):
        attrs.evolve(batch, group_mask_sums=batch.group_mask_sums + 1)
    with pytest.raises(RolloutBatchError, match=r"lengths\[0\]=-1 breaks the rule"):
        attrs.evolve(batch, lengths=np.r_[-1, batch.lengths[1:]])
