"""Built-in verifiable tasks, small enough to learn by RL from scratch on a 2-core CPU.

A task draws prompts (text) with their labels, and rewards a response by exact match. Answers
are at most 2 characters, and generation is capped at the answer length: from scratch, longer
answers or answers that must end with EOS are not learned (see the stack facts).

- ``reverse2``: ``"47>"`` -> ``"74"``; ``copy2``: ``"47="`` -> ``"47"``;
- ``count_a``: ``"abaab#"`` -> ``"3"`` (how many ``a``); ``addmod10``: ``"3+5="`` -> ``"8"``.

Invariants the tests assert: prompts and labels use only the embedded tokenizer's alphabet;
``len(label) == task.answer_length``; ``reward(label, label) == 1`` and any other response
gets 0; draws are a pure function of ``(seed, rollout_id)`` (resume replays the same prompts);
``next_turn`` (multi-turn) shows the next turn only the previous *response* but labels it
from the previous *label*, so a turn is answerable only when the turns before it were right.

Rewards live in :mod:`vime_shell.rollout.rewards` (``--rm-type exact`` grades these tasks).
``arithmetic_rows`` / ``write_jsonl`` make a small dataset file, so the embedded model can also
learn through the ``--prompt-data`` path (``vime demo --math``).
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from vime_pure.errors import VimeError, field_error

TaskKind = Literal["reverse", "copy", "count_a", "addmod"]


class TaskError(VimeError):
    """An unknown task name or an example the task cannot handle."""


@attrs.frozen(kw_only=True)
class TaskExample:
    """One prompt and what grades it. Example: ``TaskExample(prompt="47>", label="74")``.

    ``prompt`` is text, or chat messages ``[{"role": "user", "content": ...}]`` from a dataset;
    ``label`` the reference answer: text, a number (kept a number), or for a user reward any
    JSON value (None when the reward needs none); ``metadata`` and
    ``tools`` come from a dataset's ``--metadata-key`` / ``--tool-key``.
    """

    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    tools: Any = None


@attrs.frozen(kw_only=True)
class DigitTask:
    """A task over digit strings. ``width``: digits (reverse/copy) or letters (count_a)."""

    name: str
    kind: TaskKind
    width: int = 2

    @property
    def answer_length(self) -> int:
        """Characters (= tokens) in every label; the generation cap."""
        return self.width if self.kind in ("reverse", "copy") else 1

    @property
    def chainable(self) -> bool:
        """True when a response can be the input of the next turn (multi-turn rollouts)."""
        return self.kind in ("reverse", "copy")

    def example(self, rng: np.random.Generator) -> TaskExample:
        if self.kind == "count_a":
            text = "".join(rng.choice(["a", "b"], size=self.width))
            return TaskExample(prompt=text + "#", label=str(text.count("a")))
        if self.kind == "addmod":
            a, b = (int(x) for x in rng.integers(0, 10, size=2))
            return TaskExample(prompt=f"{a}+{b}=", label=str((a + b) % 10))
        digits = "".join(str(d) for d in rng.integers(0, 10, size=self.width))
        return TaskExample(prompt=digits + self._separator(), label=self._apply(digits))

    def next_turn(self, response: str, previous: TaskExample) -> TaskExample:
        """The next turn of a multi-turn rollout, in a context compacted to ``response``.

        The prompt is built from the model's previous answer, the label from the previous
        *label* (the right answer given a right history). Labelling from the response instead
        is exploitable: emitting nothing makes the next turn's label empty, and trivially met.
        Example: ``TASKS["reverse2"].next_turn("74", TaskExample(prompt="47>", label="74"))``
        is ``TaskExample(prompt="74>", label="47")``; after a wrong ``"11"`` the prompt is
        ``"11>"`` and the label still ``"47"``.
        """
        return TaskExample(prompt=response + self._separator(), label=self._apply(previous.label))

    def _separator(self) -> str:
        if not self.chainable:
            raise field_error(TaskError, "task", self.name, "cannot chain turns",
                              "use reverse2 or copy2 for multi-turn rollouts")
        return ">" if self.kind == "reverse" else "="

    def _apply(self, digits: str) -> str:
        return digits[::-1] if self.kind == "reverse" else digits

    def examples(self, n: int, *, seed: int, rollout_id: int) -> tuple[TaskExample, ...]:
        """``n`` examples, a pure function of ``(seed, rollout_id)``."""
        rng = np.random.default_rng([seed, rollout_id, 0x7A5C])
        return tuple(self.example(rng) for _ in range(n))


TASKS: dict[str, DigitTask] = {
    t.name: t for t in (
        DigitTask(name="reverse2", kind="reverse", width=2),
        DigitTask(name="copy2", kind="copy", width=2),
        DigitTask(name="count_a", kind="count_a", width=5),
        DigitTask(name="addmod10", kind="addmod"),
    )
}


def get_task(name: str) -> DigitTask:
    """The built-in task called ``name``. Example: ``get_task("reverse2").answer_length == 2``."""
    task = TASKS.get(name)
    if task is None:
        raise field_error(TaskError, "task", name, "is not a built-in task",
                          f"use one of {sorted(TASKS)}")
    return task


def arithmetic_rows(seed: int = 0, eval_size: int = 10) -> tuple[list[dict], list[dict]]:
    """Every single-digit sum below 10 as dataset rows, split into train and held-out eval.

    55 problems ``"a+b"`` (``a + b <= 9``, answer one digit); the prompt carries no ``=``: the
    embedded tokenizer's chat template adds it as the generation prompt. Example: a row
    ``{"prompt": "3+5", "label": "8"}``; with ``eval_size=10``, 45 train rows and 10 eval rows.
    """
    rows = [{"prompt": f"{a}+{b}", "label": str(a + b)}
            for a in range(10) for b in range(10) if a + b <= 9]
    order = np.random.default_rng([seed, 0xA817]).permutation(len(rows))
    shuffled = [rows[i] for i in order]
    return shuffled[eval_size:], shuffled[:eval_size]


def write_jsonl(path: str | Path, rows: Sequence[dict]) -> Path:
    """``rows`` as a JSON-lines prompt dataset (``--prompt-data``); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
