"""Prompt datasets (``--prompt-data``) and where each rollout's prompts come from.

A dataset is a JSONL or Parquet file of rows; ``--input-key`` names the prompt (a string, or a
list of chat messages ``[{"role": ..., "content": ...}]``), ``--label-key`` the reference
answer, ``--metadata-key`` a dict kept with the sample, ``--tool-key`` the tool list handed to
the chat template (these two may be absent from a row). Every row is checked when the file is
read, so a missing prompt or label is a :class:`DataError` naming the file and line before any
model is built.

:class:`PromptSource` hands out prompts in order: dataset rows (``--rollout-shuffle``: a seeded
permutation per epoch), or a built-in task's generator. Its only state is ``offset``, the
number of prompts drawn so far, so a resumed run that restores it continues the same order,
whatever dynamic sampling consumed (a task generator also counts its draws: its ``k``-th draw
is a pure function of ``(seed, k)``, so a run with one draw per rollout sees the prompts of
``task.examples(n, seed=, rollout_id=k)``).

Example: ``PromptSource.from_dataset(rows, shuffle=True, seed=0)`` over 5 rows draws
``take(3)`` then ``take(3)``: rows 3 of epoch 0's permutation, then its last 2 and the first of
epoch 1's (another permutation); ``offset == 6``.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from vime_pure.errors import VimeError, field_error
from vime_shell.rollout.tasks import DigitTask, TaskExample


class DataError(VimeError):
    """A prompt dataset that cannot be read or lacks a configured key (names file and line)."""


@attrs.frozen(kw_only=True)
class DataKeys:
    """Which row fields are the prompt, label, metadata and tools (slime's ``--*-key``)."""

    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = None
    tool_key: str | None = None
    flag_prefix: str = "--"  # how errors spell the key flags: "--eval-" for eval sets


def load_prompt_rows(path: str | Path, keys: DataKeys) -> tuple[TaskExample, ...]:
    """Every row of a ``.jsonl`` / ``.parquet`` file as a ``TaskExample``, validated.

    Example: a line ``{"prompt": "3+5=", "label": "8"}`` gives
    ``TaskExample(prompt="3+5=", label="8")``.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise field_error(DataError, "prompt_data", str(p), "is not a file",
                          "pass a .jsonl or .parquet file of prompts")
    rows = _read_parquet(p) if p.suffix == ".parquet" else _read_jsonl(p)
    if not rows:
        raise field_error(DataError, "prompt_data", str(p), "holds no rows",
                          "pass a file with at least one prompt")
    return tuple(_example(row, keys, f"{p}:{line}") for line, row in rows)


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{n}: not valid JSON ({exc.msg}). Fix: write one JSON "
                                "object per line.") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq  # only for .parquet files

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot be read as Parquet ({exc}). Fix: pass a valid "
                        ".parquet or a .jsonl file.") from None
    return list(enumerate(table.to_pylist(), 1))


def _example(row: Any, keys: DataKeys, where: str) -> TaskExample:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row is a {type(row).__name__}. Fix: write one JSON "
                        "object per row.")
    prompt = _field(row, keys.input_key, where, f"{keys.flag_prefix}input-key")
    if not (isinstance(prompt, str) and prompt) and not _is_messages(prompt):
        raise DataError(f"{where}: {keys.input_key}={prompt!r:.60} is neither a non-empty string "
                        "nor a list of chat messages {'role', 'content'}. Fix: correct the row "
                        f"or point {keys.flag_prefix}input-key at the prompt field.")
    label = None if keys.label_key is None else _field(row, keys.label_key, where,
                                                          f"{keys.flag_prefix}label-key")
    # Metadata and tools may be absent from a row (no extra facts about that prompt).
    metadata = {} if keys.metadata_key is None else row.get(keys.metadata_key) or {}
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: {keys.metadata_key} is a {type(metadata).__name__}, not a "
                        "dict. Fix: store metadata as a JSON object.")
    tools = None if keys.tool_key is None else row.get(keys.tool_key)
    return TaskExample(prompt=prompt, label=None if label is None else str(label),
                       metadata=metadata, tools=tools)


def _field(row: dict, key: str, where: str, flag: str) -> Any:
    if key not in row:
        raise DataError(f"{where}: no {key!r} field (fields: {sorted(row)}). Fix: pass "
                        f"{flag} with one of those names, or add the field.")
    return row[key]


def _is_messages(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


@attrs.define
class PromptSource:
    """Prompts in order: dataset rows (optionally shuffled per epoch) or a task's generator."""

    rows: tuple[TaskExample, ...] | None
    task: DigitTask | None
    shuffle: bool
    seed: int
    offset: int = 0
    draws: int = 0

    @classmethod
    def from_dataset(cls, rows: Sequence[TaskExample], *, shuffle: bool,
                     seed: int) -> "PromptSource":
        return cls(rows=tuple(rows), task=None, shuffle=shuffle, seed=seed)

    @classmethod
    def from_task(cls, task: DigitTask, *, seed: int) -> "PromptSource":
        return cls(rows=None, task=task, shuffle=False, seed=seed)

    @property
    def epoch(self) -> int:
        """Epochs completed over the dataset (0 for a task generator)."""
        return 0 if self.rows is None else self.offset // len(self.rows)

    def take(self, n: int) -> tuple[TaskExample, ...]:
        """The next ``n`` prompts; the source advances by ``n`` prompts and one draw."""
        start, self.offset = self.offset, self.offset + n
        draw, self.draws = self.draws, self.draws + 1
        if self.rows is None:
            return self.task.examples(n, seed=self.seed, rollout_id=draw)
        size = len(self.rows)
        return tuple(self.rows[self._order(i // size)[i % size]] for i in range(start, start + n))

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(len(self.rows))
