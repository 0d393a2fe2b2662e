"""One report and one error per job under ``torchrun`` (``vime_shell.cli.launch_verdict``).

Every test runs a real ``torchrun --nproc-per-node N -m vime_shell.cli train`` and reads the
combined output: the ``--dry-run`` report, a launch error and a flag error each appear exactly
once, torchrun exits 1, an error that one non-zero rank alone finds is printed once, by that
rank, naming it, and so is a failure during the run that reaches every rank. (Every rank exits
2 right after the ranks agree; torchrun's own block lists each rank, with ``exitcode : 2``, or
-15 for a rank still exiting when torchrun saw the first one end: which of the two depends on
timing, so the tests do not count them.)
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def torchrun(tmp_path: Path, ranks: int, *flags: str) -> tuple[int, str]:
    """``(torchrun's exit status, stdout + stderr)`` of ``vime train`` on ``ranks`` ranks."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={ranks}", "-m", "vime_shell.cli", "train",
         "--run-dir", str(tmp_path / "run"), *flags],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def exit_codes(output: str) -> list[int]:
    """The per-rank exit codes of torchrun's ``ChildFailedError`` block."""
    return [int(c) for c in re.findall(r"exitcode\s+: (-?\d+)", output)]


def test_the_dry_run_report_prints_once_under_torchrun(tmp_path):
    status, output = torchrun(tmp_path, 2, "--dry-run")
    assert status == 0, output
    assert output.count("vime train --dry-run: every launch check passed") == 1
    assert output.count("parallel layout: world 2") == 1


def test_a_launch_error_prints_once_and_every_rank_exits_2(tmp_path):
    status, output = torchrun(tmp_path, 3, "--dry-run", "--tensor-model-parallel-size", "3")
    errors = [x for x in output.splitlines() if "error:" in x and x.startswith("vime")]
    assert errors == ["vime train: error: --tensor-model-parallel-size=3: does not divide the "
                      + errors[0].split("does not divide the ", 1)[1]], output
    assert status == 1  # torchrun's own status for any failed rank
    assert 2 in exit_codes(output)


def test_a_flag_error_prints_once_under_torchrun(tmp_path):
    status, output = torchrun(tmp_path, 2, "--lrr", "3")
    assert output.count("vime train: error: unrecognized arguments: --lrr 3") == 1, output
    assert status == 1


def test_an_error_one_rank_alone_finds_is_printed_once_by_that_rank(tmp_path):
    """Rank 1 cannot import the reward (as if its node lacked the file); ranks 0 and 2 can:
    rank 1 prints its error once, naming itself, and no rank goes on to train."""
    status, output = torchrun(tmp_path, 3, "--dry-run", "--custom-rm-path",
                              "tests.shell.one_rank_plugin:reward")
    errors = [x for x in output.splitlines() if x.startswith("vime train: error:")]
    assert len(errors) == 1, output
    assert re.match(r"vime train: error: rank 1 \(.+\): --custom-rm-path=", errors[0])
    assert "has no attribute 'reward'" in errors[0]
    assert "every launch check passed" not in output
    assert status == 1


def test_a_failure_during_the_run_prints_once_under_torchrun(tmp_path):
    """Every rank's reward fails in rollout 0 and every rank raises its account of it (its own
    error, or rank 0's line quoting another's): the first rank to claim the job's report prints
    it, the others stay quiet."""
    status, output = torchrun(tmp_path, 2, "--debug-rollout-only", "--num-rollout", "1",
                              "--custom-rm-path", "tests.shell.one_rank_plugin:broken_reward")
    errors = [x for x in output.splitlines() if x.startswith("vime train: error:")]
    assert len(errors) == 1 and "the reward server is down" in errors[0], output
    assert status == 1
