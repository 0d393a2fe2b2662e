"""Top-k on-policy distillation's estimate (``vime_pure.distillation``): the invariants its
module docstring states, as properties, and its example."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_pure.distillation import (STUDENT_SCORED, WEIGHT_MODES, DistillationError, token_set,
                                    top_k_reverse_kl)

logits = st.lists(st.floats(-6, 6), min_size=2, max_size=12)


def _log_softmax(x: list[float]) -> list[float]:
    top = max(x)
    norm = top + math.log(sum(math.exp(v - top) for v in x))
    return [v - norm for v in x]


def _exact_kl(student: list[float], teacher: list[float]) -> float:
    return sum(math.exp(s) * (s - t) for s, t in zip(student, teacher))


@given(st.data(), st.integers(1, 5))
def test_the_whole_vocabulary_with_student_weights_is_the_exact_reverse_kl(data, positions):
    students, teachers, want = [], [], []
    for _ in range(positions):
        s = _log_softmax(data.draw(logits))
        t = _log_softmax(data.draw(st.lists(st.floats(-6, 6), min_size=len(s),
                                            max_size=len(s))))
        students.append(dict(enumerate(s)))
        teachers.append(dict(enumerate(t)))
        want.append(_exact_kl(s, t))
    for strategy in STUDENT_SCORED:  # the teacher's top-k is the whole vocabulary too
        got = top_k_reverse_kl(students, teachers, teachers, strategy=strategy,
                               weight_mode="student_p")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        assert (got >= -1e-5).all()


@given(logits, st.integers(1, 12), st.sampled_from(STUDENT_SCORED),
       st.sampled_from(WEIGHT_MODES))
def test_a_teacher_equal_to_the_student_gives_zero(x, k, strategy, mode):
    s = _log_softmax(x)
    top = dict(sorted(enumerate(s), key=lambda e: -e[1])[:k])
    got = top_k_reverse_kl([top], [top], [top], strategy=strategy, weight_mode=mode)
    assert got.tolist() == [0.0]


def test_the_docstring_example_and_the_token_sets():
    student = {5: math.log(0.6), 7: math.log(0.4)}
    teacher = {5: math.log(0.5), 7: math.log(0.5)}
    got = top_k_reverse_kl([student], [{}], [teacher], strategy="only-student",
                           weight_mode="student_p")
    assert got[0] == pytest.approx(0.6 * math.log(1.2) + 0.4 * math.log(0.8), abs=1e-6)
    assert round(float(got[0]), 4) == 0.0201
    # uniform weights: the plain mean of the differences
    got = top_k_reverse_kl([student], [{}], [teacher], strategy="only-student",
                           weight_mode="none")
    assert got[0] == pytest.approx(0.5 * (math.log(1.2) + math.log(0.8)), abs=1e-6)
    assert token_set("intersection", {5: 0.0, 7: 0.0, 9: 0.0}, {9: 0.0, 5: 0.0, 2: 0.0}) == [5, 9]
    assert token_set("only-student", {5: 0.0, 7: 0.0}, {}) == [5, 7]


def test_empty_sets_give_zero_and_missing_teacher_values_are_errors():
    student = [{5: -0.1, 7: -2.0}, {}]  # position 1: a tool's token, no top-k
    got = top_k_reverse_kl(student, [{9: -0.2}, {}], [{}, {}], strategy="intersection",
                           weight_mode="teacher_p")
    assert got.tolist() == [0.0, 0.0]  # disjoint, and nothing generated
    with pytest.raises(DistillationError, match=r"response token 0: the teacher gave no "
                                                r"log-prob of the token ids \[7\]"):
        top_k_reverse_kl(student, [{}, {}], [{5: -0.3}, {}], strategy="only-student",
                         weight_mode="student_p")
    with pytest.raises(DistillationError, match="only-teacher: vime computes only"):
        top_k_reverse_kl(student, [{}, {}], [{}, {}], strategy="only-teacher",
                         weight_mode="student_p")
    with pytest.raises(DistillationError, match="got 2 student, 1 teacher top-k"):
        top_k_reverse_kl(student, [{}], [{}, {}], strategy="only-student",
                         weight_mode="student_p")
