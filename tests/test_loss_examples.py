"""Worked examples of loss accounting, one named scenario per test (numbers from the docstrings).

The running example: group R0 = 3 samples x 3 loss tokens, group R1 = 1 sample x 3 tokens,
per-token values x = 1..12. Group means are 5 and 11, so ``group_token_mean`` reports 8.0;
``token_mean`` reports 78 / 12 = 6.5.
"""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from vime_pure import (LossConfigError, LossMode, VimeError, group_mask_sums, reduce_train_step,
                       sample_denominators, step_divisor)
from vime_pure.cp import zigzag_offsets
from vime_pure.denominators import megatron_loss_scale
from vime_pure.errors import CPConfigError
from vime_pure.torch_ops.cp import slice_packed_response, slice_sequence
from vime_pure.torch_ops.loss import microbatch_loss, rejection_mask, sample_index_from_lengths
from vime_pure.torch_ops.policy_loss import (entropy_from_logits, kl_penalty, policy_loss,
                                             ppo_clip_loss, tis_weights)

GROUPS = ["R0", "R0", "R0", "R1"]
MASKS = [[1.0] * 3] * 4
X = torch.arange(1.0, 13.0, dtype=torch.float64)


def whole_step(mode: LossMode, norm: float | None = None) -> float:
    dens = torch.as_tensor(sample_denominators(mode, GROUPS, MASKS, norm=norm))
    partial = microbatch_loss(X, torch.ones(12, dtype=torch.float64),
                              sample_index_from_lengths(torch.tensor([3, 3, 3, 3])), dens)
    return float(partial) / step_divisor(mode, 2, num_samples=4)


@pytest.mark.parametrize("mode, norm, expected", [
    (LossMode.GROUP_TOKEN_MEAN, None, 8.0),
    (LossMode.TOKEN_MEAN, None, 6.5),
    (LossMode.SAMPLE_TOKEN_MEAN, None, (2 + 5 + 8 + 11) / 4),
    (LossMode.SAMPLE_TOKEN_SUM_NORM, 4.0, 78 / 4 / 4),
])
def test_r0_r1_example_reports_per_mode(mode, norm, expected):
    assert whole_step(mode, norm) == pytest.approx(expected, rel=1e-15)


def test_r0_r1_split_over_two_micro_batches_reports_8():
    """Samples 0-1 in one micro-batch, 2-3 in another: partials 21/9 and 24/9 + 11."""
    dens = torch.tensor([9.0, 9.0, 9.0, 3.0], dtype=torch.float64)
    idx = sample_index_from_lengths(torch.tensor([3, 3]))
    first = microbatch_loss(X[:6], torch.ones(6, dtype=torch.float64), idx, dens[:2])
    second = microbatch_loss(X[6:], torch.ones(6, dtype=torch.float64), idx, dens[2:])
    assert float(first) == pytest.approx(21 / 9)
    assert float(second) == pytest.approx(24 / 9 + 11)
    report = reduce_train_step([{"loss": float(first)}, {"loss": float(second)}], 2,
                               "group_token_mean")
    assert report == {"loss": pytest.approx(8.0)}


def test_denominators_docstring_example():
    masks = [[1, 1, 0], [1, 1], [1, 0, 0, 1]]
    assert group_mask_sums(["a", "a", "b"], masks).tolist() == [4.0, 4.0, 2.0]


def test_all_masked_group_contributes_zero_but_counts_in_g_s():
    dens = sample_denominators("group_token_mean", ["a", "b"], [[1, 1], [0, 0]])
    assert dens.tolist() == [2.0, 0.0]
    partial = microbatch_loss(torch.tensor([4.0, 6.0, 100.0, 100.0]),
                              torch.tensor([1.0, 1.0, 0.0, 0.0]),
                              torch.tensor([0, 0, 1, 1]), torch.as_tensor(dens).float())
    assert float(partial) / step_divisor("group_token_mean", 2) == 2.5  # (5 + 0) / 2


def test_zero_denominator_leaves_no_nan_in_the_gradient():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    microbatch_loss(x, torch.zeros(2), torch.tensor([0, 0]), torch.zeros(1)).backward()
    assert x.grad is not None and x.grad.tolist() == [0.0, 0.0]


def test_rejection_original_vs_surviving_denominator():
    """One group, masks [1,1,1] and [1,1]; the middle token of sample 0 is rejected."""
    masks, keep = [[1, 1, 1], [1, 1]], [[1, 0, 1], [1, 1]]
    original = sample_denominators("group_token_mean", [0, 0], masks, rejection_masks=keep)
    surviving = sample_denominators("group_token_mean", [0, 0], masks, rejection_masks=keep,
                                    denominator="surviving")
    assert original.tolist() == [5.0, 5.0] and surviving.tolist() == [4.0, 4.0]
    x, m = torch.tensor([2.0, 99.0, 4.0, 6.0, 8.0]), torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    idx = torch.tensor([0, 0, 0, 1, 1])
    assert float(microbatch_loss(x, m, idx, torch.tensor(original).float())) == 4.0  # 20 / 5
    assert float(microbatch_loss(x, m, idx, torch.tensor(surviving).float())) == 5.0  # 20 / 4


