"""Checkpoint and resume: a fresh trainer that loads the checkpoint taken between the two
rollouts and trains the second rollout again ends bit-identical to the uninterrupted run
(model, Adam moments, LR scheduler position, step counter), with the plain optimizer and with
the distributed optimizer + overlap."""

import numpy as np
import pytest

from tests.shell.megatron_workers import RESUME_CHECK_LAYOUTS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", RESUME_CHECK_LAYOUTS)
def test_resumed_run_equals_uninterrupted_run(megatron_runs, name):
    ranks = (0,) if name == "dp1" else (0, 1)
    for rank in ranks:
        run = megatron_runs["per_rank"][rank][name]
        resumed = run["resume"]
        assert resumed["steps_done"] == 4
        assert resumed["scheduler_groups"] == run["scheduler_groups"] == 64
        assert resumed["metrics"] == run["metrics"][2:]
        for key, value in run["final"].items():
            assert np.array_equal(resumed["final"][key], value), key
