"""Agent sessions as append-only trees (``vime_pure.data.sessions``): the examples of the
module docstring, and Hypothesis properties over random sessions whose requests extend, retry,
rewrite (compaction) or restart the context."""

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_pure.data.batch import RolloutBatch
from vime_pure.data.sample import Status
from vime_pure.data.sessions import (CONTEXT, Session, Turn, add_turn, attach_point,
                                     leaf_samples, session_of, untrained_paths)
from vime_pure.denominators import group_mask_sums
from vime_pure.errors import RolloutValidationError


def _turn(prompt, output, version=0, status=Status.COMPLETED):
    return Turn(prompt=prompt, output=output, log_probs=[-0.5 - i for i in range(len(output))],
                weight_version=version, status=status)


def test_the_docstring_example():
    s = session_of([_turn([1, 2], [7, 8]), _turn([1, 2, 7, 8, 3], [9])])
    (leaf,) = leaf_samples(s, group_id=4)
    assert leaf.tokens == [1, 2, 7, 8, 3, 9] and leaf.response_length == 4
    assert leaf.loss_mask == [1, 1, 0, 1] and leaf.group_id == 4
    assert leaf.rollout_log_probs == [-0.5, -1.5, 0.0, -0.5]
    s = add_turn(s, _turn([1, 2, 5], [6], version=1))  # a rewritten history: a branch
    first, second = leaf_samples(s, group_id=4)
    assert first.tokens == [1, 2, 7, 8, 3, 9]
    assert second.tokens == [1, 2, 5, 6] and second.response_length == 1
    assert second.loss_mask == [1] and second.weight_versions == [1]


def test_a_retry_of_the_same_context_branches_and_trains_only_its_own_answer():
    s = session_of([_turn([1, 2], [7, 8]), _turn([1, 2], [7, 9])])
    first, retry = leaf_samples(s)
    assert first.loss_mask == [1, 1] and retry.tokens == [1, 2, 7, 9]
    assert retry.response_length == 2 and retry.loss_mask == [1, 1]  # [7, 9]: its own answer


def test_compaction_and_a_sub_agent_give_one_group_whose_denominator_is_every_generated_token():
    turns = [_turn([1, 2], [7, 8]), _turn([1, 2, 7, 8, 3], [9, 9]),  # the main agent
             _turn([1, 4], [5]),                                         # compacted history
             _turn([6], [6, 6])]                                         # a sub-agent
    samples = leaf_samples(session_of(turns), group_id="run-3")
    assert len(samples) == 3 and {s.group_id for s in samples} == {"run-3"}
    sums = group_mask_sums([0] * len(samples), [s.loss_mask for s in samples])
    assert sums.tolist() == [7.0] * 3  # 2 + 2 + 1 + 2 generated tokens, each counted once
    for s in samples:
        s.reward = 1.0
    batch = RolloutBatch.from_samples([[samples]])  # one prompt, one compact leaf (group)
    assert batch.group_mask_sums.tolist() == [7.0] * 3 and len(set(batch.group_ids)) == 1


def test_an_empty_answer_trains_nothing_and_is_counted():
    s = session_of([_turn([1, 2], [7]), _turn([1, 5], [])])
    assert len(leaf_samples(s)) == 1 and untrained_paths(s) == 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=[], output=[1], log_probs=[0.0]), "prompt"),
    (dict(prompt=[1], output=[1, 2], log_probs=[0.0]), "log_probs"),
    (dict(prompt=[1, -2], output=[], log_probs=[]), "prompt"),
    (dict(prompt=[1], output=[True], log_probs=[0.0]), "output"),
    (dict(prompt=[1], output=[], log_probs=[], weight_version=-1), "weight_version"),
])
def test_a_malformed_turn_is_a_typed_error_naming_the_field(kwargs, field):
    with pytest.raises(RolloutValidationError, match=field):
        Turn(**kwargs)


@st.composite
def sessions(draw):
    """Turns whose prompts take a path's prefix (all of it: an extension; part: a retry or a
    rewritten history) or nothing (a new context), then add context tokens; with the session
    built alongside and what each turn did to it."""
    tokens = st.lists(st.integers(0, 5), max_size=4)
    session, steps = Session(), []
    for index in range(draw(st.integers(1, 10))):
        base: tuple = ()
        if session.paths and draw(st.booleans()):
            path = draw(st.sampled_from(session.paths)).tokens
            base = path[:draw(st.integers(0, len(path)))]
        prompt = list(base) + draw(tokens)
        if not prompt:
            prompt = [draw(st.integers(0, 5))]
        turn = _turn(prompt, draw(tokens), version=index // 3)
        before = session
        session = add_turn(session, turn)
        steps.append((before, turn, session))
    return session, steps


def assert_session_invariants(session: Session) -> None:
    """What every session's leaves must hold (module docstring)."""
    generated = Counter()
    for path, sample in zip([p for p in session.paths
                             if any(o != CONTEXT for o in p.origin[p.owned_from:])],
                            leaf_samples(session)):
        assert sample.tokens == list(path.tokens)
        last = session.turns[path.last_turn]
        assert sample.tokens == list(last.prompt) + list(last.output)  # what it last saw
        start = len(sample.tokens) - sample.response_length
        for p, m in zip(range(start, len(sample.tokens)), sample.loss_mask):
            if m:  # mask 1 only on a generated token, the very token its turn generated
                turn = path.origin[p]
                offset = p - len(session.turns[turn].prompt)
                assert session.turns[turn].output[offset] == sample.tokens[p]
                generated[(turn, offset)] += 1
        assert sample.weight_versions == sorted(sample.weight_versions)
    every = Counter((t, j) for t, turn in enumerate(session.turns)
                    for j in range(len(turn.output)))
    assert generated == every  # each generated token trains exactly once


@given(sessions())
def test_leaves_train_every_generated_token_exactly_once(case):
    session, _ = case
    assert_session_invariants(session)


@given(sessions())
def test_a_turn_extends_the_path_its_prompt_holds_else_branches_where_the_tokens_differ(case):
    _, steps = case
    for before, turn, after in steps:
        at, matched = attach_point(before, turn.prompt)
        longest = max((_prefix(p.tokens, turn.prompt) for p in before.paths), default=0)
        assert matched == longest
        if at is not None and matched == len(before.paths[at].tokens):
            assert len(after.paths) == len(before.paths)  # extended in place
        else:
            assert len(after.paths) == len(before.paths) + 1
            assert after.paths[-1].owned_from == matched  # owns exactly what it adds


@given(sessions())
def test_the_groups_denominator_is_the_number_of_generated_tokens(case):
    session, _ = case
    samples = leaf_samples(session, group_id=0)
    total = sum(len(t.output) for t in session.turns)
    if samples:
        sums = group_mask_sums([0] * len(samples), [s.loss_mask for s in samples])
        assert set(sums.tolist()) == {float(total)}
    else:
        assert total == 0


def _prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
