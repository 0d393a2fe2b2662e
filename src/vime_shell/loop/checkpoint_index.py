"""Where run checkpoints live and which one is newest, torch-free (``launch_checks`` reads it).

Layout under a ``--save`` directory (Megatron's tracker file name)::

    DIR/latest_checkpointed_iteration.txt   "6": rollouts completed at the newest checkpoint
    DIR/rollout_000006/                      one complete checkpoint (see run_checkpoint)

Example: ``latest("ck")`` is ``Path("ck/rollout_000006")`` when the tracker says 6 and that
checkpoint has its loop state; None when ``ck`` holds no tracker.
"""

from pathlib import Path

from vime_pure.errors import VimeError, field_error

TRACKER = "latest_checkpointed_iteration.txt"
LOOP_STATE = "loop_state.json"


class CheckpointError(VimeError):
    """A checkpoint that cannot be resumed (missing, incomplete, unreadable, or from a
    different data setup)."""


def checkpoint_dir(root: str | Path, rollouts_done: int) -> Path:
    return Path(root) / f"rollout_{rollouts_done:06d}"


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None when there is none yet."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise field_error(CheckpointError, str(tracker), type(exc).__name__, "cannot be read",
                          "restore the file, or point --load elsewhere") from None
    if not text.isdigit() or not text.isascii():
        raise field_error(CheckpointError, str(tracker), text[:40], "is not a rollout count",
                          "delete the file to start fresh, or restore it")
    path = checkpoint_dir(root, int(text))
    if not (path / LOOP_STATE).is_file():
        raise field_error(CheckpointError, "--load", str(root),
                          f"points at {path.name}, which has no {LOOP_STATE}",
                          "restore the checkpoint directory or point --load elsewhere")
    return path


def require_checkpoint(root: str | Path) -> Path:
    """``latest(root)``, where a missing directory or checkpoint is an error: ``--load`` of a
    mistyped path must not quietly start a new run (a new run passes ``--save`` only)."""
    where = Path(root).expanduser()
    if not where.is_dir():
        raise field_error(CheckpointError, "--load", str(root),
                          "does not exist" if not where.exists() else "is not a directory",
                          "pass the --save directory of the run to resume (a new run uses "
                          "--save only)")
    found = latest(where)
    if found is None:
        raise field_error(CheckpointError, "--load", str(root),
                          f"holds no checkpoint (no {TRACKER})",
                          "pass the --save directory of a run that saved a checkpoint (a new "
                          "run uses --save only)")
    return found


def resume_checkpoint(load: str | Path | None, save: str | Path | None) -> Path | None:
    """The checkpoint a run resumes from, or None for a fresh start.

    slime's idiom ``--load X --save X`` resumes when ``X`` holds a checkpoint and starts fresh
    when ``X`` is missing or empty (a first run). A ``--load`` naming any other path must hold
    a checkpoint (``require_checkpoint``): a typo never starts a run from scratch.
    Example: ``resume_checkpoint("ck", "ck")`` is None before the first save."""
    if load is None or starts_fresh(load, save):
        return None
    return require_checkpoint(load)


def starts_fresh(load: str | Path, save: str | Path | None) -> bool:
    """slime's first run: ``--load`` is the ``--save`` directory and it is missing or empty."""
    where = Path(load).expanduser()
    same = save is not None and where.resolve() == Path(save).expanduser().resolve()
    return same and (not where.exists() or (where.is_dir() and not any(where.iterdir())))
