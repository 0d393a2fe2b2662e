"""Where run checkpoints live and which one is newest, torch-free (``launch_checks`` reads it).

Layout under a ``--save`` directory (Megatron's tracker file name)::

    DIR/latest_checkpointed_iteration.txt   "6": rollouts completed at the newest checkpoint
    DIR/rollout_000006/                      one complete checkpoint (see run_checkpoint)

Every checkpoint holds a ``manifest.json`` (:mod:`vime_shell.storage.manifest`: size and
BLAKE2b of each file, written last); ``require_checkpoint`` verifies it, so a flipped byte in a
shard fails ``--load`` at launch naming the file. The loop state records the fingerprint of
``--prompt-data``; ``check_dataset`` refuses a resume on a dataset changed since, unless
``--allow-dataset-change``. ``check_waiting_groups`` refuses to resume a checkpoint with prompt
groups left unfinished by ``--partial-rollout`` under ``--fully-async``, whose pool cannot put
them back (the synchronous and one-step-off loops do, see ``RolloutProducer``).

Example: ``latest("ck")`` is ``Path("ck/rollout_000006")`` when the tracker says 6 and that
checkpoint has its loop state; None when ``ck`` holds no tracker.
"""

import json
import logging
from pathlib import Path

from vime_pure.errors import VimeError, field_error
from vime_shell.storage.locks import BOOKKEEPING
from vime_shell.storage.manifest import ManifestError, dataset_changed, fingerprint, verify_manifest

TRACKER = "latest_checkpointed_iteration.txt"
LOOP_STATE = "loop_state.json"
log = logging.getLogger(__name__)


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


def require_checkpoint(root: str | Path, *, verify: bool = True) -> Path:
    """``latest(root)``, where a missing directory or checkpoint is an error: ``--load`` of a
    mistyped path must not quietly start a new run (a new run passes ``--save`` only).
    ``verify``: check every file against the checkpoint's manifest (launch does, once)."""
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
    if verify:
        _verify(found)
    return found


def resume_checkpoint(load: str | Path | None, save: str | Path | None, *,
                      weights: str | Path | None = None, verify: bool = True) -> Path | None:
    """The checkpoint a run resumes from, or None for a fresh start.

    slime's idiom ``--load X --save X`` resumes when ``X`` holds a checkpoint and starts fresh
    when ``X`` is missing or empty (a first run); miles' FSDP scripts' ``--load`` naming the
    ``--hf-checkpoint`` directory (``weights``) starts from those weights. A ``--load`` naming
    any other path must hold a checkpoint (``require_checkpoint``): a typo never starts a run
    from scratch. Example: ``resume_checkpoint("ck", "ck")`` is None before the first save."""
    if load is None or starts_fresh(load, save, weights):
        return None
    return require_checkpoint(load, verify=verify)


def loads_the_weights(load: str | Path | None, weights: str | Path | None) -> bool:
    """miles' FSDP first run: ``--load`` is the ``weights`` directory (``--hf-checkpoint``),
    which holds HF weights and no checkpoint tracker."""
    if load is None or weights is None:
        return False
    where = Path(load).expanduser()
    return (where.resolve() == Path(weights).expanduser().resolve()
            and not (where / TRACKER).exists())


def starts_fresh(load: str | Path | None, save: str | Path | None,
                 weights: str | Path | None = None) -> bool:
    """slime's first run: ``--load`` is the ``--save`` directory and it is missing or empty
    (vime's own lock and owner files aside: a first run that stopped before its first
    checkpoint leaves them, and its rerun starts fresh too); or miles' FSDP first run:
    ``--load`` is the ``weights`` directory (``--hf-checkpoint``), which holds no tracker."""
    if load is None:
        return False
    where = Path(load).expanduser()
    if loads_the_weights(load, weights):
        return True
    same = save is not None and where.resolve() == Path(save).expanduser().resolve()
    return same and (not where.exists() or where.is_dir() and all(
        entry.name in BOOKKEEPING for entry in where.iterdir()))


def read_loop_state(path: Path) -> dict:
    """``path/loop_state.json`` as a dict; ``CheckpointError`` naming it when unreadable."""
    try:
        state = json.loads((path / LOOP_STATE).read_bytes().decode("utf-8"))
        if not isinstance(state, dict):
            raise ValueError(f"a JSON {type(state).__name__}, not an object")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise field_error(CheckpointError, "--load", str(path / LOOP_STATE),
                          f"is unreadable ({type(exc).__name__}: {str(exc)[:80]})",
                          "restore the checkpoint from a copy, or resume from an earlier "
                          "one") from None
    return state


def _verify(found: Path) -> None:
    state = read_loop_state(found)
    try:
        checked = verify_manifest(found)
    except ManifestError as exc:
        raise CheckpointError(f"--load: {exc}") from None
    if checked:
        return
    if state.get("manifest"):
        raise field_error(CheckpointError, "--load", str(found),
                          "has no manifest.json, though it was written with one: the "
                          "checkpoint is incomplete or was copied partly",
                          "restore the checkpoint from a copy, or resume from an earlier one")
    log.warning("%s has no manifest (written before vime checksummed checkpoints): its files "
                "are not verified", found)


def check_dataset(found: Path, prompt_data: str | None, allow_change: bool) -> None:
    """Refuse to resume on a ``--prompt-data`` file changed since the checkpoint (size, edges,
    or mtime of a large file), unless ``allow_change``: the resumed run would draw other
    prompts than the interrupted one."""
    saved = read_loop_state(found).get("dataset")
    if allow_change or prompt_data is None or not isinstance(saved, dict):
        return
    where = Path(prompt_data).expanduser()
    if not where.is_file():
        return  # a directory or a glob of files: the data loader's checks apply
    change = dataset_changed(saved, fingerprint(where))
    if change is not None:
        raise field_error(CheckpointError, "--prompt-data", prompt_data,
                          f"changed since the checkpoint {found} was written ({change}): the "
                          "resumed run would not continue the same prompt order",
                          "restore the dataset, start a new run, or pass "
                          "--allow-dataset-change to resume on the new data knowingly")


def waiting_groups(found: Path) -> int:
    """Prompt groups a checkpoint's next rollout owes: those ``--partial-rollout`` left
    unfinished (the buffer) and prompts put back but not drawn yet (``carried``). Example: a
    checkpoint of ``--over-sampling-batch-size 6 --rollout-batch-size 4`` holds 2."""
    data = read_loop_state(found).get("data")
    if not isinstance(data, dict):
        return 0
    buffer = data.get("partial_buffer")
    groups = buffer.get("groups") if isinstance(buffer, dict) else None
    carried = data.get("carried")
    return sum(len(part) for part in (groups, carried) if isinstance(part, list))


def check_waiting_groups(found: Path, fully_async: bool) -> None:
    """Refuse ``--fully-async`` on a checkpoint whose next rollout owes prompt groups
    (``waiting_groups``): the pool draws whole blocks and cannot put them back, so they
    would be lost for the epoch."""
    waiting = waiting_groups(found) if fully_async else 0
    if waiting:
        raise field_error(CheckpointError, "--fully-async", True,
                          f"cannot resume {found}: it holds {waiting} prompt groups left "
                          "unfinished by --partial-rollout, which the fully-async pool cannot "
                          "put back", "resume once without --fully-async (its next rollout "
                          "generates them again from scratch), then switch to --fully-async "
                          "from a later checkpoint")
