"""A run never takes over another run's directories (``vime_shell.run.ownership``).

Named examples, each reproducing a data-loss finding of issue 19 first: two concurrent runs on
one run directory (two real processes: the second exits 2 at launch); a stale lock named; a
new run on another run's ``--save`` or dump directory; ``--load`` with another run's
``--run-dir`` (metrics would be spliced); a symlinked ``rollouts/`` under
``--overwrite-run-dir``; the owner record (run id and command) in every claimed directory.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime_shell.run.checkpoint_index import LOOP_STATE, TRACKER
from vime_shell.run.launch_checks import check_run_paths
from vime_shell.run.ownership import OwnershipError, claim_run
from vime_shell.run.run_dir import RunDirError
from vime_shell.run.run_log import REQUIRED_KEYS
from vime_shell.settings.train_config import TrainConfig
from vime_shell.storage.locks import LOCK, OWNER, DirClaim, DirectoryInUseError, read_owner
from vime_shell.storage.manifest import write_manifest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _metrics(run_dir: Path, n: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({**dict.fromkeys(REQUIRED_KEYS, 0.0), "rollout": k}) + "\n"
        for k in range(n)))


def _checkpoint(root: Path, done: int, run_id: str | None) -> Path:
    ck = root / f"rollout_{done:06d}"
    ck.mkdir(parents=True)
    (ck / LOOP_STATE).write_text(json.dumps({"rollouts_done": done, "config": {},
                                             "run_id": run_id, "manifest": True}))
    (ck / "__0_0.distcp").write_bytes(os.urandom(4096))
    write_manifest(ck)
    (root / TRACKER).write_text(f"{done}\n")
    return ck


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


@pytest.mark.slow
def test_a_second_run_on_a_run_dir_exits_2_at_launch(tmp_path):
    """Run A (a real `vime train`) holds the run directory; run B on it exits 2 with one line
    naming A, before building anything; once A is killed the directory is free again."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "vime_shell.cli", "train", "--run-dir", str(run)]
    first = subprocess.Popen(cmd + ["--num-rollout", "100000"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while read_owner(run) is None and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert first.poll() is None, "run A ended before it claimed its run directory"
        assert read_owner(run)["pid"] == first.pid
        second = subprocess.run(cmd + ["--num-rollout", "1"], env=env, capture_output=True,
                                text=True, timeout=240)
        assert second.returncode == 2
        line = second.stderr.strip()
        assert "\n" not in line and "is in use by run" in line and f"pid {first.pid}" in line
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    check_run_paths(TrainConfig(run_dir=str(run), overwrite_run_dir=True))  # lock released


def test_a_stale_lock_is_named(tmp_path):
    """The lock is held, but by a process the dead run started: the error says so."""
    dead = subprocess.run(["true"], check=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, json, os, socket, sys, time
fd = os.open({str(tmp_path / LOCK)!r}, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({{"run_id": "r0", "pid": {gone.pid}, "host": socket.gethostname(),
                          "since": "then", "command": "vime train"}}).encode())
print("held", flush=True)
time.sleep(3600)  # held until the test kills it, at any load
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryInUseError, match=f"stale lock.*pid {gone.pid}.*fuser"):
            check_run_paths(TrainConfig(run_dir=str(tmp_path)))
    finally:
        holder.kill()
        holder.wait()
    assert dead.returncode == 0
    check_run_paths(TrainConfig(run_dir=str(tmp_path)))  # the holder died: free


def test_claim_records_the_run_and_locks_every_directory(tmp_path):
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), save=str(tmp_path / "ck"),
                      save_rollout_data=f"{tmp_path}/dumps/r{{rollout_id}}.npz")
    claim, moved = claim_run(cfg, "abc123")
    try:
        assert moved is None
        for name in ("run", "ck", "dumps"):
            owner = read_owner(tmp_path / name)
            assert owner["run_id"] == "abc123" and owner["pid"] == os.getpid()
            assert owner["command"]
        with pytest.raises(DirectoryInUseError, match="--save=.*is in use by run abc123"):
            DirClaim("other").acquire("--save", tmp_path / "ck")
    finally:
        claim.release()
    DirClaim("other").acquire("--save", tmp_path / "ck")  # released


