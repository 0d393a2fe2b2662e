"""Collectives that feed vime's loss and metric reductions (thin: the core decides).

* :func:`gather_step_report`: gathers every rank's per-key partial numerators and reduces them
  on every rank with ``vime_pure.reduce_train_step`` (the step's loss report);
* :func:`gather_metrics`: gathers per-rank ``Metric`` dicts and reduces them with
  ``vime_pure.reduce_metrics``, on the group's source rank or on every rank.

``torch.distributed.gather_object(dst=...)`` takes a **global** rank even when ``group`` is a
sub-group; ``group_dst`` (torch >= 2.6) is the group-relative one. We always translate the
group-relative destination to a global rank with ``get_global_rank``, which is correct on every
torch version and for groups that do not contain global rank 0 (tested with groups {0,1},{2,3}).
The reductions check that every rank reported the same keys (a typed ``MetricError`` naming
the rank otherwise), because mismatched keys would silently add unrelated numbers.
"""

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from vime_pure.denominators import LossMode
from vime_pure.metrics import Metric, reduce_metrics, reduce_train_step


def global_rank_of(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """Global rank of ``group_rank`` in ``group`` (``None`` is the world group)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def source_rank(group: dist.ProcessGroup | None = None) -> int:
    """Global rank of the group's source (group rank 0). Example: group {2, 3} -> 2."""
    return global_rank_of(group, 0)


def all_gather_dicts(values: Mapping[str, Any],
                     group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """Every group rank's ``values``, in group-rank order, on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(values), group=group)
    return gathered


def gather_step_report(partials: Mapping[str, float], num_groups: int, mode: LossMode | str, *,
                       cp: int = 1, num_samples: int | None = None,
                       group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """The step's loss report on every rank: ``reduce_train_step`` of all ranks' partials.

    Example: ranks holding ``{"loss": 21/9}`` and ``{"loss": 24/9 + 11}`` with ``G_s = 2``
    (``group_token_mean``) both get ``{"loss": 8.0}``.
    """
    return reduce_train_step(all_gather_dicts(partials, group), num_groups, mode, cp,
                             num_samples=num_samples)


def gather_metrics(metrics: Mapping[str, Metric], group: dist.ProcessGroup | None = None, *,
                   group_dst: int | None = 0) -> dict[str, Metric] | None:
    """Gather metric dicts to group rank ``group_dst`` and reduce them there; with
    ``group_dst=None`` every rank gathers and gets the reduction.

    Returns the reduced dict on the destination and ``None`` elsewhere. A differing key set on
    any rank raises ``MetricError`` on the destination (naming the rank).
    Example: group {2, 3} with ``{"r": Metric(1, 2)}`` and ``{"r": Metric(1, 1)}``: global rank 2
    gets ``{"r": Metric(2, 3)}``, rank 3 gets ``None``.
    """
    if group_dst is None:
        return reduce_metrics(all_gather_dicts(metrics, group))
    dst = global_rank_of(group, group_dst)
    if dist.get_rank() != dst:
        dist.gather_object(dict(metrics), None, dst=dst, group=group)
        return None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.gather_object(dict(metrics), gathered, dst=dst, group=group)
    return reduce_metrics(gathered)
