"""Rollout dumps and replay: ``--save-rollout-data`` / ``--load-rollout-data``.

A dump is one ``RolloutBatch`` per rollout, written with :mod:`vime_shell.storage.dump`
(atomic). Where one holder, trainer rank 0, holds the batch it is one batch file; where engine
leaders keep their parts, each writes its part beside the rollout's index, which rank 0
writes from the planned metadata (no sample reaches it), and readers join them in prompt
order. Replay reads them back instead of generating:

- a template with ``{rollout_id}`` (``dumps/r{rollout_id}.npz``) gives one file per rollout;
  a literal path replays the same batch every rollout;
- a missing file is a :class:`ReplayError` naming the path, unless ``fallback`` is set, in
  which case rollout 0's file is used (and its absence is still an error);
- the batch is used exactly as dumped: its samples, rewards, advantages and group ids are never
  rewritten, so the scheduler sees the same groups and builds the same schedule.

The rollout source that replays them is :mod:`vime_shell.sources.replayed` (this module stays
torch-free: the launch checks and ``--dry-run`` read dumps through it).

Example: ``ReplaySource("d/r{rollout_id}.npz", fallback=True).path(7)`` is ``d/r7.npz`` when
that exists, else ``d/r0.npz``.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from vime_pure.data.batch import RolloutBatch
from vime_pure.errors import VimeError, field_error
from vime_pure.data.shares import BatchMeta
from vime_shell.storage.dump import (load_rollout_batch, part_path, save_parts_index,
                                     save_rollout_batch, tokenizer_record)

TEMPLATE_KEY = "{rollout_id}"


class ReplayError(VimeError):
    """A rollout dump to replay is missing or unreadable."""


def dump_path(template: str, rollout_id: int) -> Path:
    """The file of ``rollout_id`` under ``template`` (a literal path is returned as is).

    Example: ``dump_path("d/r{rollout_id}.npz", 3) == Path("d/r3.npz")``.
    """
    return Path(template.replace(TEMPLATE_KEY, str(rollout_id))).expanduser()


def save_dump(template: str, rollout_id: int, batch: RolloutBatch,
              annotations: list | None = None, tokenizer: dict | None = None) -> Path:
    """Write ``batch`` to ``dump_path(template, rollout_id)``, creating parent directories;
    ``tokenizer``: ``tokenizer_record`` of the model that wrote the ids."""
    path = dump_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_rollout_batch(path, batch, annotations, tokenizer)


class DumpWriter:
    """``--save-rollout-data`` off the training's critical path: one background thread writes
    each dump while the next rollout trains (a ``RolloutBatch`` is read-only, so sharing it is
    safe). A failed write surfaces at the next ``submit`` or at ``flush``, never silently.

    Each dump records the tokenizer of ``model_dir`` (the run's model: ``vime inspect``
    decodes with it), fingerprinted once here.

    Example: ``w = DumpWriter("d/r{rollout_id}.npz"); w.submit(3, batch); w.flush()`` leaves
    ``d/r3.npz`` complete on disk.
    """

    def __init__(self, template: str, model_dir: str | Path | None = None):
        self.template = template
        self.tokenizer = None if model_dir is None else tokenizer_record(model_dir)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vime-dump")
        self._pending: list[Future] = []

    def submit(self, rollout_id: int, batch: RolloutBatch, annotations: list | None = None
               ) -> None:
        self._raise_failures(wait=False)
        self._pending.append(self._pool.submit(save_dump, self.template, rollout_id, batch,
                                               annotations, self.tokenizer))

    def submit_part(self, rollout_id: int, member: int, part: RolloutBatch,
                    annotations: list | None = None) -> None:
        """A holder's part of a dump of parts: exchange member ``member``'s file beside the
        index (``storage.dump.part_path``)."""
        self._raise_failures(wait=False)
        self._pending.append(self._pool.submit(
            save_rollout_batch, part_path(dump_path(self.template, rollout_id), member), part,
            annotations, self.tokenizer))

    def submit_index(self, rollout_id: int, meta: BatchMeta,
                     holders: list[tuple[int, list[int], list[int]]]) -> None:
        """Trainer rank 0: the index of a dump of parts, from the planned ``meta`` and the
        exchange's ``holders`` (metadata only)."""
        self._raise_failures(wait=False)
        self._pending.append(self._pool.submit(
            save_parts_index, dump_path(self.template, rollout_id), meta, holders,
            self.tokenizer))

    def write_part(self, rollout_id: int, member: int, part: RolloutBatch,
                   annotations: list | None = None) -> None:
        """:meth:`submit_part`, done when it returns (an engine rank of its own: nothing
        flushes it at a checkpoint, so it writes before it takes the next command)."""
        self.submit_part(rollout_id, member, part, annotations)
        self.flush()

    def flush(self) -> None:
        """Wait for every dump written so far (checkpoints and the run's end call it)."""
        self._raise_failures(wait=True)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)

    def _raise_failures(self, wait: bool) -> None:
        done = [f for f in self._pending if wait or f.done()]
        self._pending = [f for f in self._pending if f not in done]
        for future in done:
            future.result()  # re-raises the write's exception here, in the loop


def holder_dumps(producer: Any, exchange: Any) -> DumpWriter | None:
    """The part writer of an engine rank of its own that holds parts (``exchange`` set),
    under ``--save-rollout-data``; else None."""
    if exchange is None or producer.cfg.save_rollout_data is None:
        return None
    return DumpWriter(producer.cfg.save_rollout_data, producer.hf_dir)


@attrs.frozen(kw_only=True)
class ReplaySource:
    """Where each rollout's replayed batch comes from (see the module docstring)."""

    template: str
    fallback: bool = False

    def path(self, rollout_id: int) -> Path:
        path = dump_path(self.template, rollout_id)
        if path.is_file():
            return path
        if self.fallback and rollout_id != 0:
            first = dump_path(self.template, 0)
            if first.is_file():
                return first
            raise field_error(ReplayError, "--load-rollout-data", self.template,
                              f"has neither {path} nor the fallback {first}",
                              "dump rollout 0 with --save-rollout-data, or fix the template")
        hint = ("pass --load-rollout-data-fallback to replay rollout 0's dump instead"
                if TEMPLATE_KEY in self.template and rollout_id != 0
                else "check the path, or dump it first with --save-rollout-data")
        raise field_error(ReplayError, "--load-rollout-data", self.template,
                          f"has no file for rollout {rollout_id} ({path})", hint)

    def load(self, rollout_id: int) -> RolloutBatch:
        return load_rollout_batch(self.path(rollout_id))
