"""Off-policy data in the ``vime train`` loop: an engine stuck on the initial weights stamps
its samples with version 0 while the trainer advances, the situation of one-step-off and
fully asynchronous training.

Asserts: the weight-sync gap check ignores the stale samples (no ``WeightSyncError``, the gap
is not measured on them); staleness and the off-policy token fraction follow the versions; old
log-probs are recomputed for the first step of a stale batch (the mismatch is measured there
and is the real engine-trainer difference); TIS, slime's MIS weights and token rejection are
reported.
"""

import pytest

from tests.shell.loop_workers import (stale_engine_mis_worker, stale_engine_rs_worker,
                                     stale_engine_worker)
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("embedded"))


def assert_stale_records(records: list[dict]) -> None:
    """Rollout 0 is fresh; rollout k is k syncs ahead of the engine's version 0."""
    assert [r["rollout"] for r in records] == [0, 1, 2]
    first, later = records[0], records[1:]
    assert first["staleness_max"] == 0 and first["off_policy_token_frac"] == 0.0
    assert first["logprob_gap"] < 1e-4
    for k, r in enumerate(later, start=1):
        assert r["staleness_mean"] == r["staleness_max"] == k and r[f"staleness/{k}"] == 1.0
        assert r["off_policy_token_frac"] == 1.0
        assert r["logprob_gap"] is None  # no fresh sample: nothing to compare
        # One step per rollout, yet old log-probs were recomputed: the mismatch is measured
        # and is the engine's real lag (far above fp32 noise).
        assert r["mismatch_abs"] > 1e-4 and r["mismatch_kl"] > 0
        assert 0 < r["tis"] < 2.0 + 1e-6 and 0 <= r["tis_clipfrac"] <= 1


def test_stale_engine_data_trains_with_tis_and_never_trips_the_gap_check(tmp_path, cache):
    out = spawn(stale_engine_worker, 1, str(tmp_path), cache)[0]
    plain, current, tis = out["plain"], out["current"], out["tis"]
    # Samples stamped with the current version are on policy: the same run, to the bit. Exact
    # even for the engine-log-prob keys (tis, logprob_gap, and the TIS-weighted loss): one
    # process, one engine, the same prompts in the same generate calls, so the same bits.
    keys = ("loss", "pg_loss", "tis", "grad_norm", "logprob_gap", "staleness_max")
    assert [[r[k] for k in keys] for r in plain] == [[r[k] for k in keys] for r in current]
    assert all(r["staleness_max"] == 0 and r["logprob_gap"] < 1e-4 for r in current)
    assert_stale_records(tis)
    assert tis[0]["mismatch_abs"] is None  # fresh single-step batch: the forward's own
    assert tis[2]["mismatch_abs"] > tis[1]["mismatch_abs"]  # the lag grows
    assert "rejected_token_frac" not in tis[0]


def test_token_rejection_at_dp2_matches_each_ranks_own_ratios(tmp_path, cache):
    """--use-rs: each DP rank judges its own share's samples; every rank's
    masks agree with its own tokens' ratios, and the surviving share follows the lag."""
    out = spawn(stale_engine_rs_worker, 2, str(tmp_path), cache)
    for rank_out in out:
        rs = rank_out["rs"]
        assert_stale_records(rs)
        assert all(r["wrong_masks"] == 0 and r["scored"] > 0 for r in rs)
        assert rs[0]["mismatch_abs"] < 1e-4  # --use-rs recomputes even fresh batches
        assert rs[0]["rejected_token_frac"] == 0.0  # fp32 noise stays inside the band
        assert all(0 < r["rejected_token_frac"] < 1 for r in rs[1:])
    assert [r["rejected_token_frac"] for r in out[0]["rs"]] == [
        r["rejected_token_frac"] for r in out[1]["rs"]]


def test_slimes_mis_at_dp2_weighs_every_token_by_its_truncated_ratio(tmp_path, cache):
    """slime's mis.yaml (--tis-function mis): each rank's weights are its tokens' truncated
    ratios over one factor, the step's mean weight summed over both ranks, which is the
    reported mis_batch_norm_factor; the masks reject outside the band. Then
    --get-mismatch-metrics alone: the metrics without the weights."""
    out = spawn(stale_engine_mis_worker, 2, str(tmp_path), cache)
    for rank_out in out:
        mis = rank_out["mis"]
        assert [r["rollout"] for r in mis] == [0, 1, 2]
        for r in mis:
            assert r["wrong_masks"] == 0
            assert r["factor_max"] == pytest.approx(r["factor_min"], rel=1e-4)
            assert r["factor_min"] == pytest.approx(r["mis_batch_norm_factor"], rel=1e-4)
            assert r["mis_tis_weight_after_bound"] <= 2.0 + 1e-6
        # on policy the ratio is 1 to fp32 noise; the stuck engine's lag moves it
        assert mis[0]["mis_tis_weight_before_bound"] == pytest.approx(1.0, abs=1e-4)
        assert abs(mis[2]["mis_tis_weight_before_bound"] - 1.0) > 1e-3
        assert all(0 < r["rejected_token_frac"] < 1 for r in mis[1:])
    assert [r["mis_batch_norm_factor"] for r in out[0]["mis"]] == [
        r["mis_batch_norm_factor"] for r in out[1]["mis"]]
    # --get-mismatch-metrics: mis.py's mismatch metrics, and the loss left unweighted
    for rank_out in out:
        watch = rank_out["watch"]
        assert not any(r["weighted"] for r in watch)
        assert "mis_tis_weight_before_bound" not in watch[1] and watch[1]["mis_kl"] != 0
        assert watch[0]["mis_k3_kl"] == pytest.approx(0.0, abs=1e-6)  # on policy
