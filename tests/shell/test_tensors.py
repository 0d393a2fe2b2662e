"""From core records to Megatron tensors, and the objective on them: conversion only.

The shell must not compute its own denominators, CP slices or token sets: every tensor here is
the record's array, and the objective's partial numerator follows the record's denominators
(change them and the loss changes with them). The multi-process part reads the shared Megatron
run: per-token log-probs of packed rows equal those of every sample run alone (DP1, PP2).
"""

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.property.data_strategies import scheduled_batches
from tests.shell.megatron_workers import PACKING_CHECK_LAYOUTS
from vime_pure import (BatchingPolicy, LossConfig, LossMode, ParallelLayout, RolloutBatch, Sample,
                       rank_batch, schedule_for, with_log_probs)
from vime_pure.errors import LossConfigError, VimeError
from vime_pure.scheduling.flops import FlopsModel
from vime_pure.torch_ops.loss import microbatch_loss
from vime_shell.megatron.objective import (loss_factor, microbatch_objective,
                                           opd_shaped_advantages)
from vime_shell.megatron.tensors import block_causal_mask, cpu_layout, to_tensors

ARRAYS = {"tokens": "tokens", "position_ids": "positions", "labels": "labels",
          "logit_index": "logit_index", "token_sample": "token_sample", "loss_mask": "loss_mask",
          "advantages": "advantages", "denominators": "denominators"}


@given(scheduled_batches(), st.sampled_from(list(LossMode)), st.integers(1, 3))
def test_tensors_are_the_records_arrays_for_every_mode_and_cp(case, mode, cp):
    """Theorem: ``to_tensors`` only converts, so every tensor equals its record's array (the
    records' denominators and CP token sets are checked against the loss formulas in
    ``tests/property/test_microbatch_records.py``)."""
    batch, sched = case
    for c in range(cp):
        mine = rank_batch(batch, sched, dp_rank=0, cp_rank=c, cp_size=cp, loss_mode=mode,
                          norm=5.0)
        for mb in mine.microbatches:
            t = to_tensors(mb, "thd" if cp > 1 else "mask")
            for name, field in ARRAYS.items():
                got = getattr(t, name)
                got = got[0] if got.dim() == 2 else got
                assert np.array_equal(got.numpy(), getattr(mb, field)), name
            if cp > 1:
                cu = t.packed_seq_params.cu_seqlens_q.tolist()
                assert cu == [0, *np.cumsum(mb.seq_lengths).tolist()]
            else:
                assert torch.equal(t.attention_mask, block_causal_mask(mb.seq_lengths.tolist()))


@given(scheduled_batches())
def test_padded_rows_hold_each_sample_at_its_row_start(case):
    """Theorem: the padded layout moves every token to (its sample's row, its position), so each
    row starts with its sample, the scored logits and labels are the record's, and every row
    is causally masked like a sample alone."""
    batch, sched = case
    for mb in rank_batch(batch, sched, dp_rank=0).microbatches:
        seq = mb.seq_lengths.tolist()
        t = to_tensors(mb, "padded")
        width = max(seq)
        assert tuple(t.tokens.shape) == (len(seq), width) == tuple(t.labels.shape)
        starts = np.cumsum([0, *seq[:-1]])
        for k, (start, n) in enumerate(zip(starts, seq)):
            assert np.array_equal(t.tokens[k, :n].numpy(), mb.tokens[start:start + n])
            assert np.array_equal(t.position_ids[k].numpy(), np.arange(width))
        assert np.array_equal(t.labels.reshape(-1)[t.logit_index].numpy(),
                              mb.labels[mb.logit_index])
        assert torch.equal(t.attention_mask, block_causal_mask([width]))
        assert t.num_tokens == sum(seq) and t.seq_length == width


def test_cpu_layout_docstring_example():
    embedded = FlopsModel(linear=660480.0, quadratic=512.0)
    assert cpu_layout([5] * 128, embedded) == "padded"
    assert cpu_layout([600, 2], embedded) == "mask"
    assert cpu_layout([5] * 128, FlopsModel(linear=1.0, quadratic=0.0)) == "mask"  # ties pack


