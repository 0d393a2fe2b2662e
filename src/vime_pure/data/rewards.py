"""Group-aware reward normalisation: GRPO, GSPO and REINFORCE++ with a group baseline.

The statistics unit is the **rollout group**, not the sample. A rollout execution that emits
several samples (multi-turn, sub-agents) earns one reward; within each prompt group the
per-rollout-group rewards are centred (and optionally scaled), and the result is broadcast back
to every sibling. Counting siblings individually would weight an execution by how many samples
it happened to emit; reshaping rewards into ``[prompts, n]`` would break on uneven fan-out.

- ``grpo``: ``(r - mean_prompt) / (std_prompt + eps)``, or just ``r - mean_prompt`` when
  ``normalize_std=False`` (Dr. GRPO). The std is the *sample* std over the prompt's rollout
  groups (``ddof=1``, as slime's ``torch.std``): one solved of 8 gives 2.475 / -0.354, where
  the population std would give 2.646 / -0.378; a prompt with one rollout group gets 0.
- ``gspo``: GSPO changes the policy ratio (sequence-level), not the reward statistics, so its
  advantages are GRPO's; the name exists so configs say what they train.
- ``reinforce_pp_baseline``: ``r - mean_prompt``, then, with ``normalize_std``, whitened over
  every rollout group of the batch: ``(a - mean) / (std + eps)``.

Invariants the tests assert: the advantages of one prompt group's rollout groups have zero
mean; siblings get equal advantages; siblings with different rewards, non-finite rewards and a
rollout group spanning two prompt groups are ``RewardError``s.

Example: prompt 0 has groups with rewards 1 and 0, prompt 1 one group with 5; GRPO without
std gives ``[0.5, -0.5, 0.0]`` per group, with std ``[~1, ~-1, 0.0]``.
"""

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
from jaxtyping import Float64, Int64

from vime_pure.errors import RewardError, Shown, field_error, type_tag
from vime_pure.grouping import dense_ids

METHODS: tuple[str, ...] = ("grpo", "gspo", "reinforce_pp_baseline")


@attrs.frozen(kw_only=True)
class RewardNormalization:
    """How rewards become advantages. Example: ``RewardNormalization(method="grpo",
    normalize_std=False)`` is Dr. GRPO: rewards 1, 0 in a prompt give advantages 0.5, -0.5."""

    method: str = "grpo"
    normalize_std: bool = True
    eps: float = 1e-6

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise field_error(RewardError, "method", self.method, "is not a normalisation",
                              f"use one of {METHODS}")
        if not isinstance(self.normalize_std, bool):
            raise field_error(RewardError, "normalize_std", self.normalize_std,
                              "must be a bool", "pass True or False")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not (
                0 < self.eps < 1):
            raise field_error(RewardError, "eps", self.eps, "must be a float in (0, 1)",
                              "pass a small positive number such as 1e-6")


def scalar_reward(reward: object, reward_key: str | None, where: str) -> float:
    """A sample's reward as a float: a number, or ``reward[reward_key]`` for a dict reward."""
    if isinstance(reward, Mapping):
        if reward_key is None:
            raise RewardError(f"{where}: reward is a dict with keys {sorted(reward)} but "
                              "reward_key=None. Fix: pass reward_key naming the reward to "
                              "train on.")
        if reward_key not in reward:
            raise RewardError(f"{where}: reward has no key {reward_key!r} (keys: "
                              f"{sorted(reward)}). Fix: set reward[{reward_key!r}] on every "
                              "sample.")
        reward = reward[reward_key]
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, (int, float, np.number)):
        raise RewardError(f"{where}: reward={reward!r} is not a number. Fix: set sample.reward "
                          "to a float (or a dict of floats plus reward_key) before training.")
    value = float(reward)
    if not np.isfinite(value):
        raise RewardError(f"{where}: reward={value} is not finite. Fix: clip or replace "
                          "failed rewards before training.")
    return value


def _sample_name(i: int) -> str:
    return f"sample {i}"


def group_rewards(rewards: Float64[np.ndarray, " n"], groups: Int64[np.ndarray, " n"],
                  where: Callable[[int], str] = _sample_name) -> Float64[np.ndarray, " g"]:
    """One reward per dense rollout group; siblings must agree exactly.

    Example: rewards ``[1.0, 1.0, 0.0]``, groups ``[0, 0, 1]`` -> ``[1.0, 0.0]``.
    """
    bad = np.flatnonzero(~np.isfinite(rewards))
    if bad.size:
        raise RewardError(f"{where(int(bad[0]))}: reward={float(rewards[bad[0]])} is not finite. "
                          "Fix: clip or replace failed rewards before training.")
    first = np.unique(groups, return_index=True)[1]
    per_group = rewards[first]
    odd = np.flatnonzero(rewards != per_group[groups])
    if odd.size:
        i = int(odd[0])
        j = int(first[groups[i]])
        raise RewardError(
            f"{where(j)} and {where(i)} are siblings (one rollout group) but have rewards "
            f"{float(rewards[j])} and {float(rewards[i])}. A rollout execution earns one reward. "
            "Fix: assign the execution's reward to every sample it emitted, or give the samples "
            "different group_ids if they are separate executions.")
    return per_group


