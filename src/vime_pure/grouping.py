"""Grouping samples by ``group_id`` and planning steps of whole groups.

A *group* is one rollout execution; it may emit several samples (siblings) that share a
``group_id`` and need not be contiguous. Groups are numbered in first-occurrence order and
siblings keep their relative order, so the grouping depends on completion order only through
where each group first appears.

Example: ``group_ids = ["a", "b", "a", "c"]`` gives groups ``[[0, 2], [1], [3]]`` and dense ids
``[0, 1, 0, 2]``.
"""

from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import numpy as np
from jaxtyping import Int64

from vime_pure.errors import ScheduleError


@attrs.frozen(eq=False)
class Grouping:
    """Samples grouped by id: ``members[g]`` are the sample indices of group ``g`` in order."""

    ids: tuple[Hashable, ...]  # original group id of dense group g (first-occurrence order)
    dense: Int64[np.ndarray, " n"]  # dense group number of every sample
    members: tuple[Int64[np.ndarray, " k"], ...]

    @property
    def num_groups(self) -> int:
        return len(self.ids)


def group_samples(group_ids: Sequence[Any]) -> Grouping:
    """Group sample indices by ``group_id`` in first-occurrence order (O(n))."""
    first: dict[Hashable, int] = {}
    dense = np.empty(len(group_ids), dtype=np.int64)
    for i, gid in enumerate(group_ids):
        try:
            dense[i] = first.setdefault(gid, len(first))
        except TypeError as exc:  # unhashable id
            raise ScheduleError(
                f"group_ids[{i}]={gid!r} is not hashable ({exc}). Fix: use an int or str group id."
            ) from None
    # A stable sort by dense id keeps siblings in their original relative order.
    order = np.argsort(dense, kind="stable")
    bounds = np.cumsum(np.bincount(dense, minlength=len(first)))[:-1] if len(first) else []
    members = tuple(np.split(order, bounds)) if len(first) else ()
    return Grouping(ids=tuple(first), dense=dense, members=members)
