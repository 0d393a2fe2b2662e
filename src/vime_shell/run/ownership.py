"""A run never takes over another run's directories (torch-free: checked at launch).

A run has a **run id**: a new one for a new run, the checkpoint's for a resumed run (``--load``
continues the run that wrote it). It claims its run directory, its ``--save`` directory and
its rollout dump directory (:func:`claimed_dirs`) with :class:`vime_shell.storage.locks.
DirClaim`: an exclusive lock for its lifetime and an owner record naming the run id and the
command. Rules, checked at launch (:func:`check_ownership`) and again under the lock
(:func:`claim_run`):

- a directory another live run holds is refused (``DirectoryInUseError``; a stale lock is
  named as such);
- a **new** run refuses a ``--save`` directory that holds checkpoints, and a dump directory
  that holds dumps, of an earlier run (unless ``--overwrite-run-dir`` moves dumps inside the
  run directory aside); the run directory keeps its own rule (:mod:`vime_shell.run.run_dir`);
- a **resumed** run refuses a run, ``--save`` or dump directory owned by another run (another
  run id), or holding files of a run vime cannot identify, so two runs' metrics are never
  spliced into one ``metrics.jsonl``.

Example: ``vime train --load ck_a --run-dir runs/b`` where ``runs/b`` belongs to run ``b1``
fails with ``--run-dir='runs/b': belongs to run b1, but --load ck_a continues run a7 ...``.
"""

import json
import os
import re
import sys
from pathlib import Path

from vime_pure.errors import field_error
from vime_shell.run.checkpoint_index import LOOP_STATE, TRACKER, latest, starts_fresh
from vime_shell.run.run_dir import (RunDirError, check_run_dir, dump_dir, earlier_records,
                                    move_aside)
from vime_shell.settings.slime_flags import redact
from vime_shell.settings.train_config import TrainConfig
from vime_shell.storage.locks import (BOOKKEEPING, DirClaim, DirectoryInUseError, lock_holder,
                                      new_run_id, owner_id)


class OwnershipError(RunDirError):
    """A directory that belongs to another run (or to a run vime cannot identify)."""


def claimed_dirs(cfg: TrainConfig) -> list[tuple[str, Path]]:
    """``(flag, directory)`` a run locks, once per resolved directory."""
    out, seen = [], set()
    for flag, where in (("--run-dir", cfg.run_dir), ("--save", cfg.save),
                        ("--save-rollout-data", dump_dir(cfg.save_rollout_data))):
        if where is None:
            continue
        path = Path(where).expanduser()
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            out.append((flag, path))
    return out