def test_a_new_run_refuses_another_runs_save_and_dump_directories(tmp_path):
    """Found: a fresh run with --save on another run's checkpoints replaced them, and dumps
    outside the run directory were overwritten."""
    ck = tmp_path / "ck"
    _checkpoint(ck, 2, "a1")
    before = _snapshot(ck)
    with pytest.raises(OwnershipError, match=r"--save=.*holds checkpoints.*--load"):
        check_run_paths(TrainConfig(run_dir=str(tmp_path / "run"), save=str(ck)))
    assert _snapshot(ck) == before
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "r0.npz").write_bytes(b"earlier")
    with pytest.raises(OwnershipError, match=r"--save-rollout-data=.*holds 1 rollout dumps"):
        check_run_paths(TrainConfig(run_dir=str(tmp_path / "run"),
                                    save_rollout_data=f"{dumps}/r{{rollout_id}}.npz"))
    (dumps / "notes.txt").write_text("not a dump")  # other names are not the run's files
    (dumps / "r0.npz").unlink()
    check_run_paths(TrainConfig(run_dir=str(tmp_path / "run"),
                                save_rollout_data=f"{dumps}/r{{rollout_id}}.npz"))


def test_load_refuses_another_runs_run_dir(tmp_path):
    """Found: --load CK --run-dir R, R another run's, dropped R's later records and spliced
    the two runs into one metrics.jsonl."""
    ck = tmp_path / "ck"
    _checkpoint(ck, 2, "a1")
    run = tmp_path / "run"
    _metrics(run, 5)
    (run / OWNER).write_text(json.dumps({"run_id": "b2"}))
    before = _snapshot(run)
    with pytest.raises(OwnershipError, match=r"--run-dir=.*belongs to run b2.*continues run a1"):
        check_run_paths(TrainConfig(run_dir=str(run), load=str(ck), save=str(ck)))
    (run / OWNER).unlink()
    with pytest.raises(OwnershipError, match=r"holds 5 metrics records of a run vime cannot"):
        check_run_paths(TrainConfig(run_dir=str(run), load=str(ck), save=str(ck)))
    assert _snapshot(run) == {k: v for k, v in before.items() if k != OWNER}
    (run / OWNER).write_text(json.dumps({"run_id": "a1"}))
    check_run_paths(TrainConfig(run_dir=str(run), load=str(ck), save=str(ck)))  # same run


def test_overwrite_never_moves_through_a_symlinked_rollouts(tmp_path):
    """Found: a symlinked rollouts/ was written through, even with --overwrite-run-dir."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rollout_0.npz").write_bytes(b"keep")
    run = tmp_path / "run"
    _metrics(run, 2)
    (run / "rollouts").symlink_to(elsewhere)
    cfg = TrainConfig(run_dir=str(run), overwrite_run_dir=True,
                      save_rollout_data=f"{run}/rollouts/rollout_{{rollout_id}}.npz")
    with pytest.raises(RunDirError, match=r"holds rollouts, a symlink to .*elsewhere"):
        check_run_paths(cfg)
    with pytest.raises(RunDirError, match="symlink"):
        claim_run(cfg, "x")
    assert os.readlink(run / "rollouts") == str(elsewhere)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["rollout_0.npz"]  # no lock file
    assert (elsewhere / "rollout_0.npz").read_bytes() == b"keep"
    assert (run / "metrics.jsonl").exists()  # nothing moved


def test_overwrite_moves_the_old_dumps_aside_and_claims_new_ones(tmp_path):
    run = tmp_path / "run"
    _metrics(run, 2)
    (run / "rollouts").mkdir()
    (run / "rollouts" / "rollout_0.npz").write_bytes(b"old")
    (run / OWNER).write_text(json.dumps({"run_id": "old"}))
    cfg = TrainConfig(run_dir=str(run), overwrite_run_dir=True,
                      save_rollout_data=f"{run}/rollouts/rollout_{{rollout_id}}.npz")
    check_run_paths(cfg)
    claim, moved = claim_run(cfg, "new")
    try:
        assert (moved / "rollouts" / "rollout_0.npz").read_bytes() == b"old"
        assert read_owner(run)["run_id"] == read_owner(run / "rollouts")["run_id"] == "new"
        with pytest.raises(DirectoryInUseError):
            DirClaim("x").acquire("--save-rollout-data", run / "rollouts")
    finally:
        claim.release()
