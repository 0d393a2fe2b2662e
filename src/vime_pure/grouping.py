"""Grouping samples by ``group_id`` and planning steps of whole groups.

A *group* is one rollout execution; it may emit several samples (siblings) that share a
``group_id`` and need not be contiguous. Groups are numbered in first-occurrence order and
siblings keep their relative order, so the grouping depends on completion order only through
where each group first appears.

Integer ids (a list of Python ints or an integer array) are grouped with one ``numpy.unique``
(a sort, in C); other hashables fall back to a dict. Both paths give the same numbering.

Example: ``group_ids = ["a", "b", "a", "c"]`` gives groups ``[[0, 2], [1], [3]]``, dense ids
``[0, 1, 0, 2]``, ``order = [0, 2, 1, 3]`` and ``offsets = [0, 2, 3, 4]``.
"""

from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import numpy as np
from jaxtyping import Int64

from vime_pure.errors import ScheduleError


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


def _dense_numpy(group_ids: Sequence[Any] | np.ndarray) -> tuple[np.ndarray, list[int]] | None:
    """Dense ids and first-occurrence positions via ``np.unique``, or None if not applicable."""
    if isinstance(group_ids, np.ndarray):
        arr = group_ids
    elif isinstance(group_ids, list | tuple) and set(map(type, group_ids)) == {int}:
        arr = np.asarray(group_ids)  # object dtype when an int exceeds 64 bits
    else:
        return None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        return None
    order = np.argsort(arr, kind="stable")  # equal ids stay in index order
    ordered = arr[order]
    new = np.ones(len(arr), dtype=bool)
    new[1:] = ordered[1:] != ordered[:-1]
    first = order[new]  # first occurrence of every distinct id, in id order
    by_first = np.argsort(first, kind="stable")
    rank = np.empty_like(by_first)
    rank[by_first] = np.arange(len(by_first))
    dense = np.empty(len(arr), dtype=np.int64)
    dense[order] = rank[np.cumsum(new) - 1]
    return dense, first[by_first].tolist()


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


def group_samples(group_ids: Sequence[Any] | np.ndarray) -> Grouping:
    """Group sample indices by ``group_id`` in first-occurrence order (O(n log n) in C for int
    and str ids, O(n) dict otherwise)."""
    fast = _dense_numpy(group_ids)
    if fast is not None:
        dense, first = fast
        ids = tuple(map(group_ids.__getitem__, first))
    else:
        dense, ids = dense_first_occurrence(group_ids)
    return Grouping.from_dense(dense, ids)


def dense_ids(ids: Sequence[Any] | np.ndarray) -> Int64[np.ndarray, " n"]:
    """Dense first-occurrence numbers of any ids: the one numbering every module uses.

    Example: ``dense_ids([7, 3, 7]) == [0, 1, 0]`` (not sorted order, which would give 1, 0, 1).
    """
    return group_samples(ids).dense