def checkpoint_run_id(load: str | None) -> str | None:
    """The run id a ``--load`` directory continues: its newest checkpoint's, else its owner
    record's; None for a checkpoint written before run ids existed."""
    if load is None:
        return None
    found = latest(Path(load).expanduser())
    if found is not None:
        try:
            run_id = json.loads((found / LOOP_STATE).read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            run_id = None
        if isinstance(run_id, str):
            return run_id
    return owner_id(Path(load).expanduser())


def resumes(cfg: TrainConfig) -> bool:
    """``--load`` continues a run, unless it is slime's first run (``starts_fresh``)."""
    return cfg.load is not None and not starts_fresh(cfg.load, cfg.save, cfg.hf_checkpoint)


def run_id_for(cfg: TrainConfig) -> str:
    """The run's id: the checkpoint's when resuming one that has it, else a new one."""
    return (checkpoint_run_id(cfg.load) if resumes(cfg) else None) or new_run_id()


def _dump_entry(template: str) -> re.Pattern:
    """What the template writes directly in its dump directory, any rollout id, the part
    files of a dump of parts included (``storage.dump.part_path``). Example:
    ``"d/r{rollout_id}.npz"`` -> ``r\\d+(\\.rank\\d+)?\\.npz``; ``"d/{rollout_id}/b.npz"`` ->
    ``\\d+``."""
    prefix = template.split("{", 1)[0]
    rest = template[len(os.path.dirname(prefix)):].lstrip("/")
    first = rest.split("/")[0]
    stem, dot, suffix = first.rpartition(".")
    if "/" in rest or not dot:  # a directory per rollout: its files are inside
        stem, suffix = first, ""
    pattern = re.escape(stem).replace(re.escape("{rollout_id}"), r"\d+")
    if suffix:
        pattern += r"(\.rank\d+)?" + re.escape("." + suffix)
    return re.compile(pattern)


def _held_data(flag: str, cfg: TrainConfig, where: Path) -> str | None:
    """What earlier-run data ``where`` holds for ``flag`` (None when none)."""
    if flag == "--run-dir":
        records = earlier_records(where)
        return f"{records} metrics records" if records else None
    if flag == "--save":
        names = [e.name for e in os.scandir(where)] if where.is_dir() else []
        ck = [n for n in names if n == TRACKER or n.startswith(("rollout_", ".tmp-rollout_"))]
        return f"checkpoints ({', '.join(sorted(ck)[:3])})" if ck else None
    if flag != "--save-rollout-data" or cfg.save_rollout_data is None:
        return None
    pattern = _dump_entry(cfg.save_rollout_data)
    dumps = [e.name for e in os.scandir(where) if pattern.fullmatch(e.name)
             and e.name not in BOOKKEEPING] if where.is_dir() else []
    return f"{len(dumps)} rollout dumps (e.g. {sorted(dumps)[0]})" if dumps else None


def check_unlocked(cfg: TrainConfig) -> None:
    """Refuse, first of all, a directory a live run holds (``DirectoryInUseError``)."""
    for flag, where in claimed_dirs(cfg):
        if (holder := lock_holder(where)) is not None:
            raise field_error(DirectoryInUseError, flag, str(where), holder,
                              f"wait for that run to end or stop it, or pass another {flag}; "
                              "two runs never share a directory")


def check_ownership(cfg: TrainConfig, run_id: str) -> None:
    """Refuse a directory this run would take over from another run (module docstring)."""
    load = cfg.load if resumes(cfg) else None  # the checkpoint this run continues
    resumed = load is not None
    legacy = load is not None and checkpoint_run_id(load) is None  # written before run ids
    run_dir = Path(cfg.run_dir).expanduser().resolve()
    for flag, where in claimed_dirs(cfg):
        owner = owner_id(where)
        if owner == run_id:
            continue
        if resumed and owner is not None:
            raise field_error(OwnershipError, flag, str(where),
                              f"belongs to run {owner}, but --load {load} continues run "
                              f"{run_id}", f"resume with the {flag} that run used, or pass a "
                              f"new {flag}")
        if load is not None and (legacy or where.resolve() == Path(load).expanduser().resolve()):
            continue  # a checkpoint without a run id continues as before
        if not resumed and (flag == "--run-dir" or flag == "--save-rollout-data"
                            and cfg.overwrite_run_dir and run_dir in where.resolve().parents):
            continue  # run_dir.check_run_dir's rule: refused, or moved aside
        data = _held_data(flag, cfg, where)
        if data is not None:
            what = f"run {owner}" if owner else "a run vime cannot identify"
            fix = f"pass a new {flag}"
            if flag == "--save" and not resumed:
                fix += f", or --load {where} to resume that run"
            raise field_error(OwnershipError, flag, str(where), f"holds {data} of {what}", fix)


def claim_run(cfg: TrainConfig, run_id: str) -> tuple[DirClaim, Path | None]:
    """Lock every directory of the run, check ownership again under the locks, move an
    earlier run aside (``--overwrite-run-dir``) and record this run as the owner. Returns the
    claim (``release()`` it at the end) and where the earlier run went (or None)."""
    check_run_dir(cfg)  # before any lock file is created: no symlinked entry is written
    argv = getattr(sys, "orig_argv", sys.argv)  # "python -m vime_shell.cli train ..."
    claim = DirClaim(run_id, command=" ".join([Path(argv[0]).name, *redact(argv[1:])]))
    (run_flag, run_dir), *others = claimed_dirs(cfg)
    try:
        claim.acquire(run_flag, run_dir)
        check_run_dir(cfg)  # again, under the lock: no other run changed it meanwhile
        # Before the other locks: dumps inside the run directory move aside with the old run.
        moved = move_aside(cfg) if cfg.overwrite_run_dir and not resumes(cfg) else None
        for flag, where in others:
            claim.acquire(flag, where)
        check_ownership(cfg, run_id)
        claim.record_owner()  # last: the earlier run's records are gone or moved by now
    except BaseException:
        claim.release()
        raise
    return claim, moved