def test_rejection_mask_token_and_sample_level():
    log_ratio = torch.log(torch.tensor([1.0, 3.0, 0.5]))
    assert rejection_mask(log_ratio, torch.ones(3), low=0.6, high=2).tolist() == [1, 0, 0]
    # Per sample: geometric means sqrt(1*3) = 1.73 (kept) and 0.5 (dropped).
    per_sample = rejection_mask(torch.log(torch.tensor([1.0, 3.0, 0.5, 0.5])), torch.ones(4),
                                low=0.6, high=2, sample_index=torch.tensor([0, 0, 1, 1]))
    assert per_sample.tolist() == [1, 1, 0, 0]


def test_megatron_scale_docstring_numbers():
    args = ("group_token_mean", 3, 4, 2, 2)
    assert megatron_loss_scale(*args) == 1.5
    assert megatron_loss_scale(*args, path="triple") == 3.0
    assert megatron_loss_scale(*args, path="per_token", total_num_tokens=40) == 10.0
    assert megatron_loss_scale("sample_token_mean", 3, 4, 2, 2, num_samples=6) == 1.0
    assert megatron_loss_scale("token_mean", 3, 4, 2, 2) == 6.0


@pytest.mark.parametrize("call, field", [
    (lambda: step_divisor("group_token_mean", 0), "G_s"),
    (lambda: megatron_loss_scale("group_token_mean", 3, 0, 2, 1), "G_s"),
    (lambda: megatron_loss_scale("group_token_mean", 3, True, 2, 1), "G_s"),
    (lambda: megatron_loss_scale("group_token_mean", 0, 4, 2, 1), "num_microbatches"),
    (lambda: megatron_loss_scale("group_token_mean", 3, 4, 2, 1, path="dual"), "path"),
    (lambda: megatron_loss_scale("group_token_mean", 3, 4, 2, 1, path="per_token"),
     "total_num_tokens"),
    (lambda: step_divisor("sample_token_mean", 4), "num_samples"),
    (lambda: LossMode.parse("seq_mean"), "mode"),
    (lambda: sample_denominators("sample_token_sum_norm", [0], [[1]]), "norm"),
    (lambda: sample_denominators("token_mean", [0], [[1]], denominator="kept"), "denominator"),
    (lambda: kl_penalty(torch.zeros(1), torch.zeros(1), "k7"), "kind"),
    (lambda: rejection_mask(torch.zeros(1), torch.ones(1), low=2.0, high=0.5), "high"),
    (lambda: ppo_clip_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), dual_clip=0.5),
     "dual_clip"),
])
def test_bad_loss_config_raises_typed_error_naming_the_field(call, field):
    with pytest.raises(LossConfigError, match=rf"^{field}") as info:
        call()
    assert "Fix:" in str(info.value) and isinstance(info.value, VimeError)


def test_cp_offsets_docstring_example():
    r0, r1 = zigzag_offsets(16, 8, 0, 2), zigzag_offsets(16, 8, 1, 2)
    assert r0.chunks == ((0, 4), (12, 16)) and r0.response == ((0, 0), (5, 8))
    assert r1.logits == ((7, 8), (8, 12)) and r1.tokens == ((8, 9), (9, 13))
    assert r0.num_response_tokens + r1.num_response_tokens == 8
    local, lengths = slice_packed_response(torch.arange(10), [16, 4], [8, 2], 1, 2)
    assert local.tolist() == [0, 1, 2, 3, 4, 8, 9] and lengths.tolist() == [5, 2]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_slice_sequence_ranks_reassemble_the_padded_sequence(cp):
    seq = torch.arange(10)
    assert slice_sequence(seq, 0, 2, pad_value=-1).tolist() == [0, 1, 2, 9, -1, -1]
    local = [slice_sequence(seq, r, cp, pad_value=-1) for r in range(cp)]
    half = local[0].shape[0] // 2
    chunks = [None] * (2 * cp)
    for r, piece in enumerate(local):
        chunks[r], chunks[2 * cp - 1 - r] = piece[:half], piece[half:]
    whole = torch.cat(chunks)
    assert whole[:10].tolist() == seq.tolist() and bool((whole[10:] == -1).all())


def test_tis_weights_truncate_at_the_cap():
    w = tis_weights(torch.log(torch.tensor([3.0, 0.5])), torch.zeros(2), cap=2.0)
    assert w.tolist() == pytest.approx([2.0, 0.5]) and not w.requires_grad


@pytest.mark.parametrize("args, field", [((10, 10, 0, 2), "response_length"),
                                         ((10, 2, 2, 2), "cp_rank"),
                                         ((10, 2, 0, 0), "cp_size")])
def test_bad_cp_layout_raises_typed_error(args, field):
    with pytest.raises(CPConfigError, match=rf"^{field}="):
        zigzag_offsets(*args)


