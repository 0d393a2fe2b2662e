"""What a run does with plugins and batches the trainer must never see (issue 19): each is a
typed error at the first rollout, before any weight changes, naming the sample or the flag."""

import math

import pytest

from tests.shell.bad_input_workers import bad_rollouts_worker, nonfinite_grad_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("embedded"))
    return spawn(bad_rollouts_worker, 1, str(tmp_path_factory.mktemp("bad")), cache)[0]


def test_a_rollout_function_without_log_probs_stops_the_first_rollout(bad):
    """Without engine log-probs the weight-sync check would be silently off."""
    kind, message = bad["no_logprobs"]
    assert kind == "LogprobCheckError" and message.startswith("rollout 0:")
    assert "--no-logprob-check" in message
    assert bad["checked_rollouts"] == 0  # none of the three failing runs trained a rollout


def test_no_logprob_check_runs_and_says_the_check_was_off(bad):
    assert bad["unchecked"]["logprob_check"] == 0
    assert bad["unchecked"]["logprob_gap"] is None  # nothing measured: null in the log
    assert bad["masked"]["logprob_check"] == 1


def test_a_token_id_outside_the_vocabulary_names_the_sample(bad):
    kind, message = bad["out_of_vocab"]
    assert kind == "TokenIdError"
    assert "sample 5 (sample index 5" in message and "=25 (response token)" in message
    assert "[0, 20)" in message  # the embedding rows, the reserved pad row included


def test_a_gap_before_any_weight_sync_does_not_blame_a_sync(bad):
    kind, message = bad["shifted_logprobs"]
    assert kind == "WeightSyncError" and "No weight sync has run yet" in message
    assert "the last weight sync failed" not in message


def test_a_step_with_no_scored_token_reports_no_means(bad):
    """All response tokens masked: ratio, entropy, loss have no value (None), never 0.0."""
    for key in ("ratio", "entropy", "loss", "clipfrac", "kl"):
        assert bad["masked"][key] is None, key


def test_a_reward_calling_sys_exit_0_fails_the_run(bad):
    """A job scheduler must not read a reward's SystemExit(0) as success."""
    assert bad["exit_status"] == 2
    # One error line (its cause, SystemExit: 0, is in it); startup log lines may precede it.
    (line,) = [x for x in bad["exit_stderr"].splitlines() if x.startswith("vime train: error:")]
    assert line.startswith("vime train: error: prompt 0, sample 0: reward "
                           "tests.shell.bad_input_workers:exit_reward exited with SystemExit: 0")


def test_a_nonfinite_gradient_norm_stops_or_skips_the_step(tmp_path):
    """Advantages of 1e38 overflow the loss: clipping by an infinite norm would write NaN
    into every weight. The step stops first, or is skipped (and counted) under the flag."""
    out = spawn(nonfinite_grad_worker, 1, str(tmp_path), str(tmp_path / "embedded"))[0]
    assert out["error"].startswith("step 0: the gradient norm is ")
    assert "--skip-nonfinite-grad-steps" in out["error"]
    assert out["unchanged_after_error"] and out["unchanged_after_skip"]
    assert out["skipped"] and not math.isfinite(out["grad_norm"])
    assert out["next_step_finite"] and out["changed_after_normal_step"]
