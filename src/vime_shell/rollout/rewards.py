"""Reward functions: built-in (``--rm-type exact|math``) or the user's (``--custom-rm-path``).

A *sample* reward function takes one ``Sample`` whose ``metadata`` holds ``"prompt"``,
``"response"`` (decoded text, special tokens skipped), ``"label"`` and the dataset row's
metadata, and returns a float. A *group* reward function (``--group-rm``) takes all samples of
one prompt and returns one float per sample, for rewards that compare samples (ranking,
diversity, majority vote). :class:`Rewarder` applies either, and turns anything that goes wrong
inside into a :class:`RewardFunctionError` naming the prompt and sample.

Every call of the reward goes through :func:`vime_shell.rollout.plugins.call_plugin`: an
exception or ``SystemExit`` becomes a :class:`RewardFunctionError`, and ``--reward-timeout
SECONDS`` bounds each call in any thread (a :class:`PluginTimeoutError`). A numeric label
(``43`` or ``43.0`` in the dataset) is compared as a number: ``exact`` matches a response that
is the same number (``"43"``, ``"43.0"``), ``math`` parses both sides.

A built-in reward defers to the one a sample's ``metadata["rm_type"]`` names, as slime's does:
a dataset row (through ``--metadata-key``) or an ``--eval-config`` set's ``rm_type`` picks
its own reward (``{"rm_type": "math"}`` scores that row with ``math`` under ``--rm-type
exact``); ``--custom-rm-path`` scores every sample itself.

``RM_TYPES`` is the registry of built-in rewards (``name -> "module:function"``); a module is
imported only when its reward is chosen (``math`` pulls in sympy through ``math-verify``).

Example: ``Rewarder.build(rm_type="exact").score([s1, s2])`` with responses ``"74"`` and
``"11"`` against label ``"74"`` gives ``[1.0, 0.0]``.
"""

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from vime_pure.errors import VimeError, field_error
from vime_shell.rollout.plugins import call_plugin, load_callable
from vime_shell.rollout.reward_plugins import adapt_reward

