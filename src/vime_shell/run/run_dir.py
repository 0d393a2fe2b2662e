"""Run directories are never silently reused: what a run writes there, and what an earlier run
left behind (torch-free: ``launch_checks`` reads it before anything heavy is imported).

A run writes ``metrics.jsonl``, ``curves.png``, ``schedule.png`` and ``tb/`` into
``--run-dir`` (:mod:`vime_shell.run.run_log`), plus its rollout dumps when
``--save-rollout-data`` points inside it (the demo's ``rollouts/``). Rules:

- a **new** run (no ``--load``) refuses a run directory whose ``metrics.jsonl`` holds records:
  emptying it would lose the earlier run's metrics;
- with ``--overwrite-run-dir`` those outputs are **moved aside**, never deleted, to
  ``<run-dir>/previous-<YYYYmmdd-HHMMSS>/`` (``vime demo`` does this by itself, so
  ``make demo`` can be rerun);
- a **resumed** run (``--load``) continues the log: records at or after the resume point are
  dropped (``RunLogger``), so ``--overwrite-run-dir`` contradicts it.

Example: a second ``vime train --run-dir runs/r1`` fails with ``run_dir='runs/r1': holds
metrics.jsonl with 300 records of an earlier run ...``; with ``--overwrite-run-dir`` the 300
records end up in ``runs/r1/previous-20250101-120000/metrics.jsonl``.
"""

import os
import time
from pathlib import Path
from typing import overload

from vime_pure.errors import field_error
from vime_shell.run.checkpoint_index import starts_fresh
from vime_shell.settings.train_config import ConfigError, TrainConfig
from vime_shell.storage.files import fsync_path, writable_target

METRICS = "metrics.jsonl"
CURVES = "curves.png"
SCHEDULE_PLOT = "schedule.png"
TENSORBOARD = "tb"
RUN_FILES = (METRICS, CURVES, SCHEDULE_PLOT, TENSORBOARD)
PREVIOUS = "previous-"


class RunDirError(ConfigError):
    """A run directory that a new run would silently overwrite, or that cannot hold a run."""


def earlier_records(run_dir: str | Path) -> int:
    """Non-blank lines of ``<run_dir>/metrics.jsonl`` (0 when absent): one per rollout."""
    path = Path(run_dir).expanduser() / METRICS
    if not path.is_file():
        return 0
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def run_outputs(cfg: TrainConfig) -> list[Path]:
    """The top-level entries of the run directory this run writes: the log files and, when
    ``--save-rollout-data`` points inside the run directory, the dumps' first folder there."""
    run_dir = Path(cfg.run_dir).expanduser()
    outputs = [run_dir / name for name in RUN_FILES]
    if cfg.save_rollout_data is not None:
        inside = _inside(Path(cfg.save_rollout_data).expanduser().parent, run_dir)
        if inside is not None and inside not in outputs:
            outputs.append(inside)
    return outputs


@overload
def dump_dir(template: str) -> str: ...


@overload
def dump_dir(template: None) -> None: ...


def dump_dir(template: str | None) -> str | None:
    """The fixed directory of a ``--save-rollout-data`` template: everything before the first
    ``{``, up to its last ``/``. Example: ``"runs/r/rollouts/rollout_{rollout_id}.npz"`` ->
    ``"runs/r/rollouts"``, ``"dumps/{rollout_id}/b.npz"`` -> ``"dumps"``."""
    if template is None:
        return None
    return os.path.dirname(template.split("{", 1)[0]) or "."


def _symlinked_entry(cfg: TrainConfig) -> Path | None:
    """A run output, or a folder on the way from the run directory to the dumps, that is a
    symlink: writing or moving aside through it would reach files of another directory."""
    run_dir = Path(os.path.abspath(Path(cfg.run_dir).expanduser()))
    for path in run_outputs(cfg):
        if path.is_symlink():
            return path
    if cfg.save_rollout_data is not None:
        dumps = Path(os.path.abspath(Path(dump_dir(cfg.save_rollout_data)).expanduser()))
        if run_dir == dumps or run_dir in dumps.parents:
            for part in [dumps, *dumps.parents]:
                if part == run_dir:
                    break
                if part.is_symlink():
                    return part
    return None


def _inside(path: Path, run_dir: Path) -> Path | None:
    """The entry of ``run_dir`` that contains ``path`` (None when ``path`` is elsewhere)."""
    try:
        rel = path.resolve().relative_to(run_dir.resolve())
    except ValueError:
        return None
    return run_dir / rel.parts[0] if rel.parts else None


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse, before anything is built, a run directory that this run would overwrite."""
    run_dir = Path(cfg.run_dir).expanduser()
    if run_dir.exists() and not run_dir.is_dir():
        raise field_error(RunDirError, "run_dir", cfg.run_dir, "is a file",
                          "pass a directory for metrics.jsonl and the plots")
    link = _symlinked_entry(cfg)
    if link is not None:
        raise field_error(RunDirError, "--run-dir", cfg.run_dir,
                          f"holds {link.name}, a symlink to {os.path.realpath(link)}: vime "
                          "would write or move files through it into another directory",
                          "replace the link with a real directory, or point "
                          "--save-rollout-data at the link's target directly")
    for name in (METRICS, CURVES, SCHEDULE_PLOT):  # a FIFO there would block the logger
        writable_target(run_dir / name, "--run-dir")
    if cfg.load is not None and not starts_fresh(cfg.load, cfg.save,
                                                 cfg.hf_checkpoint):  # resuming
        if cfg.overwrite_run_dir:
            raise field_error(RunDirError, "overwrite_run_dir", True,
                              f"contradicts --load {cfg.load}: a resumed run continues its "
                              "metrics", "drop --overwrite-run-dir to resume, or --load to "
                              "start a new run")
        return
    if cfg.overwrite_run_dir:
        moved = set(p for p in run_outputs(cfg) if p.name not in RUN_FILES)
        read = cfg.load_rollout_data and _inside(
            Path(cfg.load_rollout_data).expanduser().parent, run_dir)
        if read and read in moved:
            raise field_error(RunDirError, "load_rollout_data", cfg.load_rollout_data,
                              f"lies in {read}, which --overwrite-run-dir would move aside",
                              "replay from outside the run directory, or use another --run-dir")
        return
    records = earlier_records(run_dir)
    if records:
        raise field_error(RunDirError, "run_dir", cfg.run_dir,
                          f"holds {METRICS} with {records} records of an earlier run",
                          "pass --overwrite-run-dir to move its files to "
                          f"{cfg.run_dir}/{PREVIOUS}<timestamp>/, choose another --run-dir, or "
                          "--load the run's checkpoint to resume it")


def move_aside(cfg: TrainConfig) -> Path | None:
    """Move the earlier run's outputs to ``<run_dir>/previous-<timestamp>/`` (renames in one
    file system, then an fsync of the directory); returns it, or None when nothing was there."""
    run_dir = Path(cfg.run_dir).expanduser()
    existing = [p for p in run_outputs(cfg) if p.exists() or p.is_symlink()]
    if not existing:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, k = run_dir / f"{PREVIOUS}{stamp}", 1
    while target.exists():  # two runs in one second keep both
        target, k = run_dir / f"{PREVIOUS}{stamp}-{k}", k + 1
    target.mkdir()
    for path in existing:
        if path.is_symlink():  # checked at launch; never move (or follow) a link
            raise field_error(RunDirError, "--run-dir", cfg.run_dir, f"holds the symlink {path}",
                              "replace it with a real directory")
        os.replace(path, target / path.name)
    fsync_path(run_dir)
    return target
