"""RolloutBatch columns: invariants and the round trip from samples (per-rank records are in
``test_microbatch_records.py``)."""

import attrs
import numpy as np
import pytest
from hypothesis import given

from tests.data_invariants import assert_rolloutbatch_invariants
from tests.property.data_strategies import rollout_outputs
from vime_pure import RolloutBatch, RolloutBatchError, Sample, flatten_rollout_output, group_mask_sums


@given(rollout_outputs())
def test_from_samples_builds_valid_columns_that_reproduce_the_samples(output):
    """``from_samples`` copies each flattened sample's fields into its rows, so the columns
    hold RolloutBatch's invariants and give every sample back."""
    flat = flatten_rollout_output(output)
    batch = RolloutBatch.from_samples(output)
    assert_rolloutbatch_invariants(batch, flat.samples, flat.group_ids)


def test_docstring_example():
    batch = RolloutBatch.from_samples([[
        Sample(tokens=[1, 2, 3], response_length=2, reward=1.0),
        Sample(tokens=[1, 2, 4, 5], response_length=2, reward=0.0)]])
    assert batch.token_offsets.tolist() == [0, 3, 7]
    assert batch.group_ids.tolist() == [0, 1] and batch.prompt_groups.tolist() == [0, 0]
    assert batch.group_mask_sums.tolist() == [2.0, 2.0]
    np.testing.assert_allclose(batch.advantages, [0.7071068, -0.7071068], atol=1e-5)


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
