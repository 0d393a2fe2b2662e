"""slime's rule rewards by name: ``--rm-type deepscaler | dapo | f1 | gpqa``, and the ``boxed_``
prefix (``--rm-type boxed_f1``: grade the response's last ``\\boxed{...}`` instead of all of it).

Each reads ``sample.response`` and ``sample.label`` (views of ``metadata``) and scores like
slime's reward of the same name, on the rules written in each docstring (vime's own code):

* ``deepscaler``: the text after the last ``</think>`` (or after ``###Response``; neither: 0),
  its last ``\\boxed{}`` graded against the label by ``math-verify`` (or equal after
  normalisation): 1 or 0, in any thread (``math_reward.parse_math``). Thinking models only,
  as in slime.
* ``dapo``: the last 300 characters, the last ``Answer: X`` line, normalised; 1.0 when it equals
  the integer label, else -1.0, as ``{"score", "acc", "pred"}`` (the trained key is
  ``score`` unless ``--reward-key`` names another).
* ``f1``: SQuAD token F1 of the normalised response and label (lower case, no punctuation, no
  articles); a yes/no/noanswer mismatch scores 0.
* ``gpqa``: the chosen option letter (``Answer: C``, ``(C)``, the last lone capital) against
  the label letter, index, or option text (``metadata["choices"]``): 1.0 or 0.0.

Example: response ``"<think>...</think> so \\boxed{8}"``, label ``"8"``: deepscaler 1;
``"Answer: 8"`` with label ``"8"``: dapo ``{"score": 1.0, "acc": True, "pred": "8"}``.
"""

import re
import string
from collections import Counter
from typing import Any

from vime_shell.rollout.math_reward import parse_math, verify_math
from vime_shell.rollout.reward_plugins import last_boxed
from vime_shell.rollout.rewards import sample_field


def _same_math(answer: str, gold: str) -> bool:
    if _normal(answer) == _normal(gold):
        return True
    a, g = parse_math(f"${answer}$"), parse_math(f"${gold}$")
    return bool(a and g and verify_math(g, a))


def _normal(text: str) -> str:
    return re.sub(r"\s+|\\!|\$|\\left|\\right", "", text).rstrip(".")


def deepscaler_reward(sample: Any) -> float:
    """``--rm-type deepscaler`` (module docstring)."""
    response = str(sample_field(sample, "response"))
    label = str(sample_field(sample, "label"))
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response", 1)[1]
    else:
        return 0.0
    answer = last_boxed(solution)
    gold = last_boxed(label) if "\\boxed" in label else label
    if not answer or not gold:
        return 0.0
    return 1.0 if _same_math(answer, gold) else 0.0


_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def _dapo_normal(text: str) -> str:
    text = text.split("=")[-1]
    for pattern in (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}", r"\\boxed\{(.*)\}"):
        text = re.sub(pattern, r"\1", text)
    text = text.replace("$", "").replace("\\!", "").strip().rstrip(".")
    return text.replace(",", "") if text.replace(",", "").isdigit() else text


def dapo_reward(sample: Any) -> dict[str, Any]:
    """``--rm-type dapo`` (module docstring): ``{"score": +-1.0, "acc": bool, "pred": str}``."""
    tail = str(sample_field(sample, "response"))[-300:]
    found = _ANSWER.findall(tail)
    pred = _dapo_normal(found[-1]) if found else "[INVALID]"
    gold = _dapo_normal(str(sample_field(sample, "label")))
    try:
        gold = str(int(float(gold)))  # DAPO-Math answers are integers
    except ValueError:
        pass
    acc = pred == gold
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def _squad_tokens(text: str) -> list[str]:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1_reward(sample: Any) -> float:
    """``--rm-type f1``: token F1 of response and label (module docstring).
    ``"the Eiffel tower"`` vs ``"Eiffel Tower in Paris"``: P 1, R 0.5, F1 0.667."""
    pred = _squad_tokens(str(sample_field(sample, "response")))
    gold = _squad_tokens(str(sample_field(sample, "label")))
    special = {"yes", "no", "noanswer"}
    if (" ".join(pred) in special or " ".join(gold) in special) and pred != gold:
        return 0.0
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


_LETTER_PATTERNS = (r"(?:answer|option|choice)\s*(?:is|:)?\s*\(?([A-Z])\b",
                    r"\(([A-Z])\)\s*(?:is\s*(?:the\s*)?correct)?")


def gpqa_reward(sample: Any) -> float:
    """``--rm-type gpqa`` (module docstring): 1.0 for the right option letter, else 0.0."""
    response = str(sample_field(sample, "response")).rsplit("</think>", 1)[-1]
    label = sample_field(sample, "label")
    choices = list((sample.metadata or {}).get("choices") or [])
    letters = string.ascii_uppercase[:len(choices) or 10]
    gold = _gold_letter(label, choices, letters)
    chosen = next((m.group(1).upper() for p in _LETTER_PATTERNS
                   for m in [re.search(p, response, re.IGNORECASE)]
                   if m and m.group(1).upper() in letters), None)
    if chosen is None:
        chosen = next((c for c in reversed(re.findall(r"\b([A-Z])\b", response))
                       if c in letters), None)
    if gold is not None and chosen is not None:
        return 1.0 if chosen == gold else 0.0
    return 0.0


def _gold_letter(label: Any, choices: list, letters: str) -> str | None:
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(letters):
        return letters[label]
    text = str(label).strip()
    if len(text) == 1 and text.upper() in letters:
        return text.upper()
    words = " ".join(_squad_tokens(text))
    return next((letters[i] for i, c in enumerate(choices)
                 if " ".join(_squad_tokens(str(c))) == words), None)
