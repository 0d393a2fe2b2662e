"""Reward functions: built-in (``--rm-type exact|math``) or the user's (``--custom-rm-path``).

A *sample* reward function takes one ``Sample`` whose ``metadata`` holds ``"prompt"``,
``"response"`` (decoded text, special tokens skipped), ``"label"`` and the dataset row's
metadata, and returns a float. A *group* reward function (``--group-rm``) takes all samples of
one prompt and returns one float per sample, for rewards that compare samples (ranking,
diversity, majority vote). :class:`Rewarder` applies either, and turns anything that goes wrong
inside into a :class:`RewardFunctionError` naming the prompt and sample.

Every call of the reward goes through :func:`vime_shell.rollout.plugins.call_plugin`: an
exception, ``SystemExit`` or ``KeyboardInterrupt`` becomes a :class:`RewardFunctionError`, and
``--reward-timeout SECONDS`` bounds each call (a :class:`PluginTimeoutError`). A numeric label
(``43`` or ``43.0`` in the dataset) is compared as a number: ``exact`` matches a response that
is the same number (``"43"``, ``"43.0"``), ``math`` parses both sides.

``RM_TYPES`` is the registry of built-in rewards (``name -> "module:function"``); a module is
imported only when its reward is chosen (``math`` pulls in sympy through ``math-verify``).

Example: ``Rewarder.build(rm_type="exact").score([s1, s2])`` with responses ``"74"`` and
``"11"`` against label ``"74"`` gives ``[1.0, 0.0]``.
"""

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from vime_pure.errors import VimeError, field_error
from vime_shell.rollout.plugins import call_plugin, load_callable

RM_TYPES: dict[str, str] = {
    "exact": "vime_shell.rollout.rewards:exact_match_reward",
    "math": "vime_shell.rollout.math_reward:math_reward",
}

SampleReward = Callable[[Any], float]
GroupReward = Callable[[list[Any]], Sequence[float]]


class RewardFunctionError(VimeError):
    """A reward function failed or returned something that is not one finite float per sample."""


def exact_match(response: str, label: Any) -> float:
    """1.0 when the response equals the label exactly, else 0.0. ``exact_match("74", "74") == 1``;
    a number label matches the same number: ``exact_match("43", 43.0) == 1``."""
    if is_number(label):
        try:
            return 1.0 if float(response.strip()) == float(label) else 0.0
        except ValueError:
            return 0.0
    return 1.0 if response == label else 0.0


def is_number(label: Any) -> bool:
    """A numeric label (int or float, never bool). ``is_number(43.0)``; not ``"43"``."""
    return isinstance(label, numbers.Real) and not isinstance(label, bool)


def label_text(label: Any) -> str:
    """A label as math text: integral floats without ``.0``. ``label_text(43.0) == "43"``."""
    if isinstance(label, float) and label.is_integer() and abs(label) < 2**53:
        return str(int(label))
    return str(label)


def exact_match_reward(sample: Any) -> float:
    """``--rm-type exact``: exact match of ``metadata["response"]`` against ``["label"]``."""
    return exact_match(sample_field(sample, "response"), sample_field(sample, "label"))


def sample_field(sample: Any, key: str) -> Any:
    """``sample.metadata[key]``, or a typed error saying what the reward needs."""
    meta = sample.metadata or {}
    if meta.get(key) is None:
        raise field_error(RewardFunctionError, f"sample.metadata[{key!r}]", meta.get(key),
                          "is missing, but the reward needs it",
                          "pass --label-key for dataset labels, or use a rollout function that "
                          "records prompt, response and label")
    return meta[key]


@attrs.frozen(kw_only=True)
class Rewarder:
    """One reward function and how it is called: per sample, or per prompt group."""

    fn: Callable[..., Any]
    group: bool = False
    name: str = "reward"
    flag: str = "--custom-rm-path"
    timeout: float | None = None  # --reward-timeout: seconds per call

    @classmethod
    def build(cls, *, rm_type: str | None = None, custom_rm_path: str | None = None,
              group_rm: bool = False, reward_timeout: float | None = None) -> "Rewarder":
        """``--custom-rm-path`` wins over ``--rm-type`` (default ``exact``)."""
        if custom_rm_path is not None:
            return cls(fn=load_callable(custom_rm_path, flag="--custom-rm-path"), group=group_rm,
                       name=custom_rm_path, timeout=reward_timeout)
        if group_rm:
            raise field_error(RewardFunctionError, "group_rm", True,
                              "needs a group reward function, and built-in rewards are per sample",
                              "pass --custom-rm-path pkg.mod:fn taking a prompt's samples")
        name = rm_type or "exact"
        if name not in RM_TYPES:
            raise field_error(RewardFunctionError, "rm_type", name, "is not a built-in reward",
                              f"use one of {sorted(RM_TYPES)}, or --custom-rm-path")
        return cls(fn=load_callable(RM_TYPES[name], flag="--rm-type"), name=name,
                   flag="--rm-type", timeout=reward_timeout)

    def score(self, samples: Sequence[Any], *, where: str = "prompt") -> list[float]:
        """Rewards of one prompt's samples, in order (see the module docstring)."""
        if self.group:
            values = self._call(list(samples), f"{where} (group reward)")
            if not isinstance(values, Sequence) or len(values) != len(samples):
                raise RewardFunctionError(
                    f"{where}: group reward {self.name} returned {values!r:.80} for "
                    f"{len(samples)} samples. Fix: return one float per sample, in order.")
        else:
            values = [self._call(s, f"{where}, sample {k}") for k, s in enumerate(samples)]
        return [_finite(v, f"{where}, sample {k}", self.name) for k, v in enumerate(values)]

    def _call(self, arg: Any, where: str) -> Any:
        return call_plugin(self.fn, arg, what=f"reward {self.name}", flag=self.flag,
                           where=where, error=RewardFunctionError, timeout=self.timeout)


def _finite(value: Any, where: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardFunctionError(f"{where}: reward {name} returned {value!r:.60}, not a finite "
                                  "number. Fix: return a float (e.g. 0.0 for a failure).")
    return float(value)
