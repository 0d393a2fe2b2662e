"""Collectives that feed vime's loss and metric reductions (thin: the core decides).

* :func:`gather_step_report`: gathers every rank's per-key partial numerators and reduces them
  on every rank with ``vime_pure.reduce_train_step`` (the step's loss report);
* :func:`gather_metrics`: gathers per-rank ``Metric`` dicts and reduces them with
  ``vime_pure.reduce_metrics``, on the group's source rank or on every rank;
* :func:`rank0_result`: rank 0 decides (builds a batch, judges a sampling round) and every rank
  receives the result or the failure, so no rank waits forever for one that raised.

``torch.distributed.gather_object(dst=...)`` takes a **global** rank even when ``group`` is a
sub-group; ``group_dst`` (torch >= 2.6) is the group-relative one. We always translate the
group-relative destination to a global rank with ``get_global_rank``, which is correct on every
torch version and for groups that do not contain global rank 0 (tested with groups {0,1},{2,3}).
The reductions check that every rank reported the same keys (a typed ``MetricError`` naming
the rank otherwise), because mismatched keys would silently add unrelated numbers.
"""

from collections.abc import Callable, Mapping
from typing import Any, overload

import torch.distributed as dist
from megatron.core.distributed import param_and_grad_buffer as buffers

from vime_pure.denominators import LossMode
from vime_pure.errors import VimeError
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
    if dist.get_world_size(group) == 1:  # nothing to exchange: no pickling, no round trip
        return [dict(values)]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(values), group=group)
    return gathered


class RankFailure(VimeError):
    """Another rank failed in a step every rank takes part in; the message names the step."""


def rank0_result(what: str, fn: Callable[[], Any], *, pending: BaseException | None = None
                 ) -> Any:
    """Collective: ``fn()`` on global rank 0, its result on every rank.

    ``pending`` is an error this rank already met in the same step (its engine failed): rank 0
    then broadcasts the failure instead of calling ``fn``, and every rank raises after the
    broadcast (its own error, or :class:`RankFailure` naming ``what``), so all ranks leave the
    step together. Example: rank 1's engine raises in rollout 3 -> rank 1 re-raises it, rank 0
    reports ``EngineGroupError``, ranks 2.. raise ``RankFailure("rollout 3 failed on rank 0:
    ...")``.
    """
    error = pending
    box: list = [None]
    if dist.get_rank() == 0:
        if error is None:
            try:
                box = [("ok", fn())]
            except Exception as exc:  # re-raised below, after the other ranks are told
                error = exc
        if error is not None:
            box = [("error", f"{type(error).__name__}: {error}")]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    kind, payload = box[0]
    if kind != "ok":
        raise RankFailure(f"{what} failed on rank 0: {payload}")
    return payload


def gather_step_report(partials: Mapping[str, float], num_groups: int, mode: LossMode | str, *,
                       cp: int = 1, num_samples: int | None = None, tokens: float | None = None,
                       group: dist.ProcessGroup | None = None) -> dict[str, float | None]:
    """The step's loss report on every rank: ``reduce_train_step`` of all ranks' partials.

    Example: ranks holding ``{"loss": 21/9}`` and ``{"loss": 24/9 + 11}`` with ``G_s = 2``
    (``group_token_mean``) both get ``{"loss": 8.0}``.
    """
    return reduce_train_step(all_gather_dicts(partials, group), num_groups, mode, cp,
                             num_samples=num_samples, tokens=tokens)


@overload
def gather_metrics(metrics: Mapping[str, Metric], group: dist.ProcessGroup | None = None, *,
                   group_dst: None) -> dict[str, Metric]: ...
@overload
def gather_metrics(metrics: Mapping[str, Metric], group: dist.ProcessGroup | None = None, *,
                   group_dst: int = 0) -> dict[str, Metric] | None: ...


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


class _Done:
    """The work handle of a collective that had nothing to do (``async_op=True`` callers wait)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _nothing(args, kwargs) -> None:
    return None


def _copy_shard(args, kwargs) -> None:
    """An all-gather or reduce-scatter of one rank: the output is the input."""
    output = kwargs.get("output_tensor", kwargs.get("output", args[0] if args else None))
    source = kwargs.get("input_tensor", kwargs.get("input", args[1] if len(args) > 1 else None))
    if output.data_ptr() != source.data_ptr():
        output.copy_(source)


def _copy_into_list(args, kwargs) -> None:
    """``all_gather(tensor_list, tensor)`` / ``all_gather_object(object_list, obj)``."""
    out = kwargs.get("tensor_list", kwargs.get("object_list", args[0] if args else None))
    item = kwargs.get("tensor", kwargs.get("obj", args[1] if len(args) > 1 else None))
    if hasattr(out[0], "copy_"):
        out[0].copy_(item)
    else:
        out[0] = item


# name -> (position of ``group`` in the positional arguments, what a one-rank call does).
_SINGLE_RANK = {"all_reduce": (2, _nothing), "broadcast": (2, _nothing),
                "barrier": (0, _nothing), "broadcast_object_list": (2, _nothing),
                "all_gather": (2, _copy_into_list), "all_gather_object": (2, _copy_into_list),
                "all_gather_into_tensor": (2, _copy_shard),
                "reduce_scatter_tensor": (3, _copy_shard),
                "_all_gather_base": (2, _copy_shard), "_reduce_scatter_base": (3, _copy_shard)}


def skip_single_rank_collectives() -> None:
    """Make collectives over a one-rank group return at once (idempotent).

    Megatron's DDP, ``finalize_model_grads`` and ``clip_grads`` and mbridge's weight export
    issue their collectives even when the group (data-, tensor- or pipeline-parallel) has one
    rank; on gloo each costs ~0.4 ms, about 100 per rollout of the CPU demo. On one rank such a
    collective is the identity, so it is skipped exactly (an all-gather or reduce-scatter
    copies its input into its output). Groups of two or more ranks are untouched.
    """
    for name, (position, one_rank) in _SINGLE_RANK.items():
        original = getattr(dist, name, None)
        if original is None or getattr(original, "vime_original", None) is not None:
            continue
        setattr(dist, name, _skipping(original, position, one_rank))
    # Megatron's gradient buffer binds its gather / scatter functions at import.
    for alias in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        func = getattr(buffers, alias, None)
        if func is not None and getattr(func, "vime_original", None) is None:
            setattr(buffers, alias, getattr(dist, func.__name__, func))


def _skipping(original, position: int, one_rank):
    def collective(*args, **kwargs):
        group = kwargs["group"] if "group" in kwargs else (
            args[position] if len(args) > position else None)
        if dist.get_world_size(group) != 1:
            return original(*args, **kwargs)
        one_rank(args, kwargs)
        async_op = kwargs.get("async_op", args[position + 1] if len(args) > position + 1
                              else False)
        return _Done() if async_op else None

    # A function attribute (the mark of a wrapped collective, read back with getattr), which
    # mypy does not model on a def.
    collective.vime_original = original  # type: ignore[attr-defined]
    collective.__name__ = original.__name__
    collective.__doc__ = original.__doc__
    return collective
