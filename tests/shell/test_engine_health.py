"""Health checks in a real ``vime train`` job: 3 ranks started as ``torchrun`` would (rank 0
trains, ranks 1 and 2 run engines: ``--fully-async`` pools, or one step off), with a tiny
``--rollout-health-check-interval 1`` / ``--rollout-health-check-timeout 5`` (5 s, not less:
a heartbeat thread starved for seconds on a loaded machine must not count as stopped).

Asserts: an engine rank stopped with SIGSTOP while generating rollout 1 (no error, no exit, no
heartbeat) ends the job, fully async and one step off: every other rank exits with status 2
and prints the one line that names the stopped rank by role and global rank; under
``--fully-async`` an engine rank stuck in a call that never returns (alive, beating) ends the
job once trainer rank 0 has waited longer than its bound (the slowest reply so far plus 10
timeouts), every rank naming it, the stuck one included.
The deadline is a safety net for a loaded machine, not what is measured: without the health
checks these jobs waited 3 hours.
"""

import pytest

from tests.shell.health_workers import run_cli_job

pytestmark = pytest.mark.slow

DEADLINE_S = 300.0
# TINY (tests.shell.loop_workers) on 2 engine ranks.
FLAGS = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
         "--max-tokens-per-gpu", "24", "--lr", "1e-3", "--seed", "3",
         "--custom-rm-path", "tests.shell.loop_workers:first_char_reward",
         "--rollout-num-gpus", "2", "--num-rollout", "3",
         "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "5"]
MODES = {"fully_async": ["--fully-async", "--max-weight-staleness", "0"],  # rollout 0 first
         "one_step_off": ["--train-async"]}
STOPPED = "engine rank 1 (global rank 2)"


def _job(tmp_path, embedded_cache, function: str, waited: tuple[int, ...],
         mode: str = "fully_async"):
    flags = [*FLAGS, *MODES[mode], "--run-dir", str(tmp_path / "run"),
             "--rollout-function-path", f"tests.shell.health_workers:{function}"]
    return run_cli_job(tmp_path, embedded_cache, 3, flags, waited=waited, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("mode", ["fully_async", "one_step_off"])
def test_a_stopped_engine_rank_ends_the_job_naming_it_on_every_rank(tmp_path, embedded_cache, mode):
    trainer, healthy, stopped = _job(tmp_path, embedded_cache, "freezing_rollout", (0, 1), mode)
    for status, err in (trainer, healthy):
        assert status == 2, err[-3000:]
        assert f"{STOPPED} stopped answering: no heartbeat for" in err, err[-3000:]
        assert "--rollout-health-check-timeout=5" in err
    assert "vime train: error:" in trainer[1]  # the CLI's one line, not a traceback
    assert "Traceback" not in trainer[1] + healthy[1]
    assert stopped[0] is None  # still stopped when the test killed it


def test_an_engine_rank_stuck_in_a_call_ends_the_job_past_its_wait_bound(tmp_path,
                                                                         embedded_cache):
    """Engine rank 1's rollout function never returns (its heartbeat goes on). The pools share
    one queue, so every pool's part of rollout 1 waits for that group: trainer rank 0's wait
    for the first part it asks passes its bound, and the error names the pools, the stuck
    rank among them, on every rank."""
    ranks = _job(tmp_path, embedded_cache, "blocking_rollout", (0, 1, 2))
    for status, err in ranks:
        assert status == 2, err[-3000:]
        assert "waited" in err and "'s reply to rollout 1" in err, err[-3000:]
        assert f"the rank making no progress is one of engine rank 0 (global rank 1), {STOPPED}" \
            in err, err[-3000:]
        assert "the slowest such wait so far" in err  # rollout 0's reply set the bound
        assert "--rollout-health-check-timeout=5" in err
