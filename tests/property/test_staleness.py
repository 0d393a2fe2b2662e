"""Properties of weight-version staleness and the off-policy metrics (``vime_pure.staleness``)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.data_invariants import assert_staleness_invariants
from tests.property.data_strategies import rollout_outputs
from vime_pure import RolloutBatch, RolloutBatchError, Sample
from vime_pure.metrics import metric_values
from vime_pure.staleness import (batch_staleness, fresh_samples, mismatch_metrics,
                                 sample_staleness, staleness_metrics, stamp_versions)


@st.composite
def versioned_batches(draw):
    """A batch whose samples carry weight versions up to 6, and a trainer version >= them."""
    batch = RolloutBatch.from_samples(draw(rollout_outputs(light=True)))
    newest = int(batch.weight_version_max.max())
    return batch, draw(st.integers(max(newest, 0), max(newest, 0) + 4))


@given(versioned_batches(), st.integers(0, 5))
def test_group_staleness_is_the_oldest_sibling_and_shifts_with_the_trainer(case, k):
    """Siblings train together, so a group is as old as its oldest member; staleness counts
    syncs, so advancing the trainer by k syncs ages every group by exactly k."""
    batch, version = case
    staleness = batch_staleness(batch, version)
    assert_staleness_invariants(batch, version, staleness.tolist())
    aged = batch_staleness(batch, version + k)
    on_policy = batch.weight_version_min == -1
    groups_all_on_policy = np.array([on_policy[batch.group_ids == g].all()
                                     for g in batch.group_ids])
    np.testing.assert_array_equal(aged, np.where(groups_all_on_policy, 0, staleness + k))
    assert (fresh_samples(batch, version) == (sample_staleness(
        batch.weight_version_min, version) == 0)).all()


@given(versioned_batches())
def test_stamping_names_the_generating_version_and_keeps_named_ones(case):
    """An engine rank stamps the samples that name no version with its own (the newest the
    batch can hold), so no sample stays "on policy" and named versions never change."""
    batch, version = case
    stamped = stamp_versions(batch, version)
    named = batch.weight_version_min != -1
    assert (stamped.weight_version_min[~named] == version).all()
    np.testing.assert_array_equal(stamped.weight_version_min[named],
                                  batch.weight_version_min[named])
    assert (stamped.weight_version_min <= stamped.weight_version_max).all()
    assert (stamped.weight_version_max[batch.weight_version_max == -1] == version).all()


@given(versioned_batches())
def test_staleness_histogram_and_token_fraction(case):
    """The histogram's buckets are the fractions of groups per staleness (they sum to 1 and
    reproduce the mean), and the token fraction lies in [0, 1]."""
    batch, version = case
    values = metric_values(staleness_metrics(batch, version))
    buckets = {int(k.split("/")[1]): v for k, v in values.items() if k.startswith("staleness/")}
    assert sorted(buckets) == list(range(int(values["staleness_max"]) + 1))
    assert sum(buckets.values()) == pytest.approx(1.0)
    assert sum(k * v for k, v in buckets.items()) == pytest.approx(values["staleness_mean"])
    tokens = int(batch.loss_masks.sum())
    if tokens:
        assert 0.0 <= values["off_policy_token_frac"] <= 1.0
    else:  # nothing trained: the share is undefined, never a made-up 0
        assert values["off_policy_token_frac"] is None


def test_worked_example_and_errors():
    out = [[Sample(tokens=[1, 2, 3], response_length=2, reward=1.0, weight_versions=[3, 4],
                   group_id="a"),
            Sample(tokens=[1, 2, 4], response_length=2, reward=1.0, group_id="a")],
           [Sample(tokens=[1, 5, 6, 7, 8], response_length=4, reward=0.0, weight_versions=[5])]]
    batch = RolloutBatch.from_samples(out)
    assert batch_staleness(batch, 5).tolist() == [2, 2, 0]
    values = metric_values(staleness_metrics(batch, 5))
    assert values == {"staleness_mean": 1.0, "staleness_max": 2.0, "staleness/0": 0.5,
                      "staleness/1": 0.0, "staleness/2": 0.5, "off_policy_token_frac": 0.25}
    with pytest.raises(RolloutBatchError, match=r"weight_version_min\[2\]=5: is newer than the "
                                                 r"trainer's weights \(version 4\)"):
        batch_staleness(batch, 4)
    with pytest.raises(RolloutBatchError, match="trainer_version=True"):
        batch_staleness(batch, True)


def test_mismatch_metrics_worked_example():
    values = metric_values(mismatch_metrics(np.array([-1.0, -2.0]), np.array([-1.0, -1.0])))
    assert values["mismatch_abs"] == pytest.approx(0.5)
    assert values["mismatch_kl"] == pytest.approx(np.exp(-1.0) / 2)
