"""The per-request and partial-rollout benchmarks run (timings are never asserted)."""

import asyncio

from benchmarks import partial_rollout, per_request
from vime_pure.data.sample import Sample, Status


def test_per_request_quick(capsys):
    results = per_request.main(["--quick"])
    assert set(results) == {"demo", "long"}
    assert all(r["identical_tokens"] for r in results.values())
    assert "identical tokens: True" in capsys.readouterr().out


def test_partial_rollout_summary_of_records():
    records = [{"reward_mean": 0.1 * (i % 11), "rollout_s": 1.0, "train_s": 0.5, "sync_s": 0.0,
                "partial/offpolicy_token_frac": 0.25, "staleness_mean": 0.5,
                "mismatch_abs": float("nan"), "mismatch_kl": 0.0} for i in range(12)]
    out = partial_rollout.summarize(records)
    assert out["rollouts"] == 12 and out["loop_s"] == 18.0
    assert out["partial/offpolicy_token_frac"] == 0.25 and out["mismatch_abs"] is None
    assert out["seconds_to_0.5"] == 16.5  # trailing-10 mean 0.55 at rollout 10 (0.45 at 9)


def test_the_long_tail_function_aborts_cleanly_without_a_runtime_call():
    sample = Sample(tokens=[5, 6], response_length=2, status=Status.TRUNCATED)
    out = asyncio.run(partial_rollout.long_tail_generate(
        None, sample, {"max_new_tokens": 2, "sampling_seed": 0}))
    assert out is sample  # the budget is spent: nothing to generate, no engine needed
