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

Rewards: a reward function takes a ``Sample`` whose ``metadata`` holds ``"prompt"``,
``"response"`` (decoded text, special tokens skipped) and ``"label"``, and returns a float.
``--custom-rm-path pkg.mod:fn`` replaces :func:`exact_match_reward`.
"""

from collections.abc import Callable
from typing import Any, Literal

import attrs
import numpy as np

from vime_pure.errors import VimeError, field_error
from vime_shell.rollout.plugins import load_callable

TaskKind = Literal["reverse", "copy", "count_a", "addmod"]
RewardFn = Callable[[Any], float]


class TaskError(VimeError):
    """An unknown task name or an example the task cannot handle."""


@attrs.frozen(kw_only=True)
class TaskExample:
    """One prompt and its correct answer. Example: ``TaskExample(prompt="47>", label="74")``."""

    prompt: str
    label: str


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


def exact_match(response: str, label: str) -> float:
    """1.0 when the response equals the label exactly, else 0.0. ``exact_match("74", "74") == 1``."""
    return 1.0 if response == label else 0.0


def exact_match_reward(sample: Any) -> float:
    """The built-in reward: exact match of ``metadata["response"]`` against ``["label"]``."""
    meta = sample.metadata or {}
    if "label" not in meta or "response" not in meta:
        raise field_error(TaskError, "sample.metadata", sorted(meta),
                          'lacks "label" or "response"',
                          "use a built-in rollout function, or a custom reward (--custom-rm-path)")
    return exact_match(meta["response"], meta["label"])


def load_reward_fn(path: str | None) -> RewardFn:
    """``--custom-rm-path``: the user's ``fn(sample) -> float``, or the built-in exact match."""
    return exact_match_reward if path is None else load_callable(path, flag="--custom-rm-path")
