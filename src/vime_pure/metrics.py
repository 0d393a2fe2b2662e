"""Count-weighted metrics: ``(sum, count)`` records that reduce exactly across any split.

Averaging per-rank means is wrong whenever ranks hold different counts (a mean of means). A
:class:`Metric` carries ``sum`` and ``count``; ranks are reduced by adding both, and the value
is read once at the end: ``sum / count`` for ``mean`` (0.0 when the count is 0), the extreme
over non-empty entries for ``min``/``max`` (there ``sum`` holds the extreme value).

The train-step loss report (:func:`reduce_train_step`) divides the summed partial numerators of
``vime_pure.torch_ops.loss.microbatch_loss`` by the step divisor, the same number whose gradient is taken.

Invariants the tests assert: ``merge_metrics`` is associative and commutative (to rounding);
reducing per-rank dicts equals the single-rank computation over the union of the data; differing
key sets or reductions across ranks raise :class:`MetricError`; ``reduce_train_step`` is the
same for any split of a step.

Example: rank 0 saw rewards [1, 0], rank 1 saw [1]: ``Metric(1, 2)`` and ``Metric(1, 1)``
reduce to ``Metric(2, 3)``, value 0.667, where the mean of means would say 0.75.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import attrs

from vime_pure.denominators import LossMode, step_divisor
from vime_pure.errors import LossConfigError, MetricError, field_error

Reduction = Literal["mean", "min", "max"]
REDUCTIONS: tuple[str, ...] = ("mean", "min", "max")



def _check_metric(m: "Metric") -> None:
    if m.reduction not in REDUCTIONS:
        raise field_error(MetricError, "reduction", m.reduction, "is not a reduction",
                          f"use one of {REDUCTIONS}")
    if not math.isfinite(m.count) or m.count < 0:
        raise field_error(MetricError, "count", m.count, "must be finite and >= 0",
                          "pass the number of observations (or token weight) behind sum")
    if math.isnan(m.sum):
        raise field_error(MetricError, "sum", m.sum, "is NaN",
                          "find the NaN upstream; vime does not drop it silently")


@attrs.frozen
class Metric:
    """A reducible metric: ``sum`` and ``count`` of observations, and how to combine them.

    For ``min``/``max``, ``sum`` is the extreme value and ``count`` the number of observations.
    Example: ``Metric(6.0, 4.0).value == 1.5``; ``Metric(0.0, 0.0).value == 0.0``.
    """

    sum: float = attrs.field(converter=float)
    count: float = attrs.field(converter=float)
    reduction: Reduction = "mean"

    def __attrs_post_init__(self) -> None:
        _check_metric(self)

    @property
    def value(self) -> float:
        """The reported number: ``sum / count`` for mean (0.0 if empty), else the extreme."""
        if self.count == 0:
            return 0.0
        return self.sum / self.count if self.reduction == "mean" else self.sum

    @classmethod
    def of(cls, values: Iterable[float | int], reduction: Reduction = "mean") -> "Metric":
        """Metric of observations. Example: ``Metric.of([1, 3], "max") == Metric(3, 2, "max")``."""
        xs = [float(x) for x in values]
        if reduction == "mean":
            return cls(math.fsum(xs), len(xs), reduction)
        extreme = (min if reduction == "min" else max)(xs) if xs else 0.0
        return cls(extreme, len(xs), reduction)


def merge_metrics(items: Sequence[Metric], key: str = "metric") -> Metric:
    """Combine records of one metric from several ranks (exactly-rounded sums)."""
    if not items:
        raise field_error(MetricError, key, [], "has no records to merge", "pass at least one")
    reductions = {m.reduction for m in items}
    if len(reductions) > 1:
        raise field_error(MetricError, key, sorted(reductions),
                          "is reported with different reductions on different ranks",
                          "use the same reduction for a key on every rank")
    reduction = items[0].reduction
    count = math.fsum(m.count for m in items)
    if reduction == "mean":
        return Metric(math.fsum(m.sum for m in items), count, "mean")
    seen = [m.sum for m in items if m.count > 0]
    extreme = (min if reduction == "min" else max)(seen) if seen else 0.0
    return Metric(extreme, count, reduction)


def _check_same_keys(per_rank: Sequence[Mapping[str, object]]) -> None:
    if not per_rank:
        raise field_error(MetricError, "per_rank", [], "is empty", "pass one dict per rank")
    reference = set(per_rank[0])
    for rank, d in enumerate(per_rank[1:], start=1):
        if set(d) != reference:
            missing, extra = sorted(reference - set(d)), sorted(set(d) - reference)
            raise MetricError(
                f"per_rank[{rank}] has different metric keys than per_rank[0]: missing "
                f"{missing}, extra {extra}. Fix: report every key on every rank (use "
                "Metric(0.0, 0.0) where a rank saw no data) so that collectives line up.")


def reduce_metrics(per_rank: Sequence[Mapping[str, Metric]]) -> dict[str, Metric]:
    """Reduce per-rank metric dicts key by key; a typed error when key sets differ."""
    _check_same_keys(per_rank)
    return {k: merge_metrics([d[k] for d in per_rank], k) for k in sorted(per_rank[0])}


def metric_values(metrics: Mapping[str, Metric]) -> dict[str, float]:
    """Read the reported numbers. Example: ``{"r": Metric(2, 4)}`` -> ``{"r": 0.5}``."""
    return {k: m.value for k, m in metrics.items()}


def reduce_train_step(values: Sequence[Mapping[str, float | int]], G_s: int, mode: LossMode | str,
                      cp: int = 1, *, num_samples: int | None = None) -> dict[str, float]:
    """The train-step report of loss-like keys, identical for any split of the step.

    ``values`` holds, per rank of the DP x CP group, the sum over its micro-batches of
    ``microbatch_loss`` partial numerators, one key per reported quantity (``loss``, ``pg``,
    ``kl``, ``entropy``, ``clipfrac``...). The report of key ``k`` is
    ``sum_ranks(values[k]) / step_divisor(mode, G_s, num_samples)``. CP ranks hold disjoint
    token shards scored over full denominators, so no ``cp`` correction applies; ``cp`` only
    checks that every CP rank contributed (``len(values)`` is a multiple of ``cp``).
    Example: ``group_token_mean``, G_s=2, partials ``[{"loss": 21/9}, {"loss": 24/9 + 11}]``
    -> ``{"loss": 8.0}``.
    """
    divisor = step_divisor(mode, G_s, num_samples)
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise field_error(LossConfigError, "cp", cp, "must be an integer >= 1",
                          "pass the context-parallel size")
    _check_same_keys(values)
    if len(values) % cp:
        raise field_error(MetricError, "values", f"<{len(values)} ranks>",
                          f"is not a multiple of cp={cp}: some CP rank's partial is missing",
                          "gather from the whole DP x CP group")
    return {k: math.fsum(float(d[k]) for d in values) / divisor for k in sorted(values[0])}
