"""Rollout functions and a launcher for the health-check jobs (``test_engine_health``).

``run_cli_job`` starts ``vime train`` once per rank, as ``torchrun`` would (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT``), each rank's stderr in a file of its own, so a
test reads what every rank printed and how it exited, rank by rank (torchrun would end the
other ranks itself after the first failure).
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from vime_shell.megatron.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]


def _frozen_rank() -> bool:
    """The job's last rank: engine rank 1 of 2 in a 3-rank job (global rank 2)."""
    return int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1


def freezing_rollout(ctx):
    """The default rollout, except that the job's last rank stops its own process (SIGSTOP,
    as ``kill -STOP`` would) when it starts on rollout 1: no error, no exit, no heartbeat."""
    from vime_shell.rollout.functions import single_turn_rollout

    if _frozen_rank() and ctx.rollout_id >= 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return single_turn_rollout(ctx)


def blocking_rollout(ctx):
    """The default rollout, except that on the job's last rank rollout 1 never returns (as a
    call stuck in a driver would): the process stays alive and keeps beating."""
    from vime_shell.rollout.functions import single_turn_rollout

    if _frozen_rank() and ctx.rollout_id >= 1:
        threading.Event().wait()
    return single_turn_rollout(ctx)


def run_cli_job(tmp_path: Path, cache: str, ranks: int, flags: list[str], *,
                waited: tuple[int, ...], deadline_s: float) -> list[tuple[int | None, str]]:
    """``vime train FLAGS`` on ``ranks`` processes; ``(exit status, stderr)`` per rank. The
    ranks ``waited`` get until ``deadline_s`` after the start to exit; then every process
    still running is killed (a stopped one too) and its status is None."""
    env = dict(os.environ, VIME_CACHE_DIR=cache, OMP_NUM_THREADS="1", WORLD_SIZE=str(ranks),
               LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    procs, logs = [], []
    for rank in range(ranks):
        log = open(tmp_path / f"rank{rank}.err", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "vime_shell.cli", "train", *flags],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), cwd=tmp_path,
            stdout=subprocess.DEVNULL, stderr=log))
    statuses = _wait_for(procs, waited, deadline_s)
    out = []
    for status, log in zip(statuses, logs):
        log.seek(0)
        out.append((status, log.read()))
        log.close()
    return out


def _wait_for(procs: list[subprocess.Popen], waited: tuple[int, ...], deadline_s: float
              ) -> list[int | None]:
    """Wait for the processes ``waited`` until the deadline, kill every one left; each one's
    exit status (None: killed)."""
    end = time.monotonic() + deadline_s
    for rank in waited:
        try:
            procs[rank].wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    statuses = [proc.poll() for proc in procs]
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # SIGKILL ends a stopped process too
            proc.wait()
    return statuses
