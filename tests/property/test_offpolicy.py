"""Off-policy correction in the core: decoupled PPO's behaviour weights, step-level rejection
applied to the records, and their split invariance on batches with weight versions."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.loss_helpers import Step, emulate_megatron, oracle_loss
from tests.property.data_strategies import scheduled_batches
from tests.property.test_loss_invariance import splits, steps
from vime_pure import BatchingPolicy, LossMode, ParallelLayout, sample_denominators
from vime_pure.data.batch import RolloutBatch, schedule_for
from vime_pure.data.microbatch import share_batch, step_of_sample
from vime_pure.data.ragged import row_positions
from vime_pure.data.rejection import (batch_sums, rejection_metrics, surviving_sums,
                                      with_rejection)
from vime_pure.data.sample import Sample
from vime_pure.data.shares import share_of_batch
from vime_pure.errors import RolloutBatchError
from vime_pure.metrics import merge_metrics
from vime_pure.policy_config import RS_LEVELS, RejectionConfig
from vime_pure.torch_ops.loss import sample_index_from_lengths
from vime_pure.torch_ops.offpolicy import rejection_keep
from vime_pure.torch_ops.policy_loss import policy_loss, tis_weights

NORM = 7.0


@st.composite
def versioned_steps(draw):
    """A step whose samples carry a staleness (0: fresh, behaviour == old exactly; k > 0:
    behaviour drawn k syncs away from old), a TIS clamp and a rejection config whose
    verdict, computed on the whole step, becomes the step's rejection masks."""
    step = draw(steps())
    n = len(step.group_ids)
    stale = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(step.num_tokens, generator=g, dtype=torch.float64) * 3
    lengths = torch.tensor([len(m) for m in step.loss_masks], dtype=torch.int64)
    index = sample_index_from_lengths(lengths)
    drift = torch.tensor(stale, dtype=torch.float64)[index] if n else torch.zeros(0)
    behaviour = old + 0.4 * drift * torch.randn(step.num_tokens, generator=g,
                                                dtype=torch.float64)
    low, high = draw(st.sampled_from([(0.0, 2.0), (0.5, 5.0), (0.8, 1.25)]))
    config = RejectionConfig(level=draw(st.sampled_from(RS_LEVELS)), lower=low, upper=high,
                             denominator=draw(st.sampled_from(["original", "surviving"])))
    mask = torch.tensor([m for ms in step.loss_masks for m in ms], dtype=torch.float64)
    keep = rejection_keep(old, behaviour, mask, index, config) if draw(st.booleans()) else None
    rejection = None if keep is None else [
        keep[step.offsets[i]:step.offsets[i + 1]].tolist() for i in range(n)]
    step = Step(step.group_ids, step.prompt_lengths, step.loss_masks, rejection, step.norm)
    return step, old, behaviour, (low, high), config.denominator, seed


def decoupled_loss(theta, old, behaviour, clamp, seed):
    """Decoupled PPO per token: the clipped surrogate against old, weighted by old/behaviour."""
    adv = torch.randn(theta.numel(), generator=torch.Generator().manual_seed(seed),
                      dtype=theta.dtype)
    tis = tis_weights(old, behaviour, cap=clamp[1], low=clamp[0])
    return policy_loss(theta, old, adv, ref_log_probs=old - 0.1, kl_coef=0.1, tis=tis).total


