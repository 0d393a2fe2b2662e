"""Packed rows: structure of one packed micro-batch, and packed == unpacked log-probs.

The multi-process part reads the shared Megatron run: per-token log-probs of the rank's samples
packed as the Schedule says equal those of every sample run alone, on DP1, DP2, TP2 and PP2.
"""

import numpy as np
import pytest
import torch

from tests.shell.megatron_workers import PACKING_CHECK_LAYOUTS
from vime_shell.packing import PackingError, TrainRows, block_causal_mask, pack


def _rows() -> TrainRows:
    # The module docstring's example: [5, 6, 7] (response 2) and [8, 9] (response 1).
    return TrainRows(tokens=np.array([5, 6, 7, 8, 9]), lengths=np.array([3, 2]),
                     response_lengths=np.array([2, 1]), loss_mask=np.array([1.0, 0.0, 1.0]),
                     advantages=np.array([0.5, 0.5, -1.0]), denominators=np.array([2.0, 1.0]),
                     group=np.array([0, 1]), old_log_probs=np.array([-1.0, -2.0, -3.0]))


def assert_packed_row_invariants(row, rows: TrainRows) -> None:
    """Every response token once, in order, predicted from the position just before it."""
    tokens = row.tokens[0].numpy()
    assert row.position_ids.shape == row.tokens.shape == row.labels.shape
    assert np.array_equal(row.labels[0, :-1].numpy(), tokens[1:])
    targets = tokens[row.logit_index.numpy() + 1]
    expected = np.concatenate([
        rows.tokens[rows.token_offsets[i + 1] - rows.response_lengths[i]:rows.token_offsets[i + 1]]
        for i in row.indices])
    assert np.array_equal(targets, expected)
    assert len(row.loss_mask) == len(row.advantages) == len(row.denominators) == sum(
        row.response_lengths)


def test_docstring_example():
    row = pack(_rows(), [0, 1])
    assert row.tokens.tolist() == [[5, 6, 7, 8, 9]]
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert row.logit_index.tolist() == [0, 1, 3]
    assert row.denominators.tolist() == [2.0, 2.0, 1.0]
    assert row.sample.tolist() == [0, 0, 1]
    assert row.old_log_probs.tolist() == [-1.0, -2.0, -3.0]
    assert_packed_row_invariants(row, _rows())


def test_reordered_microbatch_keeps_sample_columns_together():
    rows = _rows()
    row = pack(rows, [1, 0])
    assert row.tokens.tolist() == [[8, 9, 5, 6, 7]]
    assert row.advantages.tolist() == [-1.0, 0.5, 0.5]
    assert_packed_row_invariants(row, rows)


def test_block_causal_mask_blocks_other_samples_and_the_future():
    mask = block_causal_mask([3, 2])[0, 0]
    allowed = ~mask
    assert allowed[2, :3].all() and not allowed[2, 3:].any()
    assert allowed[4, 3:].all() and not allowed[4, :3].any()
    assert not allowed[0, 1]  # causal


def test_select_then_pack_equals_pack_of_originals():
    from vime_shell.synthetic import synthetic_rows

    rows = synthetic_rows(64, num_groups=6, seed=1, with_old_log_probs=True)
    order = list(range(rows.num_samples))[::-1]
    sub = rows.select(order)
    a, b = pack(rows, order[:3]), pack(sub, [0, 1, 2])
    for field in ("tokens", "position_ids", "logit_index", "loss_mask", "advantages",
                  "old_log_probs", "denominators"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert_packed_row_invariants(a, rows)


def test_thd_packing_carries_cumulative_lengths_instead_of_a_mask():
    row = pack(_rows(), [0, 1], packing="thd")
    assert row.attention_mask is None
    assert row.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 5]
    assert row.packed_seq_params.max_seqlen_q == 3


@pytest.mark.parametrize("indices", [[], [2], [-1]])
def test_bad_indices_are_typed_errors(indices):
    with pytest.raises(PackingError, match="indices"):
        pack(_rows(), indices)


def test_mismatched_columns_are_typed_errors():
    with pytest.raises(PackingError, match="advantages"):
        TrainRows(tokens=np.array([5, 6, 7]), lengths=np.array([3]),
                  response_lengths=np.array([2]), loss_mask=np.ones(2), advantages=np.ones(3),
                  denominators=np.ones(1), group=np.zeros(1, dtype=np.int64))
    with pytest.raises(PackingError, match="response_lengths"):
        TrainRows(tokens=np.array([5, 6]), lengths=np.array([2]), response_lengths=np.array([2]),
                  loss_mask=np.ones(2), advantages=np.ones(2), denominators=np.ones(1),
                  group=np.zeros(1, dtype=np.int64))


@pytest.mark.slow
@pytest.mark.parametrize("name", PACKING_CHECK_LAYOUTS)
def test_packed_log_probs_equal_unpacked(megatron_runs, name):
    for rank in ((0,) if name == "dp1" else (0, 1)):
        assert megatron_runs["per_rank"][rank][name]["packing_max"] <= 1e-5


def test_zigzag_positions_docstring_example():
    from vime_shell.packing import zigzag_positions

    assert zigzag_positions([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions([8], 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_slices_partition_the_response_tokens(cp):
    from vime_shell.synthetic import synthetic_rows

    rows = synthetic_rows(64, num_groups=5, seed=2, with_old_log_probs=True)
    mb = list(range(rows.num_samples))
    full = pack(rows, mb, packing="thd")
    parts = [pack(rows, mb, packing="thd", cp_size=cp, cp_rank=r) for r in range(cp)]
    slots = torch.cat([p.response_slot for p in parts])
    assert sorted(slots.tolist()) == list(range(full.num_response_tokens))
    for name in ("loss_mask", "advantages", "old_log_probs", "denominators"):
        merged = torch.zeros(full.num_response_tokens)
        for p in parts:
            merged[p.response_slot] = getattr(p, name)
        assert torch.equal(merged, getattr(full, name)), name
    for p in parts:  # every local logit position predicts the right token in the padded row
        assert p.packed_seq_params.cu_seqlens_q[-1] % (2 * cp) == 0
        assert p.tokens.shape[1] * cp == int(p.packed_seq_params.cu_seqlens_q[-1])
        assert torch.equal(p.labels[0, p.logit_index], full.labels[0, full.logit_index][p.response_slot])


def test_context_parallel_needs_thd():
    with pytest.raises(PackingError, match="cp_size"):
        pack(_rows(), [0, 1], packing="mask", cp_size=2)
