"""Kill and resume: a run SIGKILLed mid-rollout, or mid-checkpoint, and resumed with ``--load``
ends where an uninterrupted run ends.

Both interrupted runs checkpoint every 2 rollouts. One is killed during rollout 3 (after
rollout 2 was logged but not checkpointed); the other inside the rollout-4 save, after its
tensor shards were written and before the checkpoint was complete, so the rollout-2 checkpoint
must still be the one ``--load`` finds. Resuming from it must re-run rollouts 2 and 3 on the
same data (same dumps), log each rollout exactly once, reproduce the metric sequence of the
uninterrupted run, and end with identical weights.
"""

import json

import numpy as np
import pytest

from tests.metric_keys import without_timing
from tests.shell.loop_workers import killed_in_save_worker, killed_worker, resume_worker
from vime_shell.megatron.checkpoint import TRAINER_STATE
from vime_shell.megatron.spawn import free_port, process, spawn
from vime_shell.run import run_checkpoint as checkpoint
from vime_shell.storage.dump import load_rollout_batch

pytestmark = pytest.mark.slow
# Each killed run and the rollouts it had logged when it died: the hook kill comes before
# rollout 3 is logged, the save kill after.
KILLED = {"interrupted": [0, 1, 2], "killed_in_save": [0, 1, 2, 3]}


def _metrics(path) -> list[dict]:
    return [without_timing(json.loads(x)) for x in path.read_text().splitlines()]


def _run_to_death(target, *args) -> int:
    proc = process(target, *args)
    proc.start()
    proc.join(timeout=600)
    return proc.exitcode


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """Both killed runs, what their ``--save`` directories held at death, then the
    uninterrupted run and the two resumptions (one spawned process)."""
    root = tmp_path_factory.mktemp("resume")
    cache = root / "embedded"  # built by the first process, reused by the others
    codes = {"interrupted": _run_to_death(killed_worker, str(root), str(cache), free_port(), 3),
             "killed_in_save": _run_to_death(killed_in_save_worker, str(root), str(cache),
                                             free_port())}
    at_death = {name: {"latest": checkpoint.latest(root / name / "ckpt"),
                       "entries": sorted(p.name for p in (root / name / "ckpt").iterdir()),
                       "logged": [x["rollout"] for x in
                                  _metrics(root / name / "run" / "metrics.jsonl")]}
                for name in KILLED}
    staged = root / "killed_in_save" / "ckpt" / ".tmp-rollout_000004"
    at_death["killed_in_save"]["staged"] = sorted(p.name for p in staged.iterdir())
    out = spawn(resume_worker, 1, str(root), str(cache), ("uninterrupted", *KILLED))[0]
    return {"root": root, "codes": codes, "at_death": at_death, "out": out}


@pytest.mark.parametrize("name", list(KILLED))
def test_killed_and_resumed_run_equals_uninterrupted(killed_runs, name):
    root, out = killed_runs["root"], killed_runs["out"]
    assert killed_runs["codes"][name] == -9  # really killed, not a clean exit
    death = killed_runs["at_death"][name]
    assert death["latest"] == root / name / "ckpt" / "rollout_000002"
    assert death["logged"] == KILLED[name]
    assert out["uninterrupted"]["start"] == 0 and out["uninterrupted"]["ran"] == [0, 1, 2, 3]
    assert out[name]["start"] == 2 and out[name]["ran"] == [2, 3]
    full = _metrics(root / "uninterrupted" / "run" / "metrics.jsonl")
    resumed = _metrics(root / name / "run" / "metrics.jsonl")
    assert [x["rollout"] for x in resumed] == [0, 1, 2, 3]  # no rollout twice, none skipped
    # Exact, engine-log-prob keys included: each run (one process each, on this machine) has
    # one engine, which generates the same prompts in the same calls on the same weights'
    # bits (resumed from the checkpoint's), and its trainer the same layout.
    assert resumed == full
    for rid in range(4):
        a = load_rollout_batch(root / "uninterrupted" / "dumps" / f"r{rid}.npz")
        b = load_rollout_batch(root / name / "dumps" / f"r{rid}.npz")
        assert all(np.array_equal(x, y) for x, y in zip(a.columns().values(),
                                                        b.columns().values()))
    final_a, final_b = out["uninterrupted"]["final"], out[name]["final"]
    assert final_a.keys() == final_b.keys()
    assert all(np.array_equal(final_a[k], final_b[k]) for k in final_a)
    assert checkpoint.latest(root / name / "ckpt") == root / name / "ckpt" / "rollout_000004"


def test_sigkill_mid_save_keeps_the_previous_checkpoint(killed_runs):
    death = killed_runs["at_death"]["killed_in_save"]
    # Killed with the rollout-4 shards on disk but before its trainer state, loop state,
    # rename and tracker: the tracker still names rollout 2, which is complete.
    assert "__0_0.distcp" in death["staged"] and ".metadata" in death["staged"]
    assert TRAINER_STATE not in death["staged"] and checkpoint.LOOP_STATE not in death["staged"]
    assert death["entries"] == [".tmp-rollout_000004", ".vime-lock", ".vime-run.json",
                                checkpoint.TRACKER, "rollout_000002"]
    assert death["latest"].name == "rollout_000002"


def test_resume_refuses_a_different_data_setup(tmp_path):
    import json

    from vime_shell.run.run_checkpoint import (CheckpointError, LOOP_STATE, TRACKER, _loop_state,
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
