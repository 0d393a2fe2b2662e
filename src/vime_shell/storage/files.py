"""Durable, atomic file writes: the one way vime commits a file or a directory rename.

A file is written to a temporary sibling, flushed and ``fsync``-ed, renamed over the target with
``os.replace``, and the directory is ``fsync``-ed so the rename itself survives a power loss. A
crash at any moment leaves the old file or the new one, never a torn one; the temporary file
is removed when the write fails.

Only regular files are written: a symlink is resolved and its target replaced (the link still
points where it did), and a target that exists but is not a regular file (a device such as
``/dev/full``, a FIFO, a directory, a socket) is refused with ``FileKindError`` before anything
is written. New files get the mode a plain ``open`` would give (``0o666`` less the umask), not
``mkstemp``'s ``0o600``; a replaced file keeps its own mode.

Readers use :func:`require_regular_file`: a FIFO or device given as an input is refused, not
read (reading a FIFO waits forever for a writer).

Example: ``write_atomic(Path("ck/latest_checkpointed_iteration.txt"), "6\\n")``; or, for a
writer that needs a file object, ``with atomic_file(path) as fh: np.save(fh, array)``.
"""

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from vime_pure.errors import VimeError, field_error


class FileKindError(VimeError):
    """A path that must be a regular file is a device, a FIFO, a directory or a socket."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def require_regular_file(path: str | os.PathLike, flag: str = "path") -> Path:
    """``path`` (symlinks followed) if it is a regular file; ``FileKindError`` naming ``flag``
    for a device, FIFO, directory or socket, ``FileNotFoundError`` when it does not exist.
    Example: ``require_regular_file("/dev/zero", "--input")`` raises ``--input='/dev/zero': is
    a character device ...``."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise field_error(FileKindError, flag, str(path), f"is {_kind(mode)}, not a regular file",
                          "pass a regular file")
    return Path(path)


def writable_target(path: str | os.PathLike, flag: str = "path") -> Path:
    """Where an atomic write of ``path`` lands: the symlink's final target when ``path`` is a
    link (so the link survives), ``path`` otherwise; ``FileKindError`` when that exists and is
    not a regular file."""
    target = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    try:
        mode = os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a new file (or one the write will refuse)
        return target
    if not stat.S_ISREG(mode):
        raise field_error(FileKindError, flag, str(path), f"is {_kind(mode)}, not a regular "
                          "file: vime writes only regular files and never replaces another "
                          "kind", "pass a path to a regular file (or a new one)")
    return target


def umask_mode() -> int:
    """What ``open`` gives a new file: ``0o666`` less the umask (0o644 under umask 022).

    Read from ``/proc/self/status`` on Linux (setting and restoring the umask, the portable
    way, would race with files other threads create meanwhile)."""
    try:
        with open("/proc/self/status") as fh:
            mask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0)
        os.umask(mask)
    return 0o666 & ~mask


def _new_file_mode(target: Path) -> int:
    """The mode of the file being replaced, or what ``open`` would create."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return umask_mode()


def fsync_path(path: str | os.PathLike) -> None:
    """Make ``path`` durable: a file's contents (one a library wrote by name, such as
    ``safetensors.save_file`` or ``shutil.copy2``), or a directory's entries (renames, new
    files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike[str]) -> None:
    """fsync every file directly in ``directory``, then the directory: for files written by
    a library that does not sync them (Megatron's ``common.pt`` and ``metadata.json``)."""
    for entry in os.scandir(directory):
        if entry.is_file():
            fsync_path(entry.path)
    fsync_path(directory)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file object whose contents replace ``path`` only when the block succeeds
    (``path`` must be a regular file or absent; a symlink is written through)."""
    target = writable_target(path)
    mode = _new_file_mode(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(target.parent)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8) atomically and durably."""
    with atomic_file(path) as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
