"""The trainer's micro-batch records (``vime_pure.rank_batch``): properties and named examples.

Every record a trainer rank consumes is built here, by the core, so these properties are about
the code that trains (``assert_microbatch_invariants`` re-derives every field in plain Python).
"""

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.data_invariants import assert_microbatch_invariants
from tests.property.data_strategies import scheduled_batches
from vime_pure import (BatchingPolicy, LossConfigError, LossMode, ParallelLayout, RolloutBatch,
                       RolloutBatchError, RolloutValidationError, Sample, rank_batch,
                       schedule_for, with_log_probs)

NORM = 7.0  # the Dr. GRPO constant used by sample_token_sum_norm below


def _all_ranks(batch, sched, mode, cp):
    return {(d, c): rank_batch(batch, sched, dp_rank=d, cp_rank=c, cp_size=cp, loss_mode=mode,
                               norm=NORM)
            for d in range(sched.layout.dp) for c in range(cp)}


@given(scheduled_batches(), st.sampled_from(list(LossMode)), st.integers(1, 3))
def test_records_cover_the_schedule_with_the_loss_modes_denominators(case, mode, cp):
    """Theorem: the records are a deterministic function of (batch, schedule, rank, mode, cp);
    ``assert_microbatch_invariants`` states each field's definition, so equality is the proof."""
    batch, sched = case
    assert_microbatch_invariants(_all_ranks(batch, sched, mode, cp), batch, sched, mode, NORM)


@given(scheduled_batches(depth=1))
def test_with_log_probs_gathers_by_share_index(case):
    """Theorem: attaching share-coordinate log-probs is a gather at ``share_index``, and the
    share's positions are its samples' batch response tokens in execution order."""
    batch, sched = case
    rank = rank_batch(batch, sched, dp_rank=0)
    flat = -np.arange(rank.num_response_tokens, dtype=np.float32) / 7
    mine = with_log_probs(rank, old_log_probs=flat, ref_log_probs=flat * 2)
    for mb in mine.microbatches:
        np.testing.assert_array_equal(mb.old_log_probs, flat[mb.share_index])
        np.testing.assert_array_equal(mb.ref_log_probs, 2 * flat[mb.share_index])
    ids = sched.rank_sample_ids(0)
    assert rank.num_response_tokens == int(batch.response_lengths[ids].sum())


def _batch():
    """The module docstring's example: [5, 6, 7] (response 2, mask [1, 0]) and [8, 9]."""
    return RolloutBatch.from_samples([[
        Sample(tokens=[5, 6, 7], response_length=2, loss_mask=[1, 0], reward=1.0),
        Sample(tokens=[8, 9], response_length=1, reward=0.0)]])


def _one_step(batch, **policy):
    return schedule_for(batch, ParallelLayout(dp=1),
                        BatchingPolicy(global_batch_size=batch.num_groups, **policy))


def test_docstring_example():
    batch = _batch()
    (mb,) = rank_batch(batch, _one_step(batch, max_tokens_per_gpu=64), dp_rank=0).microbatches
    assert mb.tokens.tolist() == [5, 6, 7, 8, 9]
    assert mb.positions.tolist() == [0, 1, 2, 0, 1]
    assert mb.labels.tolist() == [6, 7, 0, 9, 0]
    assert mb.logit_index.tolist() == [0, 1, 3]
    assert mb.denominators.tolist() == [1.0, 1.0]
    assert mb.token_denominators.tolist() == [1.0, 1.0, 1.0]
    assert (mb.num_groups, mb.num_samples, mb.num_microbatches) == (2, 2, 1)


@pytest.mark.parametrize("mode, dens", [("group_token_mean", [1, 1]), ("sample_token_mean", [1, 1]),
                                        ("token_mean", [2, 2]), ("sample_token_sum_norm", [4, 4])])
def test_each_loss_mode_puts_its_own_denominators_in_the_records(mode, dens):
    batch = _batch()
    (mb,) = rank_batch(batch, _one_step(batch, max_tokens_per_gpu=64), dp_rank=0,
                       loss_mode=mode, norm=4).microbatches
    assert mb.loss_mode == LossMode(mode) and mb.denominators.tolist() == dens