def _record(mode="group_token_mean", old=None, ref=None):
    # One group of 2 samples, masks [1, 1] and [1, 0] -> group_token_mean D = 3.
    batch = RolloutBatch.from_samples([[[
        Sample(tokens=[1, 2, 3, 4], response_length=2, reward=1.0, group_id="g"),
        Sample(tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1, 0], reward=1.0,
               group_id="g")], [Sample(tokens=[1, 2], response_length=1, reward=0.0)]]])
    sched = schedule_for(batch, ParallelLayout(dp=1), BatchingPolicy(global_batch_size=2,
                                                                     max_tokens_per_gpu=64))
    mine = rank_batch(batch, sched, dp_rank=0, loss_mode=mode, norm=4)
    if old is not None:
        mine = with_log_probs(mine, old_log_probs=old, ref_log_probs=ref)
    return mine.microbatches[0]


def test_factor_docstring_example():
    rec = attrs.evolve(_record(), num_microbatches=4, num_groups=8, num_samples=16)
    assert loss_factor(rec, dp=2, cp=1) == 1.0
    rec = attrs.evolve(rec, loss_mode=LossMode.SAMPLE_TOKEN_MEAN)
    assert loss_factor(rec, dp=2, cp=1) == 0.5  # sample_token_mean divides by N_s, not G_s
    with pytest.raises(VimeError, match="num_groups=0: must be an integer >= 1"):
        attrs.evolve(rec, num_groups=0)  # such a record cannot exist (G_s >= 1)


@pytest.mark.parametrize("mode", list(LossMode))
def test_objective_follows_the_records_denominators(mode):
    rec = _record(mode)
    row = to_tensors(rec, "mask")
    logp = -torch.arange(1, row.loss_mask.numel() + 1, dtype=torch.float32) / 10
    loss, report = microbatch_objective(logp, row, LossConfig(), factor=1.0)
    core = microbatch_loss(-row.advantages, row.loss_mask, row.token_sample, row.denominators)
    assert float(loss) == pytest.approx(float(core))  # ratio 1: pg = -A
    doubled = to_tensors(attrs.evolve(rec, denominators=rec.denominators * 2), "mask")
    halved, _ = microbatch_objective(logp, doubled, LossConfig(), factor=1.0)
    assert float(halved) == pytest.approx(float(loss) / 2)


def test_ratio_one_surrogate_gives_minus_advantage_group_mean_and_gradient():
    row = to_tensors(_record(), "mask")
    logp = torch.tensor([-1.0, -2.0, -1.5, -0.5, -0.3], requires_grad=True)
    loss, report = microbatch_objective(logp, row, LossConfig(), factor=2.0)
    loss.backward()
    a = float(row.advantages[0])  # both siblings share one advantage
    # group g: pg = -A on 3 masked tokens over D = 3; the other group's sample: -A' / 1.
    expected = -a * 3 / 3 - float(row.advantages[4]) / 1
    assert float(report["loss"]) == pytest.approx(expected, abs=1e-6)
    assert float(loss) == pytest.approx(2 * expected, abs=1e-6)
    assert logp.grad[:4].tolist() == pytest.approx([-2 * a / 3] * 3 + [0.0], abs=1e-6)
    assert float(report["tokens"]) == 4.0


def test_clipped_tokens_are_reported_as_group_weighted_fraction():
    old = np.log(np.array([0.5, 1.0, 1.0, 1.0, 1.0], dtype=np.float32))  # token 0: ratio 2
    row = to_tensors(_record(old=old), "mask")
    _, report = microbatch_objective(torch.zeros(5), row, LossConfig(), factor=1.0)
    assert float(report["clipfrac"]) == pytest.approx(1 / 3)


def test_tis_needs_engine_log_probs_and_cp_needs_thd():
    row = to_tensors(_record(), "mask")
    with pytest.raises(LossConfigError, match="use_tis"):
        microbatch_objective(torch.zeros(5), row, LossConfig(use_tis=True), factor=1.0)
    rec = attrs.evolve(_record(), cp_size=2)
    with pytest.raises(VimeError, match="cp_size=2: needs THD packing"):
        to_tensors(rec, "mask")


def test_block_causal_mask_blocks_other_samples_and_the_future():
    allowed = ~block_causal_mask([3, 2])[0, 0]
    assert allowed[2, :3].all() and not allowed[2, 3:].any()
    assert allowed[4, 3:].all() and not allowed[4, :3].any()
    assert not allowed[0, 1]  # causal


