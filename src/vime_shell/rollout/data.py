"""Prompt datasets (``--prompt-data``) and where each rollout's prompts come from.

A dataset is a JSONL or Parquet file of rows; ``--input-key`` names the prompt (a string, or a
list of chat messages ``[{"role": ..., "content": ...}]``), ``--label-key`` the reference
answer, ``--metadata-key`` a dict kept with the sample, ``--tool-key`` the tool list handed to
the chat template (these two may be absent from a row). Every row is checked when the file is
read, so a bad row is a :class:`DataError` naming the file and line before any model is built:
a missing or blank prompt; chat messages without ``--apply-chat-template``; a label that is
missing, null, NaN or infinite, or (for the built-in rewards) not text or a number. Text
labels stay text, numbers stay numbers (``43.0`` is not turned into ``"43.0"``: the rewards
compare it numerically), Parquet ``bytes`` are decoded as UTF-8, and a list or dict label is
kept only for a ``--custom-rm-path`` reward, which receives it as is. Bytes that are not UTF-8
name the line. At launch every prompt is also rendered and tokenized (:func:`fit_prompts`): a
prompt that gives no tokens, or that leaves no room for the response in the model's context,
is an error; under ``--rollout-max-prompt-len`` longer prompts are dropped and counted.

:class:`PromptSource` hands out prompts in order: dataset rows (``--rollout-shuffle``: a seeded
permutation per epoch), or a built-in task's generator. Its only state is ``offset``, the
number of prompts drawn so far, so a resumed run that restores it continues the same order,
whatever dynamic sampling consumed (a task generator also counts its draws: its ``k``-th draw
is a pure function of ``(seed, k)``, so a run with one draw per rollout sees the prompts of
``task.examples(n, seed=, rollout_id=k)``). ``carried`` holds prompts drawn before but never
trained, put back to come first (a ``--partial-rollout`` checkpoint's unfinished groups,
resumed without ``--partial-rollout``): ``take(n)`` hands them out before any new prompt and
draws only the rest, as the partial rollout itself would have.

Example: ``PromptSource.from_dataset(rows, shuffle=True, seed=0)`` over 5 rows draws
``take(3)`` then ``take(3)``: rows 3 of epoch 0's permutation, then its last 2 and the first of
epoch 1's (another permutation); ``offset == 6``.
"""

import json
import math
from collections.abc import Callable, Sequence
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
    # What the run can use (TrainConfig: --apply-chat-template, and whether the reward is the
    # user's --custom-rm-path, which may take list or dict labels).
    apply_chat_template: bool = True
    any_label: bool = True
    flag_prefix: str = "--"  # how errors spell the key flags: "--eval-" for eval sets
    rm_type: str | None = None  # the reward of every row (an --eval-config set's rm_type)


def load_prompt_rows(path: str | Path, keys: DataKeys) -> tuple[TaskExample, ...]:
    """Every row of a ``.jsonl`` / ``.parquet`` file as a ``TaskExample``, validated.

    Example: a line ``{"prompt": "3+5=", "label": "8"}`` gives
    ``TaskExample(prompt="3+5=", label="8")``; ``"label": 8`` gives ``label=8``.
    """
    return read_prompt_file(path, keys)[0]


