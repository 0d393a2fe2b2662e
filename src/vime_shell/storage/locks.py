"""Which run owns a directory, and an exclusive lock on it while that run lives (torch-free).

Each directory a run writes (run directory, ``--save``, the rollout dump directory) gets:

- ``.vime-run.json``: the owner, ``{"run_id", "command", "pid", "host", "since"}``, replaced
  atomically when a run claims the directory, kept after it ends (a later run reads whose
  files are there);
- ``.vime-lock``: a file the run holds an exclusive ``fcntl.flock`` on for its lifetime; the
  kernel releases it when the process exits, however it exits (SIGKILL included). Its text
  names the holder, so a refused run can say who holds it.

A held lock whose recorded pid no longer runs is named as stale: a process the run started
(an engine worker forked with the descriptor) still holds it.

Example: a second ``vime train --run-dir runs/r1`` while the first runs fails at launch with
``--run-dir='runs/r1': is in use by run 3f2a... (pid 4121 on node7, since 2026-01-01T10:00:00:
vime train --run-dir runs/r1). Fix: ...``.
"""

import fcntl
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

from vime_pure.errors import VimeError, field_error
from vime_shell.storage.files import write_atomic

OWNER = ".vime-run.json"
LOCK = ".vime-lock"
BOOKKEEPING = (OWNER, LOCK)


class DirectoryInUseError(VimeError):
    """A directory another live run holds the lock of (or that cannot be locked at all)."""


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def read_owner(directory: str | os.PathLike) -> dict | None:
    """The owner record of ``directory``; None when absent or unreadable."""
    try:
        data = json.loads((Path(directory) / OWNER).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("run_id"), str) else None


def owner_id(directory: str | os.PathLike) -> str | None:
    owner = read_owner(directory)
    return None if owner is None else owner["run_id"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _describe(fd: int, lock: Path) -> str:
    """Who holds ``lock``, from the text its holder wrote."""
    try:
        info = json.loads(os.pread(fd, 1 << 16, 0).decode())
        pid, host = int(info["pid"]), str(info["host"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"is locked by another process ({lock})"
    who = f"run {info.get('run_id')} (pid {pid} on {host}, since {info.get('since')}"
    if host == socket.gethostname() and not _alive(pid):
        return (f"has a stale lock: {who}) is no longer running, but a process it started still "
                f"holds {lock} (find it with `fuser {lock}` and stop it)")
    return f"is in use by {who}: {info.get('command')})"


def lock_holder(directory: str | os.PathLike) -> str | None:
    """None when no live process holds ``directory``'s lock; else who does (for messages)."""
    lock = Path(directory) / LOCK
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # absent (or unreadable: then the claim itself reports it)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe(fd, lock)
    finally:
        os.close(fd)  # closing drops the probe's lock
    return None


class DirClaim:
    """The locks a run holds; ``release()`` (or process exit) frees them."""

    def __init__(self, run_id: str, command: str | None = None):
        self.run_id = run_id
        argv = getattr(sys, "orig_argv", sys.argv)  # "python -m vime_shell.cli train ..."
        self.command = command or " ".join([Path(argv[0]).name, *argv[1:]])
        self.since = time.strftime("%Y-%m-%dT%H:%M:%S")
        self._held: list[tuple[int, Path]] = []

    def acquire(self, flag: str, directory: str | os.PathLike) -> None:
        """Lock ``directory`` (created if needed); ``DirectoryInUseError`` when held."""
        where = Path(directory).expanduser()
        lock = where / LOCK
        try:
            where.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as exc:  # read-only, a file in the way, a symlinked lock file
            raise field_error(DirectoryInUseError, flag, str(directory),
                              f"cannot be locked ({type(exc).__name__}: {exc})",
                              f"pass a {flag} you can write to") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(fd, lock)
            os.close(fd)
            raise field_error(DirectoryInUseError, flag, str(directory), holder,
                              f"wait for that run to end or stop it, or pass another {flag}; "
                              "two runs never share a directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self._info()).encode(), 0)
        self._held.append((fd, where))

    def _info(self) -> dict:
        return {"run_id": self.run_id, "command": self.command, "pid": os.getpid(),
                "host": socket.gethostname(), "since": self.since}

    def record_owner(self) -> None:
        """Write this run's owner record into every locked directory."""
        for _, where in self._held:
            write_atomic(where / OWNER, json.dumps(self._info()) + "\n")

    def release(self) -> None:
        for fd, _ in self._held:
            os.close(fd)  # drops the flock
        self._held.clear()