def normalize_rewards(rewards: Any, group_ids: Any, prompt_groups: Any,
                      config: Any = RewardNormalization(),
                      where: Callable[[int], str] = _sample_name) -> Float64[np.ndarray, " n"]:
    """Per-sample advantages under ``config`` (see the module docstring for the formulas).

    ``where(i)`` names sample ``i`` in errors (``RolloutBatch.from_samples`` passes its path).
    ``rewards``: one number per sample; ids: one int or str per sample (None: its own group).
    Typed loosely (a user boundary); advantages are finite or a ``RewardError`` says why.
    """
    if not isinstance(config, RewardNormalization):
        raise field_error(RewardError, "config", type_tag(config), "is not a RewardNormalization",
                          "pass RewardNormalization(method=...)")
    r = _as_rewards(rewards)
    groups = dense_ids(group_ids, error=RewardError)
    prompts = dense_ids(prompt_groups, error=RewardError, field="prompt_groups")
    if not len(r) == len(groups) == len(prompts):
        raise RewardError(f"rewards, group_ids and prompt_groups have lengths {len(r)}, "
                          f"{len(groups)} and {len(prompts)}. Fix: pass one of each per sample.")
    if r.size == 0:
        return r
    per_group = group_rewards(r, groups, where)
    first = np.unique(groups, return_index=True)[1]
    prompt_of_group = prompts[first]
    split = np.flatnonzero(prompts != prompt_of_group[groups])
    if split.size:
        i = int(split[0])
        raise RewardError(f"{where(i)} shares a rollout group with {where(int(first[groups[i]]))} "
                          "but answers another prompt. "
                          "Fix: give each rollout execution a unique group_id.")
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked below, by name
        return _advantages(r, groups, prompt_of_group, per_group, config)


def _advantages(r: np.ndarray, groups: np.ndarray, prompt_of_group: np.ndarray,
                per_group: np.ndarray, config: RewardNormalization) -> Float64[np.ndarray, " n"]:
    counts = np.bincount(prompt_of_group).astype(np.float64)
    mean = np.bincount(prompt_of_group, weights=per_group) / counts
    centred = per_group - mean[prompt_of_group]
    if config.normalize_std and config.method in ("grpo", "gspo"):
        # Sample std (Bessel), as slime's torch.std; a lone group has centred 0 and std 0.
        std = np.sqrt(np.bincount(prompt_of_group, weights=centred**2)
                      / np.maximum(counts - 1.0, 1.0))
        centred = centred / (std[prompt_of_group] + config.eps)
    elif config.normalize_std:  # reinforce_pp_baseline: whiten over the batch's rollout groups
        centred = (centred - centred.mean()) / (centred.std() + config.eps)
    if not np.isfinite(centred).all():  # finite rewards near 1e308 overflow the statistics
        raise field_error(RewardError, "rewards", Shown(f"<max |r| {np.abs(r).max():.3g}>"),
                          "overflow the advantage statistics", "scale rewards to a sane range")
    return centred[groups]


def _as_rewards(rewards: Any) -> Float64[np.ndarray, " n"]:
    """One float per sample from a list, tuple or 1-D numeric array."""
    arr = None
    if isinstance(rewards, (list, tuple, np.ndarray)):
        try:
            arr = np.asarray(rewards, dtype=np.float64)
        except (TypeError, ValueError, OverflowError):
            arr = None
    if arr is None or arr.ndim != 1:
        raise field_error(RewardError, "rewards", type_tag(rewards),
                          "is not a flat list or array of numbers", "pass one float per sample")
    return arr


def grpo_advantages(rewards: Any, group_ids: Any, prompt_groups: Any, *,
                    normalize_std: Any = True, eps: Any = 1e-6) -> Float64[np.ndarray, " n"]:
    """GRPO: centre per prompt group, optionally divide by its std (Dr. GRPO: ``False``)."""
    cfg = RewardNormalization(method="grpo", normalize_std=normalize_std, eps=eps)
    return normalize_rewards(rewards, group_ids, prompt_groups, cfg)


def gspo_advantages(rewards: Any, group_ids: Any, prompt_groups: Any, *,
                    normalize_std: Any = True, eps: Any = 1e-6) -> Float64[np.ndarray, " n"]:
    """GSPO: the same advantages as GRPO (GSPO differs in the sequence-level policy ratio)."""
    cfg = RewardNormalization(method="gspo", normalize_std=normalize_std, eps=eps)
    return normalize_rewards(rewards, group_ids, prompt_groups, cfg)


def reinforce_pp_baseline_advantages(rewards: Any, group_ids: Any, prompt_groups: Any, *,
                                     normalize_std: Any = True, eps: Any = 1e-6
                                     ) -> Float64[np.ndarray, " n"]:
    """REINFORCE++ with a group baseline: subtract the prompt mean, whiten over the batch."""
    cfg = RewardNormalization(method="reinforce_pp_baseline", normalize_std=normalize_std,
                              eps=eps)
    return normalize_rewards(rewards, group_ids, prompt_groups, cfg)
