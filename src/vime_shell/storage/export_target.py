"""Where an HF export may go, and how it lands there touching only the files it wrote.

Torch-free (``launch_checks`` refuses a bad ``--save-hf`` before anything heavy is imported).

Rules (each tested on scratch copies of a model, a checkpoint and a run directory):

- **Refused targets** (``check_export_target``): ``/``, the home directory and the working
  directory, or a directory containing one of them; a target that is, contains or lies inside
  the source model (``--hf-checkpoint``), the run directory, a ``--save`` / ``--load`` or rollout
  dump directory; a file; and a non-empty directory that no vime export wrote, unless
  ``--save-hf-overwrite`` (then only the files the export produces are replaced there).
- **Marker.** A directory vime exports into holds ``.vime-export.json``, listing the files the
  last export produced. It is written first into a new target (so even an interrupted first
  export leaves a directory vime recognises) and last after a complete export.
- **Publishing** (``publish``): files are written into ``<target>/.vime-staging/`` (same file
  system as the target even when the target is a mount point, so every move is a rename), each
  fsynced; then the old index is removed, every produced file is renamed over its name, the
  new index is renamed in last, files the previous export produced and this one did not
  (stale shards) are removed, the marker is rewritten and the staging directory removed. A
  crash before the swap leaves the old export intact; a crash during it leaves a directory
  without an index (loaders refuse it) until the next export. Nothing else in the directory
  is ever replaced, moved or deleted.

Example: ``--save-hf ~`` fails at launch with ``--save-hf='~': is your home directory ...``;
``--save-hf out`` over an export of 3 shards by an export of 2 leaves 2 shards, the index,
the model's config and tokenizer files, the marker, and the user's ``out/NOTES.md``.
"""

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from vime_pure.errors import field_error
from vime_shell.storage.files import fsync_path, write_atomic
from vime_shell.storage.sizes import ExportError

MARKER = ".vime-export.json"
STAGING = ".vime-staging"
INDEX_NAME = "model.safetensors.index.json"
_FORMAT = "vime.hf_export"


def _relation(target: Path, other: Path) -> str | None:
    """How ``target`` relates to ``other`` (both resolved): "is", "contains", "is inside"."""
    if target == other:
        return "is"
    if target in other.parents:
        return "contains"
    if other in target.parents:
        return "is inside"
    return None


def check_export_target(target: str | Path, *, flag: str = "--save-hf",
                        protected: Mapping[str, str | Path | None] = {},
                        overwrite: bool = False) -> Path:
    """Refuse a target the export must not write into (module docstring); the resolved target.

    ``protected`` maps a description (``"the run directory (--run-dir)"``) to a directory the
    export may neither be, contain, nor lie inside."""
    resolved = Path(target).expanduser().resolve()
    for what, where in (("the root directory", Path("/")), ("your home directory", Path.home()),
                        ("the working directory", Path.cwd())):
        relation = _relation(resolved, where.resolve())
        if relation in ("is", "contains"):
            raise field_error(ExportError, flag, str(target), f"{relation} {what} ({where})",
                              "pass a new directory for the exported model, e.g. "
                              "runs/<name>/hf")
    for what, directory in protected.items():
        if directory is None:
            continue
        relation = _relation(resolved, Path(directory).expanduser().resolve())
        if relation is not None:
            raise field_error(ExportError, flag, str(target), f"{relation} {what} ({directory})",
                              "pass a separate directory for the exported model; the export "
                              "never writes among a model's or a run's own files")
    if resolved.exists() and not resolved.is_dir():
        raise field_error(ExportError, flag, str(target), "is a file", "pass a directory")
    foreign = _foreign_entries(resolved)
    if foreign and not overwrite:
        raise field_error(ExportError, flag, str(target),
                          f"holds {len(foreign)} entries no vime export wrote (e.g. "
                          f"{sorted(foreign)[0]})", "pass a new or empty directory, or "
                          "--save-hf-overwrite to write the export among them (only the files "
                          "it produces are replaced; nothing else is moved or deleted)")
    return resolved


def _foreign_entries(target: Path) -> list[str]:
    """Entries of an existing ``target`` when no vime export wrote it (empty list otherwise)."""
    if not target.is_dir() or read_marker(target) is not None:
        return []
    return [e.name for e in os.scandir(target) if e.name != STAGING]


def read_marker(target: Path) -> list[str] | None:
    """The files the last export into ``target`` produced; None when vime never exported
    there (an unreadable marker counts as none: the target is then treated as foreign)."""
    try:
        marker = json.loads((target / MARKER).read_text())
        files = marker["files"] if marker.get("format") == _FORMAT else None
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return [f for f in files if f and "/" not in f and f not in (".", "..", MARKER)]


def _write_marker(target: Path, files: Iterable[str]) -> None:
    write_atomic(target / MARKER, json.dumps({"format": _FORMAT, "version": 1,
                                               "files": sorted(files)}, indent=1) + "\n")


def fresh_staging(target: Path) -> Path:
    """A new, empty ``<target>/.vime-staging`` (a leftover of an interrupted export is
    removed); a target that does not exist yet is created and marked as vime's."""
    if not target.exists():
        target.mkdir(parents=True)
        _write_marker(target, [])
    staging = target / STAGING
    if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
        staging.unlink()
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def publish(staging: Path, target: Path) -> list[str]:
    """Move every file of ``staging`` into ``target`` (module docstring: index out first and
    in last, stale files of the previous export removed, marker rewritten); the names."""
    produced = sorted(e.name for e in os.scandir(staging) if e.is_file())
    previous = set(read_marker(target) or [])
    fsync_path(staging)  # every file inside is durable before anything moves
    (target / INDEX_NAME).unlink(missing_ok=True)
    for name in produced:
        if name != INDEX_NAME:
            os.replace(staging / name, target / name)
    if INDEX_NAME in produced:
        os.replace(staging / INDEX_NAME, target / INDEX_NAME)
    for name in sorted(previous - set(produced)):  # stale: written by the previous export only
        stale = target / name
        if stale.is_file() and not stale.is_symlink():
            stale.unlink()
    fsync_path(target)
    _write_marker(target, produced)
    staging.rmdir()
    fsync_path(target)
    return produced
