"""Off-policy data in the ``vime train`` loop: an engine stuck on the initial weights stamps
its samples with version 0 while the trainer advances, the situation of one-step-off and
fully asynchronous training.

Asserts: the weight-sync gap check ignores the stale samples (no ``WeightSyncError``, the gap
is not measured on them); staleness and the off-policy token fraction follow the versions; old
log-probs are recomputed for the first step of a stale batch (the mismatch is measured there
and is the real engine-trainer difference); TIS and token rejection are reported.
"""

import math

import pytest

from tests.shell.loop_workers import stale_engine_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


def test_stale_engine_data_trains_with_corrections_and_never_trips_the_gap_check(tmp_path):
    out = spawn(stale_engine_worker, 1, str(tmp_path), str(tmp_path / "cache"))[0]
    plain, current = out.pop("plain"), out.pop("current")
    # Samples stamped with the current version are on policy: the same run, to the bit.
    keys = ("loss", "pg_loss", "tis", "grad_norm", "logprob_gap", "staleness_max")
    assert [[r[k] for k in keys] for r in plain] == [[r[k] for k in keys] for r in current]
    assert all(r["staleness_max"] == 0 and r["logprob_gap"] < 1e-4 for r in current)
    for name, records in out.items():
        assert [r["rollout"] for r in records] == [0, 1, 2], name
        first, later = records[0], records[1:]
        # Rollout 0: the initial weights are the trainer's, so the data is fresh.
        assert first["staleness_max"] == 0 and first["off_policy_token_frac"] == 0.0
        assert first["logprob_gap"] < 1e-4
        for k, r in enumerate(later, start=1):
            # The trainer is k syncs ahead of the engine's version 0.
            assert r["staleness_mean"] == r["staleness_max"] == k and r[f"staleness/{k}"] == 1.0
            assert r["off_policy_token_frac"] == 1.0
            assert math.isnan(r["logprob_gap"])  # no fresh sample: nothing to compare
            # One step per rollout, yet old log-probs were recomputed: the mismatch is measured
            # and is the engine's real lag (far above fp32 noise).
            assert r["mismatch_abs"] > 1e-4 and r["mismatch_kl"] > 0
            assert 0 < r["tis"] < 2.0 + 1e-6 and 0 <= r["tis_clipfrac"] <= 1
    tis, rs = out["tis"], out["rs"]
    assert tis[2]["mismatch_abs"] > tis[1]["mismatch_abs"]  # the lag grows
    assert math.isnan(tis[0]["mismatch_abs"])  # fresh single-step batch: the forward's own
    assert rs[0]["mismatch_abs"] < 1e-4  # --use-rs recomputes even fresh batches
    assert rs[0]["rejected_token_frac"] == 0.0  # fp32 noise stays inside [0.8, 1.25]
    assert all(0 < r["rejected_token_frac"] < 1 for r in rs[1:])
    assert "rejected_token_frac" not in tis[0]