def test_ppo_surrogate_examples():
    loss, clipped, ratio = ppo_clip_loss(torch.log(torch.tensor([1.5, 1.0])), torch.zeros(2),
                                         torch.tensor([1.0, 2.0]))
    assert loss.tolist() == pytest.approx([-1.2, -2.0]) and clipped.tolist() == [1.0, 0.0]
    # Dual clip caps the loss of a negative advantage at -A * c = 3.
    dual, _, _ = ppo_clip_loss(torch.log(torch.tensor([10.0])), torch.zeros(1),
                               torch.tensor([-1.0]), dual_clip=3.0)
    assert dual.tolist() == pytest.approx([3.0])
    # A log-ratio of 89 would overflow float32 (exp(89) = inf) and inf * (A = 0) is a NaN: the
    # log-ratio is clamped to 20, so the loss is 0 and the gradient finite.
    logp = torch.tensor([89.0], requires_grad=True)
    loss, _, ratio = ppo_clip_loss(logp, torch.zeros(1), torch.zeros(1))
    loss.sum().backward()
    assert loss.tolist() == [0.0] and ratio.tolist() == pytest.approx([math.exp(20)])
    assert torch.isfinite(logp.grad).all()


def test_microbatch_loss_refuses_silently_wrong_inputs():
    x, m, idx = torch.ones(3), torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 0, 1])
    assert float(microbatch_loss(x, m, idx, torch.tensor([2.0, 0.0]))) == 1.0  # D=0, empty mask
    for dens, match in (([0.0, 1.0], r"denominators\[0\]=0.0: is 0 but token 0"),
                        ([-2.0, 1.0], r"denominators\[0\]=-2.0: is negative"),
                        ([float("nan"), 1.0], r"denominators\[0\]=nan")):
        with pytest.raises(LossConfigError, match=match):
            microbatch_loss(x, m, idx, torch.tensor(dens))
    with pytest.raises(LossConfigError, match=r"sample_index\[2\]=-1: is outside \[0, 2\)"):
        microbatch_loss(x, m, torch.tensor([0, 0, -1]), torch.ones(2))
    with pytest.raises(LossConfigError, match=r"loss_mask\[1\]=0.5: is not 0 or 1"):
        microbatch_loss(x, torch.tensor([1.0, 0.5, 0.0]), idx, torch.ones(2))
    with pytest.raises(LossConfigError, match=r"microbatch_loss: loss_mask=f32\[2\]"):
        microbatch_loss(x, torch.ones(2), idx, torch.ones(2))


def test_denominator_inputs_are_checked():
    with pytest.raises(LossConfigError, match=r"loss_masks\[0\]\[1\]=0.5: is not 0 or 1"):
        group_mask_sums(["a"], [[1, 0.5]])
    with pytest.raises(LossConfigError, match=r"loss_masks\[0\]\[0\]=nan"):
        group_mask_sums(["a"], [[float("nan")]])
    with pytest.raises(LossConfigError, match=r"loss_masks\[0\]=<str>: is not a flat list"):
        group_mask_sums(["a"], ["11"])
    with pytest.raises(LossConfigError, match=r"rejection_masks\[0\]=<1 values>: does not match"):
        sample_denominators("group_token_mean", ["a"], [[1, 1]], rejection_masks=[[1]])
    # None is its own group: two samples without an id are two groups.
    assert group_mask_sums([None, None, "a"], [[1], [1, 1], [1]]).tolist() == [1.0, 2.0, 1.0]


def test_kl_and_entropy_examples():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 - math.log(0.5) - 1)
    assert float(kl_penalty(logp, logp, "k3")) == 0.0
    assert entropy_from_logits(torch.zeros(2, 4)).tolist() == pytest.approx([math.log(4)] * 2)
    terms = policy_loss(torch.zeros(3), torch.zeros(3), torch.full((3,), 2.0))
    assert terms.total.tolist() == [-2.0] * 3 and terms.clipped.sum() == 0


def test_import_vime_pure_stays_torch_free():
    code = ("import sys, vime_pure; from vime_pure import *; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "import vime_pure.torch_ops; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": "src"},
                   cwd=str(__import__("pathlib").Path(__file__).parents[1]))


def test_group_mask_sums_keeps_numpy_float64_behaviour():
    out = group_mask_sums(np.array([3, 3, 7]), [np.ones(2), np.ones(1), np.zeros(4)])
    assert out.dtype == np.float64 and out.tolist() == [3.0, 3.0, 0.0]


def test_zigzag_row_positions_cut_each_sample_and_tile_the_row():
    """A packed row's positions per CP rank: each sample's two zigzag chunks, in place; the
    ranks together hold every position once."""
    from vime_pure.cp import zigzag_row_positions

    assert zigzag_row_positions([4, 8], 0, 2).tolist() == [0, 3, 4, 5, 10, 11]
    assert zigzag_row_positions([4, 8], 1, 2).tolist() == [1, 2, 6, 7, 8, 9]
    both = np.concatenate([zigzag_row_positions([6, 12, 6], r, 3) for r in range(3)])
    assert sorted(both.tolist()) == list(range(24))
