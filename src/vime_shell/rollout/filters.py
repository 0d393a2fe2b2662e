"""Dynamic-sampling filters (``--dynamic-sampling-filter-path``), as in DAPO and slime.

A filter sees all samples of one prompt (its prompt group, whatever the nesting) and says
whether to keep them. Groups whose rewards all match carry no GRPO signal (every advantage is
0), so training on them only dilutes the step: :func:`nonzero_reward_std` drops them.

slime's ``filter(args, samples)`` loads too (:func:`load_filter`).

Example: rewards ``[1, 0, 1, 1]`` are kept, ``[0, 0, 0, 0]`` and ``[1, 1, 1, 1]`` dropped.
"""

from collections.abc import Callable, Sequence
from typing import Any

from vime_shell.rollout.plugins import load_callable
from vime_shell.rollout.reward_plugins import positional_arity

SampleFilter = Callable[[list[Any]], bool]
BUILT_IN_FILTER = "vime_shell.rollout.filters:nonzero_reward_std"
# slime's and miles' own path of the same filter (their scripts pass it)
ANCHOR_FILTERS: tuple[str, ...] = tuple(
    f"{anchor}.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
    for anchor in ("slime", "miles"))


def nonzero_reward_std(samples: Sequence[Any]) -> bool:
    """Keep a prompt group unless all its rewards are equal (zero standard deviation)."""
    rewards = [s.reward for s in samples]
    return any(r != rewards[0] for r in rewards[1:])


def load_filter(path: str | None, args: Any = None) -> SampleFilter | None:
    """The filter ``--dynamic-sampling-filter-path`` names, or None (keep every group).

    vime's ``fn(samples) -> bool`` or slime's ``fn(args, samples)`` (``args``: the run's
    config), told apart by signature; slime's result may be an object with a ``keep``
    attribute (its ``DynamicFilterOutput``) instead of a bool."""
    if path is None:
        return None
    fn = load_callable(path, flag="--dynamic-sampling-filter-path")
    if positional_arity(fn) != 2:
        return fn
    return lambda samples: _keep(fn(args, samples))


def _keep(result: Any) -> bool:
    return bool(getattr(result, "keep", result))