@settings(max_examples=25)  # each example runs the whole Megatron emulation
@given(data=st.data())
def test_decoupled_loss_with_rejection_is_split_invariant(data):
    """The behaviour weight depends only on its token, and the rejection verdict and the
    surviving denominators only on the whole step, so the split sum (Megatron's scaling and
    DDP's average cancelling) is the whole-step value and gradient."""
    step, old, behaviour, clamp, denominator, seed = data.draw(versioned_steps())
    split = data.draw(splits(step))
    mode = data.draw(st.sampled_from(list(LossMode)))
    path = data.draw(st.sampled_from(["pair", "triple", "per_token"]))
    theta_split = (old + 0.05).clone().requires_grad_(True)
    theta_whole = (old + 0.05).clone().requires_grad_(True)
    applied, _ = emulate_megatron(step, split, decoupled_loss(theta_split, old, behaviour,
                                                              clamp, seed), mode, denominator,
                                  path)
    expected = oracle_loss(step, decoupled_loss(theta_whole, old, behaviour, clamp, seed), mode,
                           denominator)
    applied.backward()
    expected.backward()
    assert float(applied.detach()) == pytest.approx(float(expected.detach()), rel=1e-12,
                                                    abs=1e-12)
    if step.num_tokens:
        assert float((theta_split.grad - theta_whole.grad).abs().max()) <= 1e-12


