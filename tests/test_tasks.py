"""Built-in tasks (no torch needed).

Asserts :mod:`vime_shell.rollout.tasks`' invariants: prompts and labels stay inside the embedded
tokenizer's alphabet; labels have ``answer_length`` characters and are correct for their
prompts; draws are a pure function of ``(seed, rollout_id)``; the next turn is labelled from
the previous label. Rewards are tested in ``test_rewards.py``.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_shell.models.embedded import BUNDLED_TEXT
from vime_shell.rollout.tasks import TASKS, TaskError, TaskExample, get_task

ALPHABET = set(BUNDLED_TEXT)


def solve(name: str, prompt: str) -> str:
    """Independent reference solutions, written from the task descriptions."""
    body = prompt[:-1]
    if name == "reverse2":
        return body[::-1]
    if name == "copy2":
        return body
    if name == "count_a":
        return str(sum(ch == "a" for ch in body))
    a, b = body.split("+")
    return str((int(a) + int(b)) % 10)


def assert_example_invariants(name: str, ex: TaskExample) -> None:
    task = TASKS[name]
    assert set(ex.prompt) <= ALPHABET and set(ex.label) <= ALPHABET
    assert len(ex.label) == task.answer_length
    assert ex.label == solve(name, ex.prompt)


@given(name=st.sampled_from(sorted(TASKS)), seed=st.integers(0, 2**31),
       rollout_id=st.integers(0, 10_000), n=st.integers(1, 20))
def test_examples_are_correct_and_deterministic(name, seed, rollout_id, n):
    task = get_task(name)
    batch = task.examples(n, seed=seed, rollout_id=rollout_id)
    assert len(batch) == n
    assert batch == task.examples(n, seed=seed, rollout_id=rollout_id)
    for ex in batch:
        assert_example_invariants(name, ex)


def test_different_rollouts_draw_different_prompts():
    task = get_task("reverse2")
    assert task.examples(16, seed=0, rollout_id=0) != task.examples(16, seed=0, rollout_id=1)
    assert task.examples(16, seed=0, rollout_id=0) != task.examples(16, seed=1, rollout_id=0)


def test_next_turn_shows_the_response_and_labels_from_the_truth():
    first = TaskExample(prompt="47>", label="74")
    assert get_task("reverse2").next_turn("74", first) == TaskExample(prompt="74>", label="47")
    # A wrong or empty answer does not move the label: no reward for a degenerate history.
    assert get_task("reverse2").next_turn("", first) == TaskExample(prompt=">", label="47")
    assert get_task("copy2").next_turn("11", TaskExample(prompt="47=", label="47")) == \
        TaskExample(prompt="11=", label="47")
    with pytest.raises(TaskError, match="addmod10"):
        get_task("addmod10").next_turn("7", TaskExample(prompt="3+4=", label="7"))


def test_unknown_task_is_a_typed_error():
    with pytest.raises(TaskError, match="reverse3"):
        get_task("reverse3")
