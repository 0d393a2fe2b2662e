"""Grouping samples by ``group_id`` and planning steps of whole groups.

A *group* is one rollout execution; it may emit several samples (siblings) that share a
``group_id`` and need not be contiguous. Groups are numbered in first-occurrence order and
siblings keep their relative order, so the grouping depends on completion order only through
where each group first appears.

Group ids are ``int`` or ``str`` (numpy integers and strings are converted): ``True``, ``1``
and ``1.0`` are equal in Python and would silently merge distinct groups, so bools, floats and
every other type are rejected with that reason. ``None`` means "no group": the sample is its own
group, as in ``RolloutBatch.from_samples`` (``vime_pure.data.rollout_output``).

Integer ids (a list of Python ints or an integer array) are grouped with one ``numpy.unique``
(a sort, in C); the rest falls back to a dict. Both paths give the same numbering.

Example: ``group_ids = ["a", "b", "a", "c"]`` gives groups ``[[0, 2], [1], [3]]``, dense ids
``[0, 1, 0, 2]``, ``order = [0, 2, 1, 3]`` and ``offsets = [0, 2, 3, 4]``; ``[None, "a", None]``
gives three groups ``[0, 1, 2]`` with original ids ``(None, "a", None)``.
"""

from collections.abc import Hashable, Sequence
from typing import Any, cast

import attrs
import numpy as np
from jaxtyping import Int64

from vime_pure.errors import ScheduleError, VimeError, field_error, type_tag


@attrs.frozen(eq=False)
class Grouping:
    """Samples grouped by id. ``order[offsets[g]:offsets[g + 1]]`` are the sample indices of
    group ``g`` in their original relative order (group-major order of all samples)."""

    ids: tuple[Hashable, ...]  # original group id of dense group g (first-occurrence order)
    dense: Int64[np.ndarray, " n"]  # dense group number of every sample
    order: Int64[np.ndarray, " n"]  # sample indices, group by group
    offsets: Int64[np.ndarray, " g1"]  # group g occupies order[offsets[g]:offsets[g + 1]]

    @property
    def num_groups(self) -> int:
        return len(self.ids)

    @property
    def members(self) -> tuple[Int64[np.ndarray, " k"], ...]:
        """Sample indices of every group, in order (one array per group)."""
        return tuple(np.split(self.order, self.offsets[1:-1])) if self.ids else ()

    def sizes(self) -> Int64[np.ndarray, " g"]:
        """Number of samples of every group."""
        return np.diff(self.offsets)

    @classmethod
    def from_dense(cls, dense: Int64[np.ndarray, " n"], ids: tuple[Hashable, ...]) -> "Grouping":
        """The grouping of samples already numbered densely in first-occurrence order (a
        ``RolloutBatch``'s ``group_ids``); ``ids[g]`` is group ``g``'s original id."""
        # A stable sort by dense id keeps siblings in their original relative order.
        order = np.argsort(dense, kind="stable").astype(np.int64, copy=False)
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(np.bincount(dense, minlength=len(ids)), out=offsets[1:])
        return cls(ids=tuple(ids), dense=dense, order=order, offsets=offsets)


_PLAIN_KEYS = frozenset({int, str, type(None)})
_COLLIDING = ("bools and floats compare equal to ints (True == 1 == 1.0), so they would "
              "silently merge distinct groups")
GROUP_ID_FIX = "use int or str group ids (None: the sample is its own group)"