@pytest.mark.slow
@pytest.mark.parametrize("name", PACKING_CHECK_LAYOUTS)
def test_packed_log_probs_equal_unpacked(megatron_runs, name):
    """Both CPU layouts (block-masked packed row, padded rows) and the trainer's choice give
    every sample the log-probs it has alone (PP2: padded rows vary in shape between
    micro-batches, which the pipeline's shape exchange carries)."""
    for rank in ((0,) if name == "dp1" else (0, 1)):
        run = megatron_runs["per_rank"][rank][name]
        for key in ("packing_max", "packing_max_mask", "packing_max_padded"):
            assert run[key] <= 1e-5, key


def test_reward_kl_shapes_the_advantages_before_the_surrogate():
    """--kl-coef with REINFORCE++-baseline: the objective equals the plain one run on
    ``A - c * KL(pi_old || ref)`` per token (slime's reward KL), and needs reference log-probs."""
    old = np.log(np.array([0.5, 0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    ref = old - np.float32(0.25)
    row = to_tensors(_record(old=old, ref=ref), "mask")
    logp = torch.from_numpy(old).clone().requires_grad_(True)
    shaped_cfg = LossConfig(reward_kl_coef=0.1, kl_kind="k1")
    loss, _ = microbatch_objective(logp, row, shaped_cfg, factor=1.0)
    shaped = row.advantages - 0.1 * 0.25  # k1 = old - ref = 0.25 on every token
    plain, _ = microbatch_objective(logp, attrs.evolve(row, advantages=shaped), LossConfig(),
                                    factor=1.0)
    assert float(loss) == pytest.approx(float(plain), abs=1e-6)
    with pytest.raises(LossConfigError, match="reward_kl_coef=0.1: needs the reference"):
        microbatch_objective(logp, attrs.evolve(row, ref_log_probs=None), shaped_cfg, 1.0)


def test_opd_reverse_kl_shapes_the_advantages_and_is_reported():
    """Top-k distillation (miles'): with the rollout's per-token ``opd_reverse_kl`` the
    advantages are ``A - coef * kl``, detached, before the surrogate, and the row reports
    ``sum(kl * mask)``; they win over teacher log-probs, whose path is unchanged; with
    neither, the error names both."""
    old = np.log(np.array([0.5, 0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    kl = np.array([0.5, -1.0, 2.0, 0.25, -3.0], dtype=np.float32)  # any real, not a log-prob
    rec = attrs.evolve(_record(old=old), opd_reverse_kl=kl)
    row = to_tensors(rec, "mask")
    assert torch.equal(row.opd_reverse_kl, torch.from_numpy(kl))
    coef, mask = 0.2, rec.loss_mask
    shaped = opd_shaped_advantages(row.advantages, row.old_log_probs, row, coef)
    torch.testing.assert_close(shaped, row.advantages - coef * torch.from_numpy(kl))
    logp = torch.from_numpy(old).clone().requires_grad_(True)
    cfg = LossConfig(opd_kl_coef=coef)
    loss, report = microbatch_objective(logp, row, cfg, factor=1.0)
    plain, _ = microbatch_objective(logp, attrs.evolve(row, advantages=shaped), LossConfig(),
                                    factor=1.0)
    assert float(loss) == pytest.approx(float(plain), abs=1e-6)
    assert float(report["opd_reverse_kl"]) == pytest.approx(float((kl * mask).sum()))
    assert not report["opd_reverse_kl"].requires_grad
    teacher = torch.from_numpy(old - np.float32(0.5))
    both = attrs.evolve(row, teacher_log_probs=teacher)
    assert float(microbatch_objective(logp, both, cfg, factor=1.0)[0]) == float(loss)
    only_teacher = attrs.evolve(both, opd_reverse_kl=None)  # slime's k1: old - teacher = 0.5
    _, report = microbatch_objective(logp, only_teacher, cfg, factor=1.0)
    assert float(report["opd_reverse_kl"]) == pytest.approx(0.5 * float(mask.sum()))
    torch.testing.assert_close(
        opd_shaped_advantages(row.advantages, row.old_log_probs, only_teacher, coef),
        row.advantages - coef * 0.5)
    with pytest.raises(LossConfigError, match="needs the teacher's log-probs or the "
                                              "rollout's opd_reverse_kl"):
        microbatch_objective(logp, attrs.evolve(row, opd_reverse_kl=None), cfg, factor=1.0)