def test_cp2_cuts_zigzag_chunks_of_each_padded_sample():
    batch = RolloutBatch.from_samples([[Sample(tokens=list(range(10, 26)), response_length=8,
                                               reward=1.0)]])
    sched = _one_step(batch, max_tokens_per_gpu=64)
    r0, r1 = (rank_batch(batch, sched, dp_rank=0, cp_size=2, cp_rank=c).microbatches[0]
              for c in (0, 1))
    # L=16, chunk 4: rank 0 holds [0,4) and [12,16), rank 1 [4,12) (see vime_pure.cp).
    assert r0.positions.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert r1.positions.tolist() == list(range(4, 12))
    assert r0.response_index.tolist() == [5, 6, 7] and r1.response_index.tolist() == [0, 1, 2, 3, 4]
    assert r0.seq_lengths.tolist() == r1.seq_lengths.tolist() == [16]


def test_dropped_groups_get_no_records():
    batch = RolloutBatch.from_samples([[Sample(tokens=[1, 2, 3], response_length=1, reward=r)
                                        for r in (0.0, 1.0, 0.0)]])
    sched = _one_step(batch, max_tokens_per_gpu=64)
    sched2 = schedule_for(batch, ParallelLayout(dp=1), BatchingPolicy(global_batch_size=2,
                                                                      max_tokens_per_gpu=64))
    assert len(sched2.dropped_samples) == 1 and len(sched.dropped_samples) == 0
    seen = [i for mb in rank_batch(batch, sched2, dp_rank=0).microbatches
            for i in mb.sample_indices.tolist()]
    assert sched2.dropped_samples[0] not in seen and len(seen) == 2


def test_bad_inputs_are_typed_errors():
    batch = _batch()
    sched = _one_step(batch, max_tokens_per_gpu=64)
    other = RolloutBatch.from_samples([[Sample(tokens=[1, 2], response_length=1, reward=0.0)]])
    with pytest.raises(RolloutBatchError, match="built for another batch"):
        rank_batch(other, sched, dp_rank=0)
    with pytest.raises(RolloutBatchError, match="dp_rank=1: is not below the group size 1"):
        rank_batch(batch, sched, dp_rank=1)
    with pytest.raises(RolloutBatchError, match="cp_rank=2"):
        rank_batch(batch, sched, dp_rank=0, cp_size=2, cp_rank=2)
    with pytest.raises(LossConfigError, match="mode"):
        rank_batch(batch, sched, dp_rank=0, loss_mode="mean_of_means")
    with pytest.raises(LossConfigError, match="norm"):
        rank_batch(batch, sched, dp_rank=0, loss_mode="sample_token_sum_norm")
    mine = rank_batch(batch, sched, dp_rank=0)
    with pytest.raises(RolloutBatchError, match="old_log_probs"):
        with_log_probs(mine, old_log_probs=np.zeros(2, dtype=np.float32))
    with pytest.raises(RolloutBatchError, match=r"TrainMicroBatch.loss_mask has shape"):
        attrs.evolve(mine.microbatches[0], loss_mask=np.zeros(1, dtype=np.float32))
    mb = mine.microbatches[0]  # reverse-KL estimates: any finite real, one per scored token
    kl = np.full(len(mb.loss_mask), -3.5, dtype=np.float32)
    assert attrs.evolve(mb, opd_reverse_kl=kl).opd_reverse_kl.tolist() == kl.tolist()
    with pytest.raises(RolloutBatchError, match=r"opd_reverse_kl\[0\]=inf breaks the rule"):
        attrs.evolve(mb, opd_reverse_kl=kl * np.float32(-np.inf))
    with pytest.raises(RolloutBatchError, match=r"TrainMicroBatch.opd_reverse_kl has shape"):
        attrs.evolve(mb, opd_reverse_kl=kl[:1])