def read_prompt_file(path: str | Path, keys: DataKeys
                     ) -> tuple[tuple[TaskExample, ...], tuple[str, ...]]:
    """``load_prompt_rows`` and each row's ``"file:line"`` (for errors found later)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise field_error(DataError, f"{keys.flag_prefix}prompt-data", str(p), "is not a file",
                          "pass a .jsonl or .parquet file of prompts")
    rows = _read_parquet(p) if p.suffix == ".parquet" else _read_jsonl(p)
    if not rows:
        raise field_error(DataError, "--prompt-data", str(p), "holds no rows",
                          "pass a file with at least one prompt")
    wheres = tuple(f"{p}:{line}" for line, _ in rows)
    return tuple(_example(row, keys, where) for (_, row), where in zip(rows, wheres)), wheres


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    rows = []
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{n}: byte {exc.start + 1} of the line is not UTF-8 "
                                f"({raw[exc.start:exc.start + 4]!r}). Fix: write the file as "
                                "UTF-8.") from None
            if not line.strip():
                continue
            try:
                rows.append((n, json.loads(line)))
            except (json.JSONDecodeError, RecursionError) as exc:
                msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
                raise DataError(f"{path}:{n}: not valid JSON ({msg}). Fix: write one JSON "
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
    prompt = _text(_field(row, keys.input_key, where, f"{keys.flag_prefix}input-key"),
                   keys.input_key, where)
    if isinstance(prompt, str) and prompt and not prompt.strip():
        raise DataError(f"{where}: {keys.input_key}={prompt!r:.60} is blank (only whitespace). "
                        "Fix: correct the row or drop it.")
    if not (isinstance(prompt, str) and prompt) and not _is_messages(prompt):
        raise DataError(f"{where}: {keys.input_key}={prompt!r:.60} is neither a non-empty string "
                        "nor a list of chat messages {'role', 'content'}. Fix: correct the row "
                        f"or point {keys.flag_prefix}input-key at the prompt field.")
    if isinstance(prompt, list) and not keys.apply_chat_template:
        raise DataError(f"{where}: {keys.input_key} is a list of {len(prompt)} chat messages, "
                        "which need a chat template to become tokens. Fix: pass "
                        "--apply-chat-template, or store prompts as text.")
    label = (None if keys.label_key is None
             else _label(_field(row, keys.label_key, where, f"{keys.flag_prefix}label-key"),
                         keys.label_key, keys.any_label, where))
    # Metadata and tools may be absent from a row (no extra facts about that prompt).
    metadata = {} if keys.metadata_key is None else row.get(keys.metadata_key) or {}
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: {keys.metadata_key} is a {type(metadata).__name__}, not a "
                        "dict. Fix: store metadata as a JSON object.")
    tools = None if keys.tool_key is None else row.get(keys.tool_key)
    if keys.rm_type is not None:
        metadata = {**metadata, "rm_type": keys.rm_type}
    return TaskExample(prompt=prompt, label=label, metadata=metadata, tools=tools)


def _text(value: Any, key: str, where: str) -> Any:
    """Parquet ``binary`` columns arrive as ``bytes``: UTF-8 text, or a typed error."""
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{where}: {key}={value!r:.40} is bytes that are not UTF-8 text. Fix: "
                        "store the column as UTF-8 strings.") from None


def _label(value: Any, key: str, any_label: bool, where: str) -> Any:
    """The label as the reward gets it: text, a finite number, or (with ``any_label``: custom
    rewards) any JSON value; never null or NaN, never stringified."""
    value = _text(value, key, where)
    if value is None:
        raise DataError(f"{where}: {key} is null. Fix: give every row a label, or pass "
                        "--label-key none if the reward needs no label.")
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{where}: {key}={value} is not a finite number. Fix: correct the "
                        "row's label.")
    scalar = isinstance(value, (str, int, float)) and not isinstance(value, bool)
    if not scalar and not any_label:
        raise DataError(f"{where}: {key}={value!r:.60} is a {type(value).__name__}, but the "
                        "built-in rewards (--rm-type) compare text or a number. Fix: store one "
                        "answer per row, or pass --custom-rm-path with a reward that takes "
                        f"{type(value).__name__} labels.")
    return value


def _field(row: dict, key: str, where: str, flag: str) -> Any:
    if key not in row:
        raise DataError(f"{where}: no {key!r} field (fields: {sorted(row)}). Fix: pass "
                        f"{flag} with one of those names, or add the field.")
    return row[key]


def _is_messages(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def fit_prompts(rows: Sequence[TaskExample], wheres: Sequence[str], *,
                encode: Callable[[TaskExample], list[int]], context_len: int | None,
                response_len: int, max_prompt_len: int | None,
                response_flag: str = "--rollout-max-response-len", evaluation: bool = False
                ) -> tuple[tuple[TaskExample, ...], int]:
    """Rows whose tokenized prompt fits, and how many ``max_prompt_len`` dropped.

    ``encode`` renders and tokenizes one row (the rollout's own ``encode_prompt``). A prompt
    that gives no token is an error (its text has no character the tokenizer knows, or the chat
    template renders it to nothing); so is one that leaves fewer than ``response_len`` positions
    of the model's ``context_len`` (``max_position_embeddings``). With ``max_prompt_len``
    (``--rollout-max-prompt-len``) prompts longer than it are dropped instead, as slime does.
    ``evaluation``: an eval set (``--eval-prompt-data``), whose prompts are never dropped.
    Example: context 64, response 8: a 57-token prompt is an error; with
    ``max_prompt_len=40`` it is dropped and counted.
    """
    kept: list[TaskExample] = []
    for row, where in zip(rows, wheres):
        try:
            n = len(encode(row))
        except VimeError as exc:  # e.g. a chat template that fails or runs away
            raise DataError(f"{where}: {exc}") from None
        if n == 0:
            raise DataError(f"{where}: the prompt {_show(row.prompt)} gives no tokens: "
                            + ("the chat template renders these messages to nothing"
                               if isinstance(row.prompt, list) else "none of its characters "
                               "is in the tokenizer's vocabulary")
                            + ". Fix: correct the row, or use the model's own tokenizer.")
        if max_prompt_len is not None and n > max_prompt_len:
            continue
        if context_len is not None and n + response_len > context_len:
            # a response limit at or past the context leaves no prompt length to drop to
            drop = ("" if evaluation or response_len >= context_len else ", or drop long "
                    f"prompts with --rollout-max-prompt-len {context_len - response_len}")
            lower = (f" to at most {context_len - n}" if response_len >= context_len else "")
            raise DataError(
                f"{where}: the prompt has {n} tokens, and with {response_flag} {response_len} "
                f"it exceeds the model's context of {context_len} tokens "
                f"(config.json \"max_position_embeddings\"). Fix: shorten the prompt, lower "
                f"{response_flag}{lower}{drop}.")
        kept.append(row)
    return tuple(kept), len(rows) - len(kept)


def _show(prompt: Any) -> str:
    return f"<{len(prompt)} chat messages>" if isinstance(prompt, list) else f"{prompt!r:.60}"


@attrs.define
class PromptSource:
    """Prompts in order: dataset rows (optionally shuffled per epoch) or a task's generator."""

    rows: tuple[TaskExample, ...] | None
    task: DigitTask | None
    shuffle: bool
    seed: int
    offset: int = 0
    draws: int = 0
    carried: tuple[TaskExample, ...] = ()  # put back, handed out first (module docstring)

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
        """The next ``n`` prompts: the carried ones first, then new ones; the source advances
        by the new prompts and one draw. Example: 2 carried, ``take(5)`` gives them and 3
        new prompts (``offset`` + 3)."""
        old, self.carried = self.carried[:n], self.carried[n:]
        n -= len(old)
        start, self.offset = self.offset, self.offset + n
        draw, self.draws = self.draws, self.draws + 1
        if self.rows is None:
            return old + tuple(self._task().examples(n, seed=self.seed, rollout_id=draw))
        size = len(self.rows)
        return old + tuple(self.rows[self._order(i // size, size)[i % size]]
                           for i in range(start, start + n))

    def fixed_prompt(self, draw: int) -> TaskExample:
        """The same prompt every time, the source not advanced: the dataset's first row, or
        the task's first example of ``draw`` (seeded by the source's seed)."""
        if self.rows is not None:
            return self.rows[0]
        return self._task().examples(1, seed=self.seed, rollout_id=draw)[0]

    def _task(self) -> DigitTask:
        """The task of a source without rows (``from_task``; ``from_dataset`` sets rows)."""
        if self.task is None:
            raise field_error(DataError, "--prompt-data", None,
                              "and no built-in task: this prompt source has nothing to draw",
                              "build it with PromptSource.from_dataset or from_task")
        return self.task

    def _order(self, epoch: int, size: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(size)
        return np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(size)
