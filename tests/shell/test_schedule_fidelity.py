"""Schedule fidelity: every rank ran exactly the micro-batches and tokens its Schedule said.

The worker feeds each rank ``shard(batch, schedule)[rank]`` and records every micro-batch the
first model chunk consumed (global sample indices and row tokens, per step). The test rebuilds
the schedule independently from the same rollouts and layout and compares.
"""

import pytest

from tests.shell.megatron_workers import LAYOUTS, ROLLOUT_SEEDS, rollout_batch, rollout_schedule
from vime_shell.megatron.platform import TrainLayout

pytestmark = pytest.mark.slow


def _expected(layout: TrainLayout, dp_rank: int, vocab: int):
    expected = []
    for r, seed in enumerate(ROLLOUT_SEEDS):
        batch = rollout_batch(vocab, seed)
        schedule = rollout_schedule(batch, layout)
        for s, step in enumerate(schedule.steps):
            for mb in step.microbatches[dp_rank]:
                expected.append((r, s, tuple(mb), int(batch.lengths[list(mb)].sum())))
    return expected


@pytest.mark.parametrize("name", ["dp1", *LAYOUTS])
def test_each_rank_ran_its_scheduled_microbatches_and_tokens(megatron_runs, name):
    vocab = 128
    ranks = [0] if name == "dp1" else [0, 1]
    for rank in ranks:
        run = megatron_runs["per_rank"][rank][name]
        layout = TrainLayout(**run["layout"])
        assert run["trace"] == _expected(layout, run["dp_rank"], vocab)


@pytest.mark.parametrize("name", ["dp2", "pp2_vpp2"])
def test_step_plan_has_a_partial_step_and_equal_counts(megatron_runs, name):
    run = megatron_runs["per_rank"][0][name]
    layout = TrainLayout(**run["layout"])
    schedule = rollout_schedule(rollout_batch(128, ROLLOUT_SEEDS[0]), layout)
    assert [s.num_groups for s in schedule.steps] == [24, 8]
    counts = {}
    for r, s, _, _ in run["trace"]:
        counts[(r, s)] = counts.get((r, s), 0) + 1
    assert [counts[(0, s)] for s in (0, 1)] == [st.num_microbatches for st in schedule.steps]


def test_interleaved_schedule_rejects_a_count_it_cannot_run(megatron_runs):
    message = megatron_runs["per_rank"][0]["pp2_vpp2"]["vpp_error"]
    assert message.startswith("num_microbatches=1: is not a multiple of microbatch_group=2")
