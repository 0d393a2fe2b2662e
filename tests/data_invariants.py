"""``assert_rolloutbatch_invariants`` / ``assert_shard_invariants``: independent re-checks.

They recompute every invariant from public fields with plain Python (not through
``vime_pure.batch_checks``), so a bug in the construction-time checks cannot hide a bug in
the conversion or sharding.
"""

import numpy as np

from vime_pure import RankShard, RolloutBatch, Schedule, Status, group_mask_sums


def _rows(flat, offsets, i):
    return flat[offsets[i]:offsets[i + 1]].tolist()


def assert_rolloutbatch_invariants(b: RolloutBatch, samples=None, group_ids=None) -> None:
    """Check ``b``; with ``samples`` (flattened order) and resolved ``group_ids``, also check
    that every row reproduces its sample."""
    n = b.num_samples
    assert b.tokens.dtype == np.int32 and b.loss_masks.dtype == np.uint8
    assert b.token_offsets.tolist() == [0, *np.cumsum(b.lengths).tolist()]
    assert b.response_offsets.tolist() == [0, *np.cumsum(b.response_lengths).tolist()]
    masks = [_rows(b.loss_masks, b.response_offsets, i) for i in range(n)]
    assert all(set(m) <= {0, 1} for m in masks)
    first: dict[int, int] = {}
    for i, g in enumerate(b.group_ids.tolist()):
        first.setdefault(g, i)
        j = first[g]
        assert b.prompt_groups[i] == b.prompt_groups[j]
        assert b.rewards[i] == b.rewards[j] and b.advantages[i] == b.advantages[j]
    assert list(first) == list(range(len(first))) == list(range(b.num_groups))
    ids = b.original_group_ids()
    np.testing.assert_array_equal(
        b.group_mask_sums, group_mask_sums(ids, [np.asarray(m, dtype=np.float64) for m in masks]))
    for i in range(n):
        if b.removed[i]:
            assert sum(masks[i]) == 0
        assert 0 <= b.response_lengths[i] <= b.lengths[i] and b.lengths[i] >= 1
    for arr in b.columns().values():
        assert arr is None or not arr.flags.writeable
    if samples is None:
        return
    assert n == len(samples)
    for i, s in enumerate(samples):
        assert _rows(b.tokens, b.token_offsets, i) == list(s.tokens)
        assert b.response_lengths[i] == s.response_length
        want = ([0] * s.response_length if s.remove_sample else
                [1] * s.response_length if s.loss_mask is None else list(s.loss_mask))
        assert masks[i] == want
        assert b.statuses[i] == list(Status).index(Status(s.status))
        assert b.sample_indices[i] == (-1 if s.index is None else s.index)
        assert bool(b.removed[i]) == s.remove_sample
        if s.rollout_log_probs is not None:
            np.testing.assert_array_equal(_rows(b.rollout_log_probs, b.response_offsets, i),
                                          np.asarray(s.rollout_log_probs, dtype=np.float32))
    if group_ids is not None:
        assert ids == list(group_ids)


def assert_shard_invariants(shards: tuple[RankShard, ...], b: RolloutBatch,
                            sched: Schedule) -> None:
    """Rows, micro-batches and per-step counts of every rank against the batch and schedule."""
    assert len(shards) == sched.layout.dp
    per_step = [st.num_microbatches for st in sched.steps]
    groups = [st.num_groups for st in sched.steps]
    samples = [st.num_samples for st in sched.steps]
    for rank, sh in enumerate(shards):
        assert sh.rank == rank
        assert sh.sample_indices.tolist() == list(sched.partitions[rank])
        assert sh.micro_batch_indices == sched.micro_batch_indices[rank]
        assert list(sh.num_microbatches) == per_step and list(sh.num_groups) == groups
        assert list(sh.num_samples) == samples
        for k, g in enumerate(sh.sample_indices.tolist()):
            assert _rows(sh.tokens, sh.token_offsets, k) == _rows(b.tokens, b.token_offsets, g)
            assert (_rows(sh.loss_masks, sh.response_offsets, k)
                    == _rows(b.loss_masks, b.response_offsets, g))
            if b.rollout_log_probs is not None:
                assert (_rows(sh.rollout_log_probs, sh.response_offsets, k)
                        == _rows(b.rollout_log_probs, b.response_offsets, g))
            for col in ("lengths", "response_lengths", "group_ids", "group_mask_sums",
                        "advantages", "rewards"):
                assert getattr(sh, col)[k] == getattr(b, col)[g]
        j = 0
        for s, step in enumerate(sched.steps):
            for mb in step.microbatches[rank]:
                packed = sh.microbatch(j)
                assert packed.step == s and packed.num_groups == step.num_groups
                assert packed.num_samples == step.num_samples
                assert packed.sample_indices.tolist() == list(mb)
                _assert_packed_row(packed, b)
                j += 1
        assert j == sh.num_microbatches_total


def _assert_packed_row(packed, b: RolloutBatch) -> None:
    tokens, positions, mask, adv = [], [], [], []
    for g in packed.sample_indices.tolist():
        length, resp = int(b.lengths[g]), int(b.response_lengths[g])
        tokens += _rows(b.tokens, b.token_offsets, g)
        positions += list(range(length))
        mask += [0] * (length - resp) + _rows(b.loss_masks, b.response_offsets, g)
        adv += [0.0] * (length - resp) + [float(np.float32(b.advantages[g]))] * resp
    assert packed.tokens.tolist() == tokens
    assert packed.positions.tolist() == positions
    assert packed.loss_mask.tolist() == mask
    assert packed.advantages.tolist() == adv
    assert packed.cu_seqlens.tolist() == [0, *np.cumsum(b.lengths[packed.sample_indices]).tolist()]
    np.testing.assert_array_equal(packed.group_mask_sums, b.group_mask_sums[packed.sample_indices])
