"""The sharded batch (``vime_pure.data.shares``): metadata, plan, pieces and shares.

Properties: splitting any per-prompt rollout output into engine parts, merging their metadata
and planning gives the whole batch's advantages, group numbering and schedule; every DP rank's
share, assembled from the pieces each part cuts for it, builds records equal field by field to
``rank_batch`` on the whole batch, under every loss mode and CP size; a rank's share holds its
scheduled samples and nothing else.
"""

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.property.data_strategies import rollout_outputs, schedule_configs
from tests.property.test_shards import assert_same_batch
from vime_pure import (BatchingPolicy, ParallelLayout, RolloutBatch, Sample, ScheduleError,
                       rank_batch, schedule_for)
from vime_pure.data.microbatch import share_batch
from vime_pure.data.shards import merge_rollout_shares, prompt_shares
from vime_pure.data.shares import (assemble_share, join_parts, merge_meta, output_part,
                                   plan_shares, share_piece)
from vime_pure.denominators import LossMode
from vime_pure.errors import RolloutBatchError, RolloutValidationError


@st.composite
def split_outputs(draw):
    """A per-prompt output (depth >= 1), cut into 1-3 engine parts by ``prompt_shares``."""
    output = list(draw(rollout_outputs(depth=draw(st.integers(1, 2)))))
    engines = draw(st.integers(1, 3))
    parts = [output[s.start:s.stop] for s in prompt_shares(len(output), engines)]
    return output, [p for p in parts if p]


def _plan(parts, layout, policy):
    pieces = [output_part(p) for p in parts]
    meta, plan = plan_shares(merge_meta([m for _, m in pieces]), layout, policy)
    return [b for b, _ in pieces], meta, plan


def _records_equal(a, b) -> None:
    assert a.num_response_tokens == b.num_response_tokens
    assert len(a.steps) == len(b.steps)
    for sa, sb in zip(a.steps, b.steps):
        assert (sa.num_groups, sa.num_samples) == (sb.num_groups, sb.num_samples)
        for x, y in zip(sa.microbatches, sb.microbatches, strict=True):
            for f in attrs.fields(type(x)):
                u, v = getattr(x, f.name), getattr(y, f.name)
                if isinstance(u, np.ndarray) or isinstance(v, np.ndarray):
                    np.testing.assert_array_equal(u, v, err_msg=f.name)
                else:
                    assert u == v, f.name


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(split_outputs(), st.data())
def test_shares_build_the_whole_batch_records(case, data):
    """Theorem: metadata carry every number the schedule, the advantages and the records
    need, and a share carries exactly its rank's samples, so the sharded path equals the
    whole-batch path bit for bit (merged output -> one batch -> rank_batch)."""
    output, parts = case
    whole = RolloutBatch.from_samples(merge_rollout_shares(parts))
    layout, policy = data.draw(schedule_configs(whole.num_groups))
    try:
        schedule = schedule_for(whole, layout, policy)
    except ScheduleError:
        assume(False)
    batches, meta, plan = _plan(parts, layout, policy)
    assert plan.schedule == schedule
    assert meta.group_id_values == whole.group_id_values
    assert meta.prompt_group_values == whole.prompt_group_values
    np.testing.assert_array_equal(meta.advantages, whole.advantages)
    np.testing.assert_array_equal(meta.mask_sums, whole.mask_sums)
    mode = data.draw(st.sampled_from(list(LossMode)))
    cp = data.draw(st.sampled_from([1, 2]))
    for dp in range(layout.dp):
        share = assemble_share([share_piece(b, p, plan, dp) for p, b in enumerate(batches)],
                               plan, dp)
        ids = schedule.rank_sample_ids(dp)
        np.testing.assert_array_equal(share.sample_ids, ids)
        assert share.tokens.size == int(whole.lengths[ids].sum())  # its samples, nothing more
        for cp_rank in range(cp):
            kw = dict(dp_rank=dp, loss_mode=mode, cp_size=cp, cp_rank=cp_rank, norm=8.0)
            _records_equal(share_batch(share, plan.schedule, plan.mask_sums, **kw),
                           rank_batch(whole, schedule, **kw))


def test_none_ids_are_numbered_after_the_merge():
    """Two engines whose rollouts leave group ids None get the ids one merged output gets."""
    parts = [[[Sample(tokens=[1, 2], response_length=1, reward=1.0, group_id=0),
               Sample(tokens=[1, 3], response_length=1, reward=0.0)]],
             [[Sample(tokens=[4, 2], response_length=1, reward=1.0),
               Sample(tokens=[4, 3], response_length=1, reward=0.0, group_id=5)]]]
    whole = RolloutBatch.from_samples(merge_rollout_shares(parts))
    meta = merge_meta([output_part(p)[1] for p in parts])
    assert meta.group_id_values == whole.group_id_values == (0, 1, 2, 5)
    assert meta.prompt_group_values == whole.prompt_group_values


def test_an_explicit_id_in_two_parts_is_an_error():
    parts = [[[Sample(tokens=[1, 2], response_length=1, reward=1.0, group_id=7)]],
             [[Sample(tokens=[3, 2], response_length=1, reward=1.0, group_id=7)]]]
    with pytest.raises(RolloutValidationError, match=r"^group_id=7: is used by the outputs of "
                                                     r"engines 0 and 1"):
        merge_meta([output_part(p)[1] for p in parts])


def test_a_missing_piece_is_a_typed_error():
    parts = [[[Sample(tokens=[1, 2, 3], response_length=2, reward=float(i), group_id=i)]]
             for i in range(2)]
    batches, _, plan = _plan(parts, ParallelLayout(dp=1),
                             BatchingPolicy(global_batch_size=2, max_tokens_per_gpu=100))
    with pytest.raises(RolloutBatchError, match="first missing: \\[1\\]"):
        assemble_share([share_piece(batches[0], 0, plan, 0)], plan, 0)


@settings(max_examples=15)
@given(split_outputs())
def test_joined_parts_are_the_merged_batch(case):
    """Theorem: the parts concatenated with the merged ids and advantages are the batch of the
    merged output (what dumps and the test hook read)."""
    _, parts = case
    whole = RolloutBatch.from_samples(merge_rollout_shares(parts))
    pieces = [output_part(p) for p in parts]
    meta, _ = plan_shares(merge_meta([m for _, m in pieces]),
                          ParallelLayout(dp=1), BatchingPolicy(global_batch_size=1,
                                                               max_tokens_per_gpu=10**6,
                                                               allow_partial_step=True))
    assert_same_batch(join_parts([b for b, _ in pieces], meta), whole)
