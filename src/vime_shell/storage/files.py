"""Durable, atomic file writes: the one way vime commits a file or a directory rename.

A file is written to a temporary sibling, flushed and ``fsync``-ed, renamed over the target with
``os.replace``, and the directory is ``fsync``-ed so the rename itself survives a power loss. A
crash at any moment leaves the old file or the new one, never a torn one; the temporary file
is removed when the write fails.

Example: ``write_atomic(Path("ck/latest_checkpointed_iteration.txt"), "6\\n")``; or, for a
writer that needs a file object, ``with atomic_file(path) as fh: np.save(fh, array)``.
"""

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_path(path: str | os.PathLike) -> None:
    """Make ``path`` durable: a file's contents (one a library wrote by name, such as
    ``safetensors.save_file`` or ``shutil.copy2``), or a directory's entries (renames, new
    files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike) -> None:
    """fsync every file directly in ``directory``, then the directory: for files written by
    a library that does not sync them (Megatron's ``common.pt`` and ``metadata.json``)."""
    for entry in os.scandir(directory):
        if entry.is_file():
            fsync_path(entry.path)
    fsync_path(directory)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file object whose contents replace ``path`` only when the block succeeds."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
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
