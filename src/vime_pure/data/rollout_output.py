"""Validate and flatten what a rollout function returns; resolve group ids and loss masks.

A rollout function returns samples nested in lists **or tuples**. The *depth* is the number of
containers above a sample, minus one:

- depth 0, flat: ``[s, s, s]``. Every sample needs an explicit ``prompt_group``.
- depth 1, prompt x sample (the default): ``output[p]`` holds the samples of prompt ``p``.
- depth >= 2, compact: ``output[p]...[leaf]``; a leaf (innermost container) is one rollout
  group. A leaf with more than one sample needs every sibling to carry the same non-None
  ``group_id``, and one id may not name two leaves.

For depth >= 1 the top-level index is the prompt unless a sample sets ``prompt_group``.

Group-id fallback: a sample without ``group_id`` is its own group, numbered with the smallest
non-negative integer that no explicit id uses; explicit ids are never changed. Prompt groups
derived from the nesting use the same rule against explicit ``prompt_group`` values. Ids must be
``int`` or ``str``: ``True == 1 == 1.0`` hash alike and would merge groups silently.

Invariants the tests assert: flattening keeps order; every well-formed nesting of lists and
tuples is accepted; every compact leaf with a missing or mismatched id is rejected with its
path (e.g. ``output[3][1][2]``); fallback ids never collide with explicit ones; a rollout group
never spans two prompt groups.

Example: ``[[a, b], [c]]`` with no ids gives group ids ``[0, 1, 2]`` and prompt groups
``[0, 0, 1]``; with ``a.group_id = 1`` the ids become ``[1, 0, 2]``.
"""

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
from jaxtyping import Int64, UInt8

from vime_pure.errors import RolloutValidationError, field_error, type_tag
from vime_pure.grouping import dense_first_occurrence, group_keys, plain_key
from vime_pure.data.sample import Sample

GroupKey = int | str
Location = tuple[int, ...]


def path_of(loc: Location) -> str:
    """``(3, 1, 2)`` -> ``"output[3][1][2]"``."""
    return "output" + "".join(f"[{k}]" for k in loc)


def _fail(loc: Location, problem: str, fix: str) -> RolloutValidationError:
    return RolloutValidationError(f"{path_of(loc)}: {problem}. Fix: {fix}.")


@attrs.frozen(eq=False)
class FlatRollout:
    """Samples in output order with their locations, resolved group ids and prompt groups."""

    samples: tuple[Sample, ...]
    locations: tuple[Location, ...]
    depth: int
    group_ids: tuple[GroupKey, ...]
    prompt_groups: tuple[GroupKey, ...]
    group_dense: Int64[np.ndarray, " n"]  # first-occurrence numbering of group_ids
    group_values: tuple[GroupKey, ...]  # group_values[group_dense[i]] == group_ids[i]
    prompt_dense: Int64[np.ndarray, " n"]
    prompt_values: tuple[GroupKey, ...]

    def path(self, i: int) -> str:
        """Where sample ``i`` sits in the rollout output, e.g. ``output[3][1][2]``."""
        return path_of(self.locations[i])


def as_group_key(value: object, field: str, loc: Location) -> GroupKey | None:
    """An id as ``int`` or ``str`` (numpy integers become ``int``); None passes through."""
    try:
        return plain_key(value)
    except TypeError as exc:
        raise _fail(loc, f"{field}={value!r} {exc}", f"use an int or str {field}") from None


def fallback_ids(ids: Any) -> list[GroupKey]:
    """Replace each None by the smallest non-negative int no explicit id uses, in order.

    Example: ``[None, 0, None, "x", 2]`` -> ``[1, 0, 3, "x", 2]``. Ids are validated like
    ``build_schedule``'s (int or str; bools and floats rejected).
    """
    ids, _ = group_keys(ids, RolloutValidationError, "ids")
    used = {i for i in ids if type(i) is int and i >= 0}
    missing = sum(1 for i in ids if i is None)
    fresh = iter([k for k in range(missing + len(used)) if k not in used])
    return [next(fresh) if i is None else i for i in ids]


def flatten_rollout_output(output: object) -> FlatRollout:
    """Validate a nested rollout output and flatten it in order (see the module docstring)."""
    if isinstance(output, Sample) or not isinstance(output, (list, tuple)):
        raise RolloutValidationError(
            f"output is a {type(output).__name__}, not a list or tuple of samples. Fix: return "
            "a list of Samples, or one list of Samples per prompt.")
    walk = _Walk()
    walk.visit(output, ())
    depth = walk.check_depth()
    samples = tuple(walk.samples)
    locs = tuple(walk.locations)
    # Inline fast path: ids are mostly None, int or str; only the rest pay for a call.
    raw = [g if (g := s.group_id) is None or type(g) is int or type(g) is str
           else as_group_key(g, "group_id", loc) for s, loc in zip(samples, locs)]
    if depth >= 2:
        _check_compact_leaves(raw, walk.leaf_of, locs)
    group_ids = tuple(fallback_ids(raw))
    prompts = tuple(_prompt_groups(samples, locs, depth))
    group_dense, group_values = dense_first_occurrence(group_ids)
    prompt_dense, prompt_values = dense_first_occurrence(prompts)
    _check_groups_within_prompts(group_dense, prompt_dense, group_ids, prompts, locs)
    return FlatRollout(samples=samples, locations=locs, depth=depth, group_ids=group_ids,
                       prompt_groups=prompts, group_dense=group_dense, group_values=group_values,
                       prompt_dense=prompt_dense, prompt_values=prompt_values)


