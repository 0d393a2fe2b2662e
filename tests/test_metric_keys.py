"""``tests.metric_keys``: which metrics two runs of the same data may differ in, and by how much.

Asserts: the failure of issue 31 (``logprob_gap`` 1.19e-7 against the fixture's 1.27e-7, an
engine that batched other prompts together) and this machine's rounding of the trainer's
floats pass; a changed reward, count or length, a loss off by more than rounding, a broken
sync's gap, a missing key or a None against a number fail, each named.
"""

import json

import pytest

from tests.metric_keys import (ENGINE_LOGPROB_KEYS, TIMING_KEYS, TRAINER_FLOAT_KEYS,
                               assert_metrics_match, metric_mismatches)
from tests.shell.share_workers import FIXTURE


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    return json.loads(FIXTURE.read_text())["dp2"]


def test_engine_logprob_noise_and_trainer_rounding_match_the_recording(recorded):
    got = [dict(r) for r in recorded]
    got[1]["logprob_gap"] = 1.19e-7  # issue 31's fresh clone, against 1.27e-7 recorded
    # measured on another machine (AVX512): the queued run, and main's funnel, both gave these
    # (grad_norm_max is the rollout's second step; its first step's norm is 0, so the mean is half)
    got[0].update(grad_norm=3.755959797596304 / 2, grad_norm_max=3.755959797596304, logprob_gap=9.998198478452621e-08,
                  logprob_gap_max=2.384185791015625e-07, mismatch_kl=1.5987211703494764e-14)
    got[1].update(grad_norm=4.995585972778947 / 2, grad_norm_max=4.995585972778947, loss=0.006001755595207214,
                  pg_loss=0.006001755595207214, ratio=1.0137147903442383,
                  mismatch_abs=4.470348358154297e-08, rollout_s=99.0)
    assert got != recorded
    assert_metrics_match(got, recorded)


@pytest.mark.parametrize("key,value,rule", [
    ("reward_mean", 0.0625 + 1e-9, "data: exact"),
    ("tokens", 81, "data: exact"),
    ("response_len_mean", 1.9375 + 1 / 16, "data: exact"),
    ("num_samples", 15, "data: exact"),
    ("loss", -3.725290298461914e-09 + 1e-4, "trainer rounding"),
    ("grad_norm", 1.8779799622755553 * (1 + 1e-4), "trainer rounding"),
    ("logprob_gap", 0.02, "engine log-prob noise"),  # what a missed weight sync looks like
    ("probe_gap", 1e-7, "measured in one run only"),  # the fixture's is None
])
def test_a_change_beyond_a_keys_tolerance_is_named(recorded, key, value, rule):
    got = {**recorded[0], key: value}
    (problem,) = metric_mismatches(got, recorded[0])
    assert problem.startswith(f"{key}: got {value!r}, want ") and rule in problem
    with pytest.raises(AssertionError, match=key):
        assert_metrics_match([got, recorded[1]], recorded)


def test_a_missing_key_fails_and_timing_keys_are_ignored(recorded):
    got = {k: v for k, v in recorded[0].items() if k != "entropy"}
    assert metric_mismatches(got, recorded[0]) == ["entropy: only in want"]
    assert metric_mismatches({**recorded[0], "train_s": 3.0}, recorded[0]) == []


def test_the_loss_of_a_tis_run_carries_engine_noise_when_said():
    want = {"loss": 0.0, "grad_norm": 2.0}
    got = {"loss": 3e-6, "grad_norm": 2.0 * (1 + 3e-6)}
    assert metric_mismatches(got, want) == [
        "loss: got 3e-06, want 0.0 (trainer rounding, rtol 1e-05, atol 1e-07)"]
    assert metric_mismatches(got, want, engine_logprobs_in_loss=True) == []


def test_every_fixture_key_has_one_rule(recorded):
    classes = (TIMING_KEYS, ENGINE_LOGPROB_KEYS, TRAINER_FLOAT_KEYS)
    assert not any(a & b for i, a in enumerate(classes) for b in classes[i + 1:])
    floats = {k for r in recorded for k, v in r.items() if isinstance(v, float)}
    # the float keys the fixture holds that are exact: functions of tokens, rewards, lengths
    assert floats - ENGINE_LOGPROB_KEYS - TRAINER_FLOAT_KEYS == {
        "aborted_frac", "dp_imbalance", "filtered_frac", "lr", "nonzero_adv_frac",
        "off_policy_token_frac", "response_len_max", "response_len_mean", "response_len_min",
        "response_len_p10", "response_len_p50", "response_len_p90", "reward_mean", "reward_std",
        "samples_per_group_mean", "staleness/0", "staleness_max", "staleness_mean",
        "truncated_frac"}
