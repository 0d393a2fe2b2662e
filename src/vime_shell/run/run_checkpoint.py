"""Run checkpoints for ``--save DIR`` / ``--load DIR``: trainer state plus the rollout counter.

The trainer part (Megatron ``torch_dist`` model and optimizer, LR scheduler, RNGs; loadable
into another parallel layout) is :mod:`vime_shell.megatron.checkpoint`; this module adds the
loop state and makes the whole atomic.

Layout under ``DIR`` (Megatron's tracker file name, so tools that read it keep working)::

    DIR/latest_checkpointed_iteration.txt   "6": rollouts completed at the newest checkpoint
    DIR/rollout_000006/__0_0.distcp ...      torch_dist shards + .metadata + common.pt +
                                             metadata.json: model and optimizer (all ranks)
    DIR/rollout_000006/trainer_state.json    step counter, LR scheduler, layout, RNG states
    DIR/rollout_000006/loop_state.json       rollout counter, python / numpy RNG, the config,
                                             the run id, the --prompt-data fingerprint, the
                                             data state (prompt source position, prompts put
                                             back, --partial-rollout buffer, fully-async
                                             resume point and pool counts)
                                             (JSON: loading a checkpoint never unpickles)
    DIR/rollout_000006/manifest.json         size and BLAKE2b of every file above, written
                                             last; verified by --load at launch

Atomicity: everything is written into ``DIR/.tmp-rollout_000006`` first, renamed into place by
rank 0, and only then does the tracker move (temp file + ``os.replace``). A run killed at any
moment leaves the tracker pointing at a complete checkpoint (or absent); a leftover ``.tmp-*``
directory is ignored and overwritten.

Why resume reproduces the data: sampling seeds are pure functions of ``(seed, rollout_id)``
and the prompt order of ``(seed, epoch)``; the loop state saves the rollout counter and the
prompt source's position (how many prompts dynamic sampling consumed), and after loading the
trainer's weights are synced to the engine before the first rollout. So a resumed run
continues at exactly the next rollout and the next prompt: nothing is generated twice or
skipped. Settings that decide the data (``DATA_FIELDS``) must match the checkpoint's; the parallel sizes
need not (the trainer state reshards, see :mod:`vime_shell.megatron.checkpoint`).

Example: ``--save ck --save-interval 2 --num-rollout 5`` writes ``ck/rollout_000002`` and
``ck/rollout_000004`` (and ``ck/rollout_000005`` at the end); ``--load ck`` then starts at
rollout 5.
"""

import json
import random
import shutil
from pathlib import Path

import attrs
import numpy as np
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from vime_pure.errors import field_error
# The checkpoint index is torch-free (launch_checks reads it); its names are re-exported here.
from vime_shell.megatron.collectives import rank0_result
from vime_shell.run.checkpoint_index import (LOOP_STATE, TRACKER, CheckpointError,  # noqa: F401
                                             checkpoint_dir, latest)
from vime_shell.storage.files import fsync_path, write_atomic
from vime_shell.storage.manifest import fingerprint, write_manifest

DATA_FIELDS = ("seed", "rollout_seed", "task", "prompt_data", "input_key", "rollout_shuffle",
               "rollout_batch_size", "n_samples_per_prompt", "rollout_function_path",
               "load_rollout_data")


@attrs.frozen(kw_only=True)
class LoopState:
    """What a checkpoint restores besides the trainer: ``rollouts_done`` is the next rollout id."""

    rollouts_done: int
    config: dict
    data: dict | None = None  # the prompt source's position (offset, draws) and more (above)


def save(root: str | Path, rollouts_done: int, trainer, config: dict,
         data: dict | None = None, *, run_id: str | None = None) -> Path:
    """Collective: every rank's trainer state, then rank 0's loop state, manifest, rename and
    tracker. A file-system failure on any rank (full disk, permissions) is a
    ``CheckpointError`` on every rank naming ``--save``; the previous checkpoint stays."""
    root = Path(root)
    final = checkpoint_dir(root, rollouts_done)
    tmp = root / f".tmp-{final.name}"

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        _remove(tmp)

    def finish() -> None:
        state = _loop_state(rollouts_done, config, data)
        state.update(run_id=run_id, manifest=True, dataset=_dataset(config.get("prompt_data")))
        write_atomic(tmp / LOOP_STATE, json.dumps(state))
        write_manifest(tmp)  # last: a complete manifest means complete files
        _remove(final)
        tmp.rename(final)
        fsync_path(root)
        write_atomic(root / TRACKER, f"{rollouts_done}\n")

    try:
        rank0_result(f"preparing checkpoint {final}", prepare)
        trainer.save_checkpoint(tmp)  # every rank's shards, fsynced; ends with a barrier
        rank0_result(f"finishing checkpoint {final}", finish)
    except (OSError, CheckpointException) as exc:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise field_error(CheckpointError, "--save", str(root),
                          f"cannot hold checkpoint {final.name} ({type(exc).__name__}: "
                          f"{detail})", "free space or fix permissions there (or pass another "
                          "--save); the previous checkpoint is intact") from exc
    return final


def _dataset(prompt_data: str | None) -> dict | None:
    """The fingerprint of a ``--prompt-data`` file (None for none, a directory or a glob)."""
    if prompt_data is None or not Path(prompt_data).expanduser().is_file():
        return None
    return fingerprint(Path(prompt_data).expanduser())


def _loop_state(rollouts_done: int, config: dict, data: dict | None = None) -> dict:
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=True)
    if isinstance(numpy_state, dict):  # the legacy tuple exists for MT19937 only
        raise field_error(CheckpointError, "numpy.random", numpy_state.get("bit_generator"),
                          "is not MT19937, whose state a checkpoint saves",
                          "leave numpy's global generator as it is (np.random.seed reseeds "
                          "it; np.random.set_bit_generator replaces it)")
    kind, keys, pos, has_gauss, cached = numpy_state
    return {"rollouts_done": rollouts_done, "config": config, "data": data,
            "python_random": [version, list(internal), gauss],
            "numpy_random": [kind, keys.tolist(), pos, has_gauss, cached]}


def load(path: Path, trainer, config: dict) -> LoopState:
    """Collective: restore the trainer and the RNGs; check the data settings match."""
    try:
        state = json.loads((path / LOOP_STATE).read_text())
        rollouts_done, saved = int(state["rollouts_done"]), dict(state["config"])
        version, internal, gauss = state["python_random"]
        kind, keys, pos, has_gauss, cached = state["numpy_random"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise field_error(CheckpointError, "--load", str(path),
                          f"has an unreadable {LOOP_STATE} ({type(exc).__name__}: {exc})",
                          "restore the checkpoint from a copy, or start a new --save "
                          "directory") from None
    for name in DATA_FIELDS:
        then, now = saved.get(name), config.get(name)
        if then != now:
            raise field_error(CheckpointError, name, now,
                              f"differs from the checkpoint's {then!r} ({path}): the resumed "
                              "run would not continue the same data",
                              f"resume with {name}={then!r}, or start a new --save directory")
    trainer.load_checkpoint(path)
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    return LoopState(rollouts_done=rollouts_done, config=saved, data=state.get("data"))


def _remove(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
