"""Every loss mode through Megatron: the same step split two ways, on DP1 and DP2, trains alike.

The shared Megatron run trains one step of 32 groups in each ``LossMode`` with a 48-token and a
512-token micro-batch budget, on DP1 and DP2, from the same weights (``megatron_workers.
loss_modes``). The reported loss must equal the core's reference reduction of the batch (on
policy the ratio is 1, so the loss is ``-(1/C) * sum_i A_i * M_i / D_i`` with ``D`` and ``C`` from
``vime_pure.denominators``), and the gradient DDP applied must be the same vector for every
split and DP size.
"""

import numpy as np
import pytest

from tests.shell.megatron_workers import ROLLOUT_SEEDS, rollout_batch
from vime_pure import LOSS_MODES, step_denominators, step_divisor
from vime_pure.data.ragged import row_sums

pytestmark = pytest.mark.slow


def _reference_loss(mode: str) -> float:
    batch = rollout_batch(128, ROLLOUT_SEEDS[0])
    masks = row_sums(batch.loss_masks, batch.response_offsets).astype(np.float64)
    one_step = np.zeros(batch.num_samples, dtype=np.int64)
    dens = step_denominators(mode, batch.group_ids, masks, one_step, norm=8.0)
    divisor = step_divisor(mode, batch.num_groups, batch.num_samples)
    # A sample whose group has no loss token (D = 0) contributes nothing.
    per_sample = np.divide(batch.advantages * masks, dens, out=np.zeros_like(masks),
                           where=dens > 0)
    return float(-per_sample.sum() / divisor)


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_loss_and_gradient_equal_the_reference_for_any_split_and_dp(megatron_runs, mode):
    per_rank = megatron_runs["per_rank"]
    runs = {"dp1": per_rank[0]["loss_modes_dp1"], "dp2 rank 0": per_rank[0]["loss_modes_dp2"],
            "dp2 rank 1": per_rank[1]["loss_modes_dp2"]}
    expected = _reference_loss(mode)
    reference_grad = runs["dp1"][(mode, 512)]["grad"]
    assert np.abs(reference_grad).max() > 1e-4  # a real gradient, not a trivial zero
    for name, run in runs.items():
        small, large = run[(mode, 48)], run[(mode, 512)]
        assert small["microbatches"] > large["microbatches"], name  # two different splits
        for result in (small, large):
            assert result["loss"] == pytest.approx(expected, abs=1e-6), name
            assert np.abs(result["grad"] - reference_grad).max() <= 1e-6, name


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_the_on_policy_shortcut_equals_recomputed_old_log_probs(megatron_runs, mode):
    """Step 0 without an old-log-prob forward trains exactly as with one: identical loss and
    gradient (the ratio is exp(0) either way), on DP1 and on both DP2 ranks."""
    per_rank = megatron_runs["per_rank"]
    for run in (per_rank[0]["loss_modes_dp1"], per_rank[0]["loss_modes_dp2"],
                per_rank[1]["loss_modes_dp2"]):
        shortcut, recomputed = run[(mode, 48)], run[(mode, "recomputed")]
        assert shortcut["loss"] == recomputed["loss"]
        assert np.array_equal(shortcut["grad"], recomputed["grad"])
