"""``--rm-type math``: math answers graded with the ``math-verify`` package.

The response is parsed for its final answer (``\\boxed{...}``, ``$...$``, or a plain number or
expression) and compared with the label symbolically, so ``\\boxed{\\frac{1}{2}}`` matches a
label ``0.5`` and ``x = 8`` matches ``8``. A response with no parsable answer scores 0.

A numeric label (``8`` or ``8.0`` in the dataset) is written as math text first (``8``), so
``\\boxed{8}`` matches the label ``8.0``.

Example: label ``"8"``: ``"The answer is \\boxed{8}."`` -> 1.0, ``"8"`` -> 1.0, ``"9"`` -> 0.0.
"""

from math_verify import parse, verify

from vime_shell.rollout.rewards import label_text, sample_field


def math_reward(sample) -> float:
    """1.0 when the response's final answer equals the label mathematically, else 0.0."""
    gold = parse(label_text(sample_field(sample, "label")))
    answer = parse(str(sample_field(sample, "response")))
    if not gold or not answer:  # nothing parsable: no credit, never an exception
        return 0.0
    return 1.0 if verify(gold, answer) else 0.0