RM_TYPES: dict[str, str] = {
    "exact": "vime_shell.rollout.rewards:exact_match_reward",
    "math": "vime_shell.rollout.math_reward:math_reward",
    "deepscaler": "vime_shell.rollout.rule_rewards:deepscaler_reward",
    "dapo": "vime_shell.rollout.rule_rewards:dapo_reward",
    "f1": "vime_shell.rollout.rule_rewards:f1_reward",
    "gpqa": "vime_shell.rollout.rule_rewards:gpqa_reward",
    "remote_rm": "vime_shell.rollout.remote_reward:remote_rm",  # --rm-url; slime's name
}
RM_REWARD_KEYS: dict[str, str] = {"dapo": "score"}  # a dict reward's trained entry
# slime's prefix: boxed_<name> grades the last \boxed{} of the response with <name>.
RM_CHOICES: tuple[str, ...] = (*RM_TYPES, *(f"boxed_{n}" for n in RM_TYPES if n != "remote_rm"))

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
    concurrent: bool = False  # fn scores any list of samples at once (async per-sample rewards)
    # built-in rewards only: the reward a sample's metadata["rm_type"] names (slime's per-row
    # and per-eval-set reward), built on first use
    typed: Callable[[str], "Rewarder"] | None = None

    @classmethod
    def build(cls, *, rm_type: str | None = None, custom_rm_path: str | None = None,
              group_rm: bool = False, reward_timeout: float | None = None, args: Any = None,
              reward_key: str | None = None, rm_url: str | None = None) -> "Rewarder":
        """``--custom-rm-path`` wins over ``--rm-type`` (default ``exact``, or ``remote_rm``
        with ``--rm-url``); any signature of ``reward_plugins`` (slime's included)."""
        if custom_rm_path is not None:
            call, group = adapt_reward(load_callable(custom_rm_path, flag="--custom-rm-path"),
                                       args=args, group=group_rm, flag="--custom-rm-path",
                                       reward_key=reward_key)
            return cls(fn=call, group=group, name=custom_rm_path, timeout=reward_timeout,
                       concurrent=group and not group_rm)
        if group_rm:
            raise field_error(RewardFunctionError, "group_rm", True,
                              "needs a group reward function, and built-in rewards are per sample",
                              "pass --custom-rm-path pkg.mod:fn taking a prompt's samples")
        name = rm_type or ("remote_rm" if rm_url else "exact")
        base = name.removeprefix("boxed_")
        if name not in RM_CHOICES:
            raise field_error(RewardFunctionError, "rm_type", name, "is not a built-in reward",
                              f"use one of {sorted(RM_CHOICES)}, or --custom-rm-path")
        if base == "remote_rm" and not rm_url:
            raise field_error(RewardFunctionError, "rm_type", name, "needs --rm-url",
                              "pass --rm-url http://host:port/path")
        call, group = adapt_reward(load_callable(RM_TYPES[base], flag="--rm-type"), args=args,
                                   group=False, flag="--rm-type", boxed=base != name,
                                   reward_key=reward_key or RM_REWARD_KEYS.get(base))

        @functools.cache
        def typed(kind: str) -> "Rewarder":  # a sample's own rm_type (metadata)
            return cls.build(rm_type=kind, reward_timeout=reward_timeout, args=args,
                             reward_key=reward_key, rm_url=rm_url)

        return cls(fn=call, group=group, name=name, flag="--rm-type", timeout=reward_timeout,
                   concurrent=group, typed=typed)

    def _kind(self, sample: Any) -> str:
        """The reward that scores ``sample``: its ``metadata["rm_type"]`` (slime's rule, for
        built-in rewards), else this one's."""
        meta = getattr(sample, "metadata", None)
        kind = meta.get("rm_type") if isinstance(meta, dict) else None
        return kind if self.typed is not None and isinstance(kind, str) and kind else self.name

    def _mixed(self, samples: Sequence[Any]) -> bool:
        return self.typed is not None and any(self._kind(s) != self.name for s in samples)

    def score_groups(self, groups: Sequence[Sequence[Any]],
                     where: Callable[[int], str]) -> list[list[float]]:
        """``score`` of every prompt group, ``where(p)`` naming group ``p``; a concurrent
        reward (slime's async per-sample ``rm``, ``--rm-url``) gets every sample of every
        group in flight at once instead of one prompt at a time."""
        if not self.concurrent or len(groups) < 2 or any(self._mixed(g) for g in groups):
            return [self.score(g, where=where(p)) for p, g in enumerate(groups)]
        flat = [s for g in groups for s in g]
        span = f"{where(0)} to {where(len(groups) - 1)} (scored together)"
        values = self._call(flat, span)
        if not isinstance(values, Sequence) or len(values) != len(flat):
            raise RewardFunctionError(f"{span}: reward {self.name} returned {values!r:.80} for "
                                      f"{len(flat)} samples. Fix: make the function "
                                      f"{self.flag} names return one float per sample, in "
                                      "order.")
        out, start = [], 0
        for p, g in enumerate(groups):
            out.append([_finite(v, f"{where(p)}, sample {k}", self.name, self.flag)
                        for k, v in enumerate(values[start:start + len(g)])])
            start += len(g)
        return out

    def score(self, samples: Sequence[Any], *, where: str = "prompt") -> list[float]:
        """Rewards of one prompt's samples, in order (see the module docstring); a sample
        whose metadata names another built-in ``rm_type`` is scored by that one."""
        typed = self.typed
        if typed is not None and self._mixed(samples):
            return [typed(self._kind(s)).score([s], where=f"{where}, sample {k}")[0]
                    for k, s in enumerate(samples)]
        if self.group:
            values = self._call(list(samples), f"{where} (group reward)")
            if not isinstance(values, Sequence) or len(values) != len(samples):
                raise RewardFunctionError(
                    f"{where}: group reward {self.name} returned {values!r:.80} for "
                    f"{len(samples)} samples. Fix: make the function {self.flag} names return "
                    "one float per sample, in order.")
        else:
            values = [self._call(s, f"{where}, sample {k}") for k, s in enumerate(samples)]
        return [_finite(v, f"{where}, sample {k}", self.name, self.flag)
                for k, v in enumerate(values)]

    def _call(self, arg: Any, where: str) -> Any:
        return call_plugin(self.fn, arg, what=f"reward {self.name}", flag=self.flag,
                           where=where, error=RewardFunctionError, timeout=self.timeout)


def _finite(value: Any, where: str, name: str, flag: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardFunctionError(f"{where}: reward {name} returned {value!r:.60}, not a finite "
                                  f"number. Fix: make the function {flag} names return a float "
                                  "(e.g. 0.0 for a failure).")
    return float(value)
