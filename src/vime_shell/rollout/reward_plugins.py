"""Reward functions with slime's signatures, told apart by their signature, and dict rewards.

``--custom-rm-path`` (and the built-ins) may be written either way; :func:`adapt_reward` turns
each into what :class:`~vime_shell.rollout.rewards.Rewarder` calls:

=====================================  ===================================================
signature                              how it is called
=====================================  ===================================================
``def rm(sample)``                     vime's: once per sample (``--group-rm``: samples)
``def rm(args, sample)``               slime's: ``args`` is the run's ``TrainConfig`` (slime's
                                       flag names as attributes: ``args.rm_url``, ...)
``async def rm(args, sample)``         slime's async: every sample of the rollout concurrently
                                       (``Rewarder.score_groups``)
``[async] def rm(args, samples)``      slime's batched form, with ``--group-rm``
=====================================  ===================================================

A reward may return a dict (slime's ``dapo`` returns ``{"score", "acc", "pred"}``): the trained
value is ``reward[--reward-key]`` (default: the built-in's own key, ``score`` for ``dapo``), and
the whole dict is kept in ``sample.metadata["reward_dict"]`` (never dropped).

``boxed_<name>`` (slime's prefix) grades the response's last ``\\boxed{}`` with ``<name>``.

Example: ``adapt_reward(lambda args, s: 1.0, args=cfg, group=False)`` calls ``fn(cfg, sample)``.
"""

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import attrs

from vime_pure.errors import VimeError, field_error
from vime_shell.rollout.plugins import PluginError


class RewardKeyError(VimeError):
    """A dict reward without the key that names the trained reward."""


def positional_arity(fn: Callable[..., Any]) -> int:
    """Positional parameters ``fn`` takes without defaults (``*args`` counts as 1)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it vime's way
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return 1
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def run_coroutine(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to completion from synchronous code, also under a running event loop
    (then in a worker thread with its own loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _gather(fn: Callable[[Any], Coroutine[Any, Any, Any]], samples: list[Any]) -> list:
    return list(await asyncio.gather(*(fn(s) for s in samples)))


def adapt_reward(fn: Callable[..., Any], *, args: Any, group: bool, flag: str,
                 reward_key: str | None = None, boxed: bool = False
                 ) -> tuple[Callable[[Any], Any], bool]:
    """``(call, group)``: ``call(sample)`` (or ``call(samples)`` when ``group``) returning
    floats, from any signature in the module table."""
    arity = positional_arity(fn)
    if arity not in (1, 2):
        raise field_error(PluginError, flag, getattr(fn, "__name__", repr(fn)),
                          f"takes {arity} positional arguments",
                          "define rm(sample), rm(args, sample) or, with --group-rm, "
                          "rm(args, samples)")
    base = fn if arity == 1 else (lambda x: fn(args, x))
    if boxed:
        base = _on_boxed(base)
    if inspect.iscoroutinefunction(fn):
        if group:
            return lambda samples: _picked_all(run_coroutine(base(samples)), samples,
                                               reward_key), True
        # per-sample async: every sample of the prompt in flight at once
        return lambda samples: _picked_all(run_coroutine(_gather(base, samples)), samples,
                                           reward_key), True
    if group:
        return lambda samples: _picked_all(base(samples), samples, reward_key), True
    return lambda sample: pick(base(sample), sample, reward_key), False


def _picked_all(values: Any, samples: list[Any], key: str | None) -> Any:
    if not isinstance(values, (list, tuple)) or len(values) != len(samples):
        return values  # Rewarder reports the wrong shape
    return [pick(v, s, key) for v, s in zip(values, samples)]


def pick(value: Any, sample: Any, key: str | None) -> Any:
    """A dict reward's trained value ``value[key]``, the dict kept in the sample's metadata."""
    if not isinstance(value, Mapping) or key is None:
        return value  # a dict without --reward-key: Rewarder reports it, naming the sample
    if key not in value:
        raise field_error(RewardKeyError, "--reward-key", key,
                          f"names no entry of the reward dict (keys {sorted(map(str, value))})",
                          "pass --reward-key naming the trained reward, e.g. score")
    if isinstance(getattr(sample, "metadata", None), dict):
        sample.metadata["reward_dict"] = dict(value)
    picked = value[key]
    return float(picked) if isinstance(picked, bool) else picked  # dapo's "acc" is a bool


def _on_boxed(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` on a copy of the sample whose response is its last ``\\boxed{}`` ("" if none)."""
    def call(sample: Any) -> Any:
        boxed = last_boxed(str(sample.response or "")) or ""
        return fn(attrs.evolve(sample, metadata={**sample.metadata, "response": boxed}))
    return call


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None.
    ``last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None
