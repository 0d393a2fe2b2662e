"""Kill and resume: a run SIGKILLed mid-rollout and resumed with ``--load`` ends where an
uninterrupted run ends.

The interrupted run checkpoints every 2 rollouts and is killed during rollout 3 (after rollout
2 was logged but not checkpointed). Resuming from the rollout-2 checkpoint must re-run rollouts
2 and 3 on the same data (same dumps), log each rollout exactly once, reproduce the metric
sequence of the uninterrupted run, and end with identical weights.
"""

import json
import multiprocessing as mp

import numpy as np
import pytest

from tests.shell.loop_workers import killed_worker, resume_worker
from vime_shell.loop import run_checkpoint as checkpoint
from vime_shell.storage.dump import load_rollout_batch
from vime_shell.megatron.spawn import free_port, spawn

pytestmark = pytest.mark.slow
TIMING = {"rollout_s", "train_s", "sync_s", "old_logprob_s", "eval_s", "tokens_per_s"}


def _metrics(path) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [{k: v for k, v in x.items() if k not in TIMING} for x in lines]


def test_killed_and_resumed_run_equals_uninterrupted(tmp_path):
    cache = tmp_path / "embedded"  # built by the first process, reused by the second
    proc = mp.get_context("spawn").Process(
        target=killed_worker, args=(str(tmp_path), str(cache), free_port(), 3))
    proc.start()
    proc.join(timeout=600)
    assert proc.exitcode == -9  # really killed, not a clean exit
    killed = tmp_path / "interrupted"
    assert checkpoint.latest(killed / "ckpt") == killed / "ckpt" / "rollout_000002"
    assert [x["rollout"] for x in _metrics(killed / "run" / "metrics.jsonl")] == [0, 1, 2]

    out = spawn(resume_worker, 1, str(tmp_path), str(cache))[0]
    assert out["uninterrupted"]["start"] == 0 and out["uninterrupted"]["ran"] == [0, 1, 2, 3]
    assert out["interrupted"]["start"] == 2 and out["interrupted"]["ran"] == [2, 3]
    full = _metrics(tmp_path / "uninterrupted" / "run" / "metrics.jsonl")
    resumed = _metrics(killed / "run" / "metrics.jsonl")
    assert [x["rollout"] for x in resumed] == [0, 1, 2, 3]  # no rollout twice, none skipped
    assert resumed == full
    for rid in range(4):
        a = load_rollout_batch(tmp_path / "uninterrupted" / "dumps" / f"r{rid}.npz")
        b = load_rollout_batch(killed / "dumps" / f"r{rid}.npz")
        assert all(np.array_equal(x, y) for x, y in zip(a.columns().values(),
                                                        b.columns().values()))
    final_a, final_b = out["uninterrupted"]["final"], out["interrupted"]["final"]
    assert final_a.keys() == final_b.keys()
    assert all(np.array_equal(final_a[k], final_b[k]) for k in final_a)
    assert checkpoint.latest(killed / "ckpt") == killed / "ckpt" / "rollout_000004"


def test_resume_refuses_a_different_data_setup(tmp_path):
    import json

    from vime_shell.loop.run_checkpoint import (CheckpointError, LOOP_STATE, TRACKER, _loop_state,
                                                load)

    ck = tmp_path / "rollout_000002"
    ck.mkdir()
    (ck / LOOP_STATE).write_text(json.dumps(_loop_state(2, {"seed": 1, "task": "reverse2"})))
    (tmp_path / TRACKER).write_text("2\n")
    assert checkpoint.latest(tmp_path) == ck
    with pytest.raises(CheckpointError, match="seed"):
        load(ck, trainer=None, config={"seed": 2, "task": "reverse2"})
    (tmp_path / TRACKER).write_text("7\n")
    with pytest.raises(CheckpointError, match="rollout_000007"):
        checkpoint.latest(tmp_path)
    assert checkpoint.latest(tmp_path / "empty") is None
