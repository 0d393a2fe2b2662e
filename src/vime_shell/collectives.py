"""Collectives that feed vime's loss and metric reductions (thin: the core decides).

* :func:`all_reduce_step_sums`: sums per-key partial numerators over the DP x CP group, so that
  every rank can call ``vime_pure.reduce_train_step``-equivalent arithmetic on the totals.
* :func:`gather_metrics`: gathers per-rank ``Metric`` dicts to the group's source rank and
  reduces them there with ``vime_pure.reduce_metrics``.

``torch.distributed.gather_object(dst=...)`` takes a **global** rank even when ``group`` is a
sub-group; ``group_dst`` (torch >= 2.6) is the group-relative one. We always translate the
group-relative destination to a global rank with ``get_global_rank``, which is correct on every
torch version and for groups that do not contain global rank 0 (tested with groups {0,1},{2,3}).
Key sets are checked across ranks before any tensor collective, because mismatched keys would
otherwise silently add unrelated numbers.
"""

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from vime_pure.metrics import Metric, MetricError, reduce_metrics


def global_rank_of(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """Global rank of ``group_rank`` in ``group`` (``None`` is the world group)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def source_rank(group: dist.ProcessGroup | None = None) -> int:
    """Global rank of the group's source (group rank 0). Example: group {2, 3} -> 2."""
    return global_rank_of(group, 0)


def _check_keys_agree(keys: tuple[str, ...], group: dist.ProcessGroup | None) -> None:
    size = dist.get_world_size(group)
    all_keys: list[Any] = [None] * size
    dist.all_gather_object(all_keys, keys, group=group)
    for rank, other in enumerate(all_keys):
        if tuple(other) != keys:
            raise MetricError(
                f"step sums on group rank {rank} have keys {list(other)} but this rank has "
                f"{list(keys)}. Fix: report every key on every rank (0.0 where a rank holds "
                "no tokens) so that the all-reduce adds matching quantities.")


def all_reduce_step_sums(sums: Mapping[str, float | torch.Tensor],
                         group: dist.ProcessGroup | None = None, *, check_keys: bool = True,
                         device: torch.device | str = "cpu") -> dict[str, float]:
    """Sum each key over the group (DP x CP) in float64; returns the totals on every rank.

    Example: ranks holding ``{"loss": 21/9}`` and ``{"loss": 24/9 + 11}`` both get
    ``{"loss": 16.0}``; divide by the step divisor for the report (8.0 for G_s = 2).
    """
    keys = tuple(sorted(sums))
    if check_keys:
        _check_keys_agree(keys, group)
    packed = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return dict(zip(keys, packed.tolist()))


def gather_metrics(metrics: Mapping[str, Metric], group: dist.ProcessGroup | None = None, *,
                   group_dst: int = 0) -> dict[str, Metric] | None:
    """Gather metric dicts to group rank ``group_dst`` and reduce them there.

    Returns the reduced dict on the destination and ``None`` elsewhere. A differing key set on
    any rank raises ``MetricError`` on the destination (naming the rank).
    Example: group {2, 3} with ``{"r": Metric(1, 2)}`` and ``{"r": Metric(1, 1)}``: global rank 2
    gets ``{"r": Metric(2, 3)}``, rank 3 gets ``None``.
    """
    dst = global_rank_of(group, group_dst)
    is_dst = dist.get_rank() == dst
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if is_dst else None
    dist.gather_object(dict(metrics), gathered, dst=dst, group=group)
    if not is_dst:
        return None
    assert gathered is not None  # allocated above on the destination
    return reduce_metrics(gathered)
