"""Layout equivalence: the same rollouts and step plan give the same training on every layout.

Parameter deltas scale with the learning rate under Adam (a near-zero gradient whose rounding
differs between layouts still moves its weight by up to lr), so lr sets how strict 1e-5 is.

Two rollout batches of 32 groups, each scheduled as steps of [24, 8] groups (a partial step),
old log-probs recomputed with the log-prob step, PPO with Adam (lr 1e-4), fp32. The final
parameters and every step's loss on DP2, DP2 + distributed optimizer + overlapped grad reduce
and param gather, TP2, PP2 and PP2xVPP2 must equal DP1 to 1e-5.
"""

import numpy as np
import pytest

from tests.shell.megatron_workers import LAYOUTS

pytestmark = pytest.mark.slow
TOL = 1e-5


def _param_delta(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_final_params_and_losses_equal_dp1(megatron_runs, name):
    ref = megatron_runs["per_rank"][0]["dp1"]
    run = megatron_runs["per_rank"][0][name]
    param_delta = _param_delta(run["final"], ref["final"])
    loss_delta = max(abs(a["loss"] - b["loss"]) for a, b in zip(run["metrics"], ref["metrics"]))
    report_delta = max(abs(a[k] - b[k]) for a, b in zip(run["metrics"], ref["metrics"])
                       for k in ("pg_loss", "entropy", "clipfrac", "ratio", "log_prob", "tokens"))
    print(f"{name}: max |param - dp1| = {param_delta:.2e}, max |loss - dp1| = {loss_delta:.2e}")
    assert len(run["metrics"]) == len(ref["metrics"]) == 4
    assert param_delta <= TOL
    assert loss_delta <= TOL
    assert report_delta <= TOL


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_rank_ends_with_the_same_weights_and_metrics(megatron_runs, name):
    r0, r1 = (megatron_runs["per_rank"][rank][name] for rank in (0, 1))
    assert _param_delta(r0["final"], r1["final"]) == 0.0
    assert r0["metrics"] == r1["metrics"]


def test_training_moved_the_weights(megatron_runs):
    from safetensors.numpy import load_file

    original = load_file(f"{megatron_runs['hf_dir']}/model.safetensors")
    # Adam moves every trained weight by about lr per step: 4 steps of lr 1e-4.
    assert _param_delta(megatron_runs["per_rank"][0]["dp1"]["final"], original) > 1e-4


@pytest.mark.parametrize("name", ["dp1", *LAYOUTS])
def test_lr_schedule_advances_by_real_group_counts(megatron_runs, name):
    run = megatron_runs["per_rank"][0][name]
    # Two rollouts of steps [24, 8]: the scheduler saw 64 groups, not 4 full steps of 24.
    assert run["scheduler_groups"] == 2 * (24 + 8)
    assert run["lr"] == [pytest.approx(1e-4)] * 4


def test_reported_metrics_are_count_weighted_means(megatron_runs):
    from tests.shell.megatron_workers import ROLLOUT_SEEDS, rollout_batch, rollout_schedule
    from vime_shell.megatron.platform import TrainLayout

    run = megatron_runs["per_rank"][0]["dp1"]
    steps = [s for seed in ROLLOUT_SEEDS for s in rollout_schedule(
        rollout_batch(128, seed), TrainLayout(**run["layout"])).steps]
    assert [m["num_samples"] for m in run["metrics"]] == [s.num_samples for s in steps]
    for m in run["metrics"]:
        assert 0.0 < m["entropy"] <= np.log(128) + 1e-6
        assert m["tokens"] > 0
        assert 0.0 <= m["clipfrac"] <= 1.0
        assert m["log_prob"] < 0.0
