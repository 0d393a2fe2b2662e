"""Built-in tasks and the reward-function loader (no torch needed).

Asserts :mod:`vime_shell.rollout.tasks`' invariants: prompts and labels stay inside the embedded
tokenizer's alphabet; labels have ``answer_length`` characters and are correct for their
prompts; exact-match reward is 1 only for the label; draws are a pure function of
``(seed, rollout_id)``; the next turn is labelled from the previous label; ``--custom-rm-path`` loads by path.
"""

import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_shell.models.embedded import BUNDLED_TEXT
from vime_shell.rollout.plugins import PluginError
from vime_shell.rollout.tasks import (
    TASKS, TaskError, TaskExample, exact_match, exact_match_reward, get_task, load_reward_fn,
)

ALPHABET = set(BUNDLED_TEXT)


class _S:  # the one attribute exact_match_reward reads
    def __init__(self, **metadata):
        self.metadata = metadata


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


@given(label=st.text("0123456789", min_size=1, max_size=2), response=st.text(max_size=3))
def test_exact_match_rewards_only_the_label(label, response):
    assert exact_match(label, label) == 1.0
    assert exact_match(response, label) == float(response == label)
    assert exact_match_reward(_S(response=response, label=label)) == float(response == label)


def test_next_turn_shows_the_response_and_labels_from_the_truth():
    first = TaskExample(prompt="47>", label="74")
    assert get_task("reverse2").next_turn("74", first) == TaskExample(prompt="74>", label="47")
    # A wrong or empty answer does not move the label: no reward for a degenerate history.
    assert get_task("reverse2").next_turn("", first) == TaskExample(prompt=">", label="47")
    assert get_task("copy2").next_turn("11", TaskExample(prompt="47=", label="47")) == \
        TaskExample(prompt="11=", label="47")
    with pytest.raises(TaskError, match="addmod10"):
        get_task("addmod10").next_turn("7", TaskExample(prompt="3+4=", label="7"))


def test_unknown_task_and_incomplete_metadata_are_typed_errors():
    with pytest.raises(TaskError, match="reverse3"):
        get_task("reverse3")
    with pytest.raises(TaskError, match="label"):
        exact_match_reward(_S(response="12"))


def test_custom_reward_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rm.py").write_text(textwrap.dedent("""
        def length_reward(sample):
            return float(len(sample.metadata["response"]))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_reward_fn(None) is exact_match_reward
        fn = load_reward_fn("my_rm:length_reward")
        assert fn(_S(response="123")) == 3.0
        assert load_reward_fn("my_rm.length_reward") is fn
        with pytest.raises(PluginError, match="--custom-rm-path"):
            load_reward_fn("my_rm:nope")
    finally:
        sys.modules.pop("my_rm", None)