@given(n=st.integers(0, 30), seed=st.integers(0, 2**16), level=st.sampled_from(RS_LEVELS))
def test_decoupled_loss_is_the_on_policy_loss_when_every_version_is_current(n, seed, level):
    """Fresh data: the behaviour policy is the old one, so the weight is 1 and no band around
    1 rejects anything; value and gradient equal the on-policy PPO loss exactly."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    theta_a = (old + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    theta_b = theta_a.detach().clone().requires_grad_()
    tis = tis_weights(old, old.clone(), cap=2.0, low=0.5)
    decoupled = policy_loss(theta_a, old, adv, tis=tis).total
    on_policy = policy_loss(theta_b, old, adv).total
    assert torch.equal(decoupled, on_policy)
    decoupled.sum().backward()
    on_policy.sum().backward()
    assert torch.equal(theta_a.grad, theta_b.grad)
    index = torch.sort(torch.randint(0, 3, (n,), generator=g)).values
    keep = rejection_keep(old, old.clone(), torch.ones(n, dtype=torch.float64), index,
                          RejectionConfig(level=level, lower=0.999, upper=1.001))
    assert bool((keep == 1).all())


def test_rejection_keep_levels_worked_example():
    log_ratio = torch.log(torch.tensor([1.0, 3.0, 1.0], dtype=torch.float64))
    old, behaviour = log_ratio, torch.zeros(3, dtype=torch.float64)
    ones, index = torch.ones(3, dtype=torch.float64), torch.tensor([0, 0, 1])
    verdict = {level: rejection_keep(old, behaviour, ones, index,
                                     RejectionConfig(level=level, lower=0.5, upper=2.0)).tolist()
               for level in RS_LEVELS}
    # Sample 0: product 3 > 2 and geometric mean sqrt(3) = 1.73 < 2.
    assert verdict == {"token": [1, 0, 1], "sequence": [0, 0, 1], "geometric": [1, 1, 1]}
    masked = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)  # masked tokens do not vote
    assert rejection_keep(old, behaviour, masked, index,
                          RejectionConfig(level="sequence")).tolist() == [1, 1, 1]
    w = tis_weights(torch.log(torch.tensor([3.0, 0.1, 1.0])), torch.zeros(3), cap=2.0, low=0.5)
    assert w.tolist() == pytest.approx([2.0, 0.5, 1.0])


@settings(max_examples=25)  # builds every rank's records per example
@given(case=scheduled_batches(depth=2), mode=st.sampled_from(list(LossMode)),
       denominator=st.sampled_from(["original", "surviving"]), seed=st.integers(0, 2**16))
def test_with_rejection_gives_each_step_the_cores_rejection_denominators(case, mode,
                                                                          denominator, seed):
    """Each DP rank judges only its share: the records' masks are the loss masks times the
    verdict, their denominators ``sample_denominators`` of the whole step with those
    rejection masks (the shares' surviving totals summed over the DP ranks), and the ranks'
    ``rejected_token_frac`` merges to the whole batch's."""
    batch, schedule = case
    n = batch.num_samples
    keep = np.random.default_rng(seed).integers(0, 2, int(batch.response_offsets[-1])
                                                ).astype(np.float64)
    masks = [batch.sample_loss_mask(i).astype(np.float64) for i in range(n)]
    rows = [keep[batch.response_offsets[i]:batch.response_offsets[i + 1]] for i in range(n)]
    shares = [share_of_batch(batch, schedule.rank_sample_ids(d))
              for d in range(schedule.layout.dp)]
    kept = [keep[row_positions(batch.response_offsets, s.sample_ids)] for s in shares]
    surviving = sum(batch_sums(s, surviving_sums(s, k), n) for s, k in zip(shares, kept))
    for dp_rank, (share, share_keep) in enumerate(zip(shares, kept)):
        mine = with_rejection(
            share_batch(share, schedule, batch.mask_sums, dp_rank=dp_rank, loss_mode=mode,
                        norm=NORM), share, schedule, share_keep, denominator=denominator,
            surviving=surviving, norm=NORM)
        for s, step in enumerate(mine.steps):
            ids = [i for rank in schedule.steps[s].microbatches for mb in rank for i in mb]
            dens = dict(zip(ids, sample_denominators(
                mode, [int(batch.group_ids[i]) for i in ids], [masks[i] for i in ids],
                norm=NORM, rejection_masks=[rows[i] for i in ids], denominator=denominator)))
            for mb in step.microbatches:
                np.testing.assert_array_equal(
                    mb.loss_mask, (batch.loss_masks[mb.response_index] *
                                   keep[mb.response_index]).astype(np.float32))
                assert mb.denominators.tolist() == [dens[i] for i in mb.sample_indices.tolist()]
    frac = merge_metrics([rejection_metrics(s, k)["rejected_token_frac"]
                          for s, k in zip(shares, kept)], "rejected_token_frac")
    trained = np.repeat(step_of_sample(schedule) >= 0, batch.response_lengths)
    counted = batch.loss_masks.astype(np.float64) * trained
    assert (frac.sum, frac.count) == pytest.approx(((counted * (1 - keep)).sum(),
                                                    counted.sum()))


def test_with_rejection_names_a_missing_surviving_total():
    batch, schedule = _one_group_batch()
    share = share_of_batch(batch, schedule.rank_sample_ids(0))
    rank = share_batch(share, schedule, batch.mask_sums, dp_rank=0)
    keep = np.ones(share.num_response_tokens)
    with pytest.raises(RolloutBatchError, match="surviving"):
        with_rejection(rank, share, schedule, keep, denominator="surviving")
    with pytest.raises(RolloutBatchError, match="keep"):
        with_rejection(rank, share, schedule, keep[:-1])


def test_the_docstring_example_keeps_four_of_five_tokens():
    """One group, masks [1, 1, 1] and [1, 1], keep [1, 0, 1] and [1, 1]: D 5 (original) or
    4 (surviving), rejected_token_frac 1/5."""
    batch, schedule = _one_group_batch()
    share = share_of_batch(batch, schedule.rank_sample_ids(0))
    rank = share_batch(share, schedule, batch.mask_sums, dp_rank=0)
    keep = np.array([1.0, 0.0, 1.0, 1.0, 1.0])
    surviving = batch_sums(share, surviving_sums(share, keep), batch.num_samples)
    for denominator, d in (("original", 5.0), ("surviving", 4.0)):
        mine = with_rejection(rank, share, schedule, keep, denominator=denominator,
                              surviving=surviving)
        assert {float(x) for mb in mine.microbatches for x in mb.denominators} == {d}
    assert rejection_metrics(share, keep)["rejected_token_frac"].value == pytest.approx(0.2)


def _one_group_batch():
    batch = RolloutBatch.from_samples([[
        Sample(tokens=[1, 2, 3, 4], response_length=3, reward=1.0, group_id="g"),
        Sample(tokens=[1, 5, 6], response_length=2, reward=1.0, group_id="g")]])
    return batch, schedule_for(batch, ParallelLayout(dp=1), BatchingPolicy(
        global_batch_size=1, max_tokens_per_gpu=64))
