"""``--rm-type math``: math answers graded with the ``math-verify`` package.

The response is parsed for its final answer (``\\boxed{...}``, ``$...$``, or a plain number or
expression) and compared with the label symbolically, so ``\\boxed{\\frac{1}{2}}`` matches a
label ``0.5`` and ``x = 8`` matches ``8``. A response with no parsable answer scores 0.

A numeric label (``8`` or ``8.0`` in the dataset) is written as math text first (``8``), so
``\\boxed{8}`` matches the label ``8.0``.

Any thread: math-verify's own timeouts use ``signal.alarm``, which works only in the main
thread (the fully-async pool scores on its threads), so :func:`parse_math` and
:func:`verify_math` turn them off and bound each call with vime's deadline
(:func:`vime_shell.rollout.plugins.run_within`) instead, ``MATH_VERIFY_TIMEOUT_S`` as
math-verify's default; a parse or comparison that runs over it counts as no answer (0), as in
math-verify, with a warning. Every built-in math reward (``math``, ``deepscaler``, the
``boxed_`` ones) grades through these two.

Example: label ``"8"``: ``"The answer is \\boxed{8}."`` -> 1.0, ``"8"`` -> 1.0, ``"9"`` -> 0.0.
"""

import logging
from typing import Any

from math_verify import parse, verify

from vime_shell.rollout.plugins import DeadlineExpired, run_within
from vime_shell.rollout.rewards import label_text, sample_field

MATH_VERIFY_TIMEOUT_S = 5.0  # math-verify's default, per parse and per comparison
log = logging.getLogger("vime.train")


class _OwnTimeouts(logging.Filter):
    """Drops math-verify's warning that its timeouts are off: vime bounds the calls itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_OwnTimeouts())


def parse_math(text: str) -> list:
    """math-verify's ``parse`` of ``text`` in any thread; ``[]`` (no answer) when it takes
    longer than ``MATH_VERIFY_TIMEOUT_S``."""
    try:
        return run_within(MATH_VERIFY_TIMEOUT_S, lambda: parse(text, parsing_timeout=None))
    except DeadlineExpired:
        log.warning("math-verify did not parse %.60r within %g s: no answer (scored 0)", text,
                    MATH_VERIFY_TIMEOUT_S)
        return []


def verify_math(gold: list, answer: list) -> bool:
    """math-verify's ``verify`` in any thread; False when it takes longer than
    ``MATH_VERIFY_TIMEOUT_S``."""
    try:
        return bool(run_within(MATH_VERIFY_TIMEOUT_S,
                               lambda: verify(gold, answer, timeout_seconds=None)))
    except DeadlineExpired:
        log.warning("math-verify did not compare %.60r with %.60r within %g s: scored 0",
                    str(answer), str(gold), MATH_VERIFY_TIMEOUT_S)
        return False


def math_reward(sample: Any) -> float:
    """1.0 when the response's final answer equals the label mathematically, else 0.0."""
    gold = parse_math(label_text(sample_field(sample, "label")))
    answer = parse_math(str(sample_field(sample, "response")))
    if not gold or not answer:  # nothing parsable: no credit, never an exception
        return 0.0
    return 1.0 if verify_math(gold, answer) else 0.0