def plain_key(value: object) -> int | str | None:
    """``value`` as a group key: an ``int`` or ``str`` (numpy ones converted), or None.

    Anything else raises ``TypeError`` saying why. Example: ``plain_key(np.int64(3)) == 3``;
    ``plain_key(1.0)`` raises, because ``1.0 == 1`` would merge two groups.
    """
    if value is None or type(value) is int or type(value) is str:
        return value
    if isinstance(value, (bool, np.bool_, float, complex, np.floating, np.complexfloating)):
        raise TypeError(f"is a {type(value).__name__}: {_COLLIDING}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, str):
        return str(value)
    raise TypeError(f"is a {type(value).__name__}, not an int or str")


def group_keys(group_ids: object, error: type[VimeError] = ScheduleError,
               field: str = "group_ids") -> tuple[np.ndarray | list | tuple, bool]:
    """Validated ids: an integer array, or a list of ``int | str | None``; and whether a None
    occurs. Example: ``group_keys([np.int64(1), "a"]) == ([1, "a"], False)``; ``[1, True]``
    raises ``error`` naming ``group_ids[1]``."""
    if isinstance(group_ids, np.ndarray):
        if group_ids.ndim != 1:
            raise field_error(error, f"{field}.shape", group_ids.shape, "is not 1-D",
                              "pass one group id per sample")
        if group_ids.dtype.kind in "iu":
            return group_ids, False
        if group_ids.dtype.kind not in "UO":
            raise field_error(error, f"{field}[0]", group_ids[:1].tolist()[0] if group_ids.size
                              else None,
                              f"is a {group_ids.dtype} entry: {_COLLIDING}" if
                              group_ids.dtype.kind in "bfc" else
                              f"is a {group_ids.dtype} entry, not an int or str", GROUP_ID_FIX)
        items = group_ids.tolist()
    elif isinstance(group_ids, (list, tuple)):
        items = group_ids
    else:
        raise field_error(error, field, type_tag(group_ids),
                          "is not a list, tuple or 1-D array",
                          "pass one group id per sample, e.g. list(ids)")
    types = set(map(type, items))
    if types <= _PLAIN_KEYS:
        return items, type(None) in types
    out = list(items)
    for i, value in enumerate(out):
        try:
            out[i] = plain_key(value)
        except TypeError as exc:
            raise field_error(error, f"{field}[{i}]", value, str(exc), GROUP_ID_FIX) from None
    return out, any(v is None for v in out)


def _dense_numpy(keys: np.ndarray | list | tuple
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Dense ids, first-occurrence positions, and the grouping's ``order`` and ``offsets``, via
    one sort (none when the ids never decrease), or None if not applicable."""
    if isinstance(keys, np.ndarray):
        arr = keys
    elif keys and set(map(type, keys)) == {int}:
        try:
            arr = np.asarray(keys)  # object dtype when an int exceeds 64 bits
        except OverflowError:
            return None
    else:
        return None
    if arr.dtype.kind not in "iu":
        return None
    n = len(arr)
    if n and bool(np.all(arr[1:] >= arr[:-1])):  # grouped and in order: no sort needed
        new = np.ones(n, dtype=bool)
        new[1:] = arr[1:] != arr[:-1]
        first = np.flatnonzero(new)
        return (np.cumsum(new) - 1, first, np.arange(n, dtype=np.int64),
                np.append(first, n).astype(np.int64))
    order = np.argsort(arr, kind="stable")  # equal ids stay in index order
    ordered = arr[order]
    new = np.ones(n, dtype=bool)
    new[1:] = ordered[1:] != ordered[:-1]
    runs = np.flatnonzero(new)  # where each distinct id's run starts in ``order``
    first = order[runs]  # first occurrence of every distinct id, in id order
    by_first = np.argsort(first, kind="stable")
    rank = np.empty_like(by_first)
    rank[by_first] = np.arange(len(by_first))
    dense = np.empty(n, dtype=np.int64)
    dense[order] = rank[np.cumsum(new) - 1]
    # The runs in first-occurrence order are the groups: gather them without a second sort.
    lens = np.diff(np.append(runs, n))[by_first]
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    gather = np.repeat(runs[by_first] - offsets[:-1], lens) + np.arange(n)
    return dense, first[by_first], order[gather].astype(np.int64), offsets


def dense_first_occurrence(ids: Sequence[Any]) -> tuple[Int64[np.ndarray, " n"], tuple]:
    """Dense numbers of ``ids`` in first-occurrence order, and the original id of each number.

    Example: ``["a", "b", "a"]`` gives ``([0, 1, 0], ("a", "b"))``. C-level ``dict.fromkeys``
    and ``map`` passes; an unhashable id raises ``ScheduleError`` naming its position.
    """
    try:
        values = tuple(dict.fromkeys(ids))  # keeps first-occurrence order
    except TypeError as exc:
        bad = next(i for i, v in enumerate(ids) if not _is_hashable(v))
        raise ScheduleError(f"group_ids[{bad}]={ids[bad]!r} is not hashable ({exc}). Fix: use an "
                            "int or str group id.") from None
    number = {v: k for k, v in enumerate(values)}
    return np.fromiter(map(number.__getitem__, ids), dtype=np.int64, count=len(ids)), values


def _is_hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


class _Own:
    """Marks a sample without a group id: ``(_OWN, i)`` equals no other key."""


_OWN = _Own()


def group_samples(group_ids: Any, *, error: type[VimeError] = ScheduleError,
                  field: str = "group_ids") -> Grouping:
    """Group sample indices by ``group_id`` in first-occurrence order (O(n log n) in C for int
    ids, O(n) dict otherwise). Ids are validated (module docstring): a bad one raises ``error``
    naming ``field[i]``; each None is a group of its own."""
    keys, has_none = group_keys(group_ids, error, field)
    fast = _dense_numpy(keys)
    if fast is not None:
        dense, first, order, offsets = fast
        ids = tuple(keys[first].tolist()) if isinstance(keys, np.ndarray) else tuple(
            map(keys.__getitem__, first.tolist()))
        return Grouping(ids=ids, dense=dense.astype(np.int64, copy=False), order=order,
                        offsets=offsets)
    if has_none:
        own = [(_OWN, i) if v is None else v for i, v in enumerate(keys)]
        dense, values = dense_first_occurrence(own)
        ids = tuple(None if type(v) is tuple else v for v in values)
    else:
        dense, ids = dense_first_occurrence(cast(Sequence[Any], keys))  # arrays index alike
    return Grouping.from_dense(dense, ids)


def dense_ids(ids: Any, *, error: type[VimeError] = ScheduleError,
              field: str = "group_ids") -> Int64[np.ndarray, " n"]:
    """Dense first-occurrence numbers of any ids: the one numbering every module uses.

    Example: ``dense_ids([7, 3, 7]) == [0, 1, 0]`` (not sorted order, which would give 1, 0, 1).
    """
    return group_samples(ids, error=error, field=field).dense