class _Walk:
    """One pass over the nesting: samples, their leaf containers and container depths."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []
        self.locations: list[Location] = []
        self.leaf_of: list[int] = []  # leaf container number of each sample
        self.leaf_depths: list[tuple[int, Location]] = []
        self.deepest: tuple[int, Location] = (0, ())

    def visit(self, node: list | tuple, loc: Location) -> None:
        if len(loc) > self.deepest[0]:
            self.deepest = (len(loc), loc)
        kind: str | None = None
        leaf = len(self.leaf_depths)
        if node and all(type(child) is Sample for child in node):  # a leaf: extend in bulk
            self.samples.extend(node)
            self.locations.extend([loc + (k,) for k in range(len(node))])
            self.leaf_of.extend([leaf] * len(node))
            self.leaf_depths.append((len(loc), loc + (0,)))
            return
        for k, child in enumerate(node):
            here = loc + (k,)
            if isinstance(child, Sample):
                if kind == "container":
                    raise _mixed(here, "a Sample", "lists")
                kind = "sample"
                self.samples.append(child)
                self.locations.append(here)
                self.leaf_of.append(leaf)
            elif isinstance(child, (list, tuple)):
                if kind == "sample":
                    raise _mixed(here, f"a {type(child).__name__}", "Samples")
                kind = "container"
                self.visit(child, here)
            else:
                raise _fail(here, f"holds {child!r:.60} of type {type(child).__name__}",
                            "put only Sample objects in (possibly nested) lists or tuples")
        if kind == "sample":
            self.leaf_depths.append((len(loc), loc + (0,)))

    def check_depth(self) -> int:
        if not self.leaf_depths:
            return 0
        depth, first = self.leaf_depths[0]
        for d, where in self.leaf_depths:
            if d != depth:
                raise _fail(where, f"is a Sample at depth {d} but {path_of(first)} is at depth "
                            f"{depth}", "nest every sample equally deep")
        if self.deepest[0] > depth:
            raise _fail(self.deepest[1], f"is a container at depth {self.deepest[0]}, deeper "
                        f"than the samples (depth {depth}, e.g. {path_of(first)})",
                        "remove the extra nesting level or empty container")
        return depth


def _mixed(loc: Location, what: str, siblings: str) -> RolloutValidationError:
    return _fail(loc, f"is {what} but its siblings are {siblings}",
                 "do not mix Samples and containers in one list; nest every sample equally deep")


def _check_compact_leaves(raw: list[GroupKey | None], leaf_of: list[int],
                          locs: tuple[Location, ...]) -> None:
    """Compact output: a multi-sample leaf shares one explicit id; an id names one leaf."""
    first_in_leaf: dict[int, int] = {}
    leaf_size: dict[int, int] = {}
    for leaf in leaf_of:
        leaf_size[leaf] = leaf_size.get(leaf, 0) + 1
    leaf_of_id: dict[GroupKey, int] = {}
    for i, (gid, leaf) in enumerate(zip(raw, leaf_of)):
        head = first_in_leaf.setdefault(leaf, i)
        if leaf_size[leaf] > 1 and gid is None:
            raise _fail(locs[i], f"group_id=None in a leaf of {leaf_size[leaf]} samples; in "
                        "compact output (depth >= 2) the samples of a multi-sample leaf are "
                        "siblings and must carry their shared group_id",
                        "set one group_id on all samples of this rollout execution")
        if leaf_size[leaf] > 1 and gid != raw[head]:
            raise _fail(locs[i], f"group_id={gid!r} but sibling {path_of(locs[head])} has "
                        f"group_id={raw[head]!r}; a compact leaf is one rollout group",
                        "set one group_id on all samples of this rollout execution, or put "
                        "different executions in different leaves")
        if gid is not None and leaf_of_id.setdefault(gid, leaf) != leaf:
            other = locs[leaf_of.index(leaf_of_id[gid])]
            raise _fail(locs[i], f"group_id={gid!r} is also used by the leaf of "
                        f"{path_of(other)}; two rollout groups would merge",
                        "give every rollout execution its own group_id")


def _prompt_groups(samples: tuple[Sample, ...], locs: tuple[Location, ...],
                   depth: int) -> list[GroupKey]:
    explicit = [p if (p := s.prompt_group) is None or type(p) is int or type(p) is str
                else as_group_key(p, "prompt_group", loc) for s, loc in zip(samples, locs)]
    if depth == 0:
        missing = next((i for i, p in enumerate(explicit) if p is None), None)
        if missing is not None:
            raise _fail(locs[missing], "prompt_group=None in a flat (depth 0) output, so the "
                        "prompt it answers is unknown",
                        "set sample.prompt_group, or return one list of samples per prompt")
        return explicit  # type: ignore[return-value]
    # One fallback id per top-level index whose samples leave prompt_group unset.
    tops = sorted({loc[0] for loc, p in zip(locs, explicit) if p is None})
    given = [p for p in explicit if p is not None]
    fresh = dict(zip(tops, fallback_ids(given + [None] * len(tops))[len(given):]))
    return [fresh[loc[0]] if p is None else p for loc, p in zip(locs, explicit)]


def _check_groups_within_prompts(groups: np.ndarray, prompts: np.ndarray,
                                 group_ids: tuple, prompt_ids: tuple,
                                 locs: tuple[Location, ...]) -> None:
    """A rollout group answers one prompt: vectorised, the message built only on failure."""
    if not len(groups):
        return
    first = np.unique(groups, return_index=True)[1]
    split = np.flatnonzero(prompts != prompts[first][groups])
    if split.size:
        i = int(split[0])
        j = int(first[groups[i]])
        raise _fail(locs[i], f"group_id={group_ids[i]!r} with prompt_group={prompt_ids[i]!r}, "
                    f"but {path_of(locs[j])} has the same group_id with prompt_group="
                    f"{prompt_ids[j]!r}; a rollout group answers one prompt, so these ids "
                    "collide", "give each rollout execution a unique group_id (or None)")


def normalized_loss_mask(sample: Any, where: str = "sample") -> UInt8[np.ndarray, " r"]:
    """The sample's loss mask over its response as uint8 0/1.

    ``None`` -> all ones; ``remove_sample`` -> all zeros; otherwise one 0/1 per response
    token. Example: ``response_length=3, loss_mask=None`` -> ``[1, 1, 1]``.
    """
    if not isinstance(sample, Sample):
        raise field_error(RolloutValidationError, where, type_tag(sample), "is not a Sample",
                          "pass a Sample")
    n = check_response_length(sample, where)
    if sample.remove_sample:
        return np.zeros(n, dtype=np.uint8)
    if sample.loss_mask is None:
        return np.ones(n, dtype=np.uint8)
    if not isinstance(sample.loss_mask, (list, tuple, np.ndarray)):
        raise RolloutValidationError(
            f"{where}: loss_mask={sample.loss_mask!r:.60} is a "
            f"{type(sample.loss_mask).__name__}, not a list or array. Fix: give one 0/1 per "
            "response token, or None for all ones.")
    check_mask_length(sample, n, where)
    mask = np.asarray(sample.loss_mask)
    return mask_values(mask, where).astype(np.uint8)


def check_response_length(sample: Sample, where: str) -> int:
    """``response_length`` as an int in ``[0, len(tokens)]``."""
    n = sample.response_length
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise RolloutValidationError(
            f"{where}: response_length={n!r} is not a non-negative integer. Fix: set it to the "
            "number of response tokens at the end of tokens.")
    if not isinstance(sample.tokens, (list, tuple, np.ndarray)) or np.ndim(sample.tokens) != 1:
        raise RolloutValidationError(
            f"{where}: tokens={sample.tokens!r:.60} is not a flat list or array. Fix: set the "
            "prompt + response token ids.")
    if n > len(sample.tokens):
        raise RolloutValidationError(
            f"{where}: response_length={n} exceeds len(tokens)={len(sample.tokens)}. Fix: "
            "tokens must hold the prompt followed by the response.")
    return int(n)


def check_mask_length(sample: Sample, n: int, where: str) -> None:
    got = len(sample.loss_mask)  # type: ignore[arg-type]
    if got != n:
        raise RolloutValidationError(
            f"{where}: len(loss_mask)={got} but response_length={n}. "
            "Fix: give one mask value per response token (not per prompt+response token), "
            "or set loss_mask=None for all ones.")


def mask_values(mask: np.ndarray, where: str) -> np.ndarray:
    """Reject masks that are not all 0/1 (weights belong in rewards, not masks)."""
    if mask.size and (mask.ndim != 1 or mask.dtype.kind not in "biuf"
                      or not np.isin(mask, (0, 1)).all()):
        bad = mask.ravel().tolist()[:8] if mask.dtype.kind in "biuf" else mask.dtype
        raise RolloutValidationError(
            f"{where}: loss_mask must be a flat list of 0/1 values, got {bad}. Fix: use 1 for "
            "trained response tokens and 0 for masked ones (e.g. tool outputs).")
    return mask


def all_or_none(parts: list, column: str, path: Callable[[int], str], fix: str) -> bool:
    """True when every sample set ``column`` (``parts``: one value per sample), False when none
    did; a mix is a ``RolloutValidationError`` naming the first sample that differs.
    Example: ``all_or_none([None, [0.1]], "rollout_log_probs", ...)`` raises for sample 1."""
    present = [p is not None for p in parts]
    if not any(present):
        return False
    if not all(present):
        i = present.index(not present[0])
        raise RolloutValidationError(
            f"{path(i)}: {column} is {'set' if present[i] else 'None'} but {path(0)} has it "
            f"{'set' if present[0] else 'None'}. Fix: {fix}.")
    return True