@given(scheduled_batches(depth=1), st.integers(2, 8))
def test_row_multiple_pads_the_row_and_changes_nothing_scored(case, m):
    """Theorem: sequence parallelism's padding (``row_multiple``) only appends unscored zero
    tokens to a row's last sample: every scored field is the unpadded record's."""
    batch, sched = case
    plain, padded = (rank_batch(batch, sched, dp_rank=0, row_multiple=k) for k in (1, m))
    for a, b in zip(plain.microbatches, padded.microbatches):
        n, total = len(a.tokens), len(b.tokens)
        assert total % m == 0 and total - n < m and b.seq_lengths.sum() == total
        assert b.seq_lengths[:-1].tolist() == a.seq_lengths[:-1].tolist()
        assert b.tokens[:n].tolist() == a.tokens.tolist() and not b.tokens[n:].any()
        assert b.labels[:n].tolist() == a.labels.tolist() and not b.labels[n:].any()
        assert b.positions[n:].tolist() == list(range(a.positions[-1] + 1,
                                                      a.positions[-1] + 1 + total - n))
        for name in ("logit_index", "response_index", "token_sample", "loss_mask",
                     "advantages", "denominators"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_row_multiple_example_and_its_cp_limit():
    batch = RolloutBatch.from_samples([[
        Sample(tokens=[1] * 5, response_length=2, reward=1.0),
        Sample(tokens=[2] * 6, response_length=2, reward=0.0)]])
    sched = _one_step(batch, max_tokens_per_gpu=64)
    rec = rank_batch(batch, sched, dp_rank=0, row_multiple=4).microbatches[0]
    assert (rec.sample_indices.tolist(), rec.seq_lengths.tolist()) == ([1, 0], [6, 6])
    with pytest.raises(RolloutBatchError, match="row_multiple=2: is not wired with cp_size=2"):
        rank_batch(batch, sched, dp_rank=0, cp_size=2, row_multiple=2)


def _source_routes(batch):
    """Routes that name their token: row ``j`` is ``[2j, 2j + 1]`` (one layer, top-2)."""
    j = np.arange(len(batch.tokens), dtype=np.int16)
    return attrs.evolve(batch, rollout_routed_experts=np.stack([2 * j, 2 * j + 1], axis=1))


@given(scheduled_batches(), st.integers(1, 3))
def test_routes_travel_with_their_tokens_through_packing_and_cp(case, cp):
    """Theorem: a record's ``routed_experts`` row ``p`` is the route of the batch token at
    ``p`` (a padding position: its sample's last token), for every rank and CP cut, because
    routes are gathered with the tokens' own source indices."""
    batch, sched = case
    batch = _source_routes(batch)
    for mine in _all_ranks(batch, sched, LossMode.GROUP_TOKEN_MEAN, cp).values():
        for mb in mine.microbatches:
            src = mb.routed_experts[:, 0].astype(np.int64) // 2
            np.testing.assert_array_equal(mb.routed_experts[:, 1], 2 * src + 1)
            sample = np.searchsorted(batch.token_offsets, src, side="right") - 1
            assert set(sample.tolist()) <= set(mb.sample_indices.tolist())
            within = src - batch.token_offsets[sample]
            last = batch.lengths[sample] - 1
            np.testing.assert_array_equal(within, np.minimum(mb.positions, last))
            real = mb.positions <= last
            np.testing.assert_array_equal(batch.tokens[src[real]], mb.tokens[real])


def test_routes_of_a_cp2_padded_sample():
    samples = [Sample(tokens=[10, 11, 12], response_length=1, reward=1.0,
                      rollout_routed_experts=[[[0, 1]], [[1, 2]]])]  # the last token unrouted
    batch = RolloutBatch.from_samples([samples])
    assert batch.rollout_routed_experts.tolist() == [[0, 1], [1, 2], [1, 2]]
    sched = _one_step(batch, max_tokens_per_gpu=64)
    r0, r1 = (rank_batch(batch, sched, dp_rank=0, cp_size=2, cp_rank=c).microbatches[0]
              for c in (0, 1))
    # padded to 4 positions, chunk 1: rank 0 holds positions 0 and 3 (a pad), rank 1 1 and 2
    assert r0.routed_experts.tolist() == [[0, 1], [1, 2]]
    assert r1.routed_experts.tolist() == [[1, 2], [1, 2]]


@pytest.mark.parametrize("routes, match", [
    ([[[0, 1]]], "1 rows for 3 tokens"),
    ([[[0, 0]], [[1, 2]], [[2, 3]]], "one expert twice"),
    ([[[0, -1]], [[1, 2]], [[2, 3]]], "outside"),
    ([[0, 1], [1, 2], [2, 3]], "not an integer array"),
    ([[[0.5, 1]], [[1, 2]], [[2, 3]]], "not an integer array")])
def test_bad_routes_are_typed_errors_naming_the_sample(routes, match):
    with pytest.raises(RolloutValidationError, match=r"output\[0\]\[0\].*" + match):
        RolloutBatch.from_samples([[Sample(tokens=[1, 2, 3], response_length=1, reward=1.0,
                                           rollout_routed_experts=routes)]])
    mixed = [Sample(tokens=[1, 2], response_length=1, reward=0.0,
                    rollout_routed_experts=[[[0, 1]], [[1, 2]]]),
             Sample(tokens=[1, 2], response_length=1, reward=1.0)]
    with pytest.raises(RolloutValidationError, match="for every sample or for none"):
        RolloutBatch.from_samples([mixed])
