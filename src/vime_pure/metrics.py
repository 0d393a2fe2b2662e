"""Count-weighted metrics: ``(sum, count)`` records that reduce exactly across any split.

Averaging per-rank means is wrong whenever ranks hold different counts (a mean of means). A
:class:`Metric` carries ``sum`` and ``count``; ranks are reduced by adding both, and the value
is read once at the end: ``sum / count`` for ``mean``, the extreme over non-empty entries for
``min``/``max`` (there ``sum`` holds the extreme value). Over zero observations there is no
value: ``None`` (``null`` in ``metrics.jsonl``), never a 0 that reads like a measurement (a
step whose every token is masked has no ratio and no entropy).

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
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs
import numpy as np

from vime_pure.config import as_int
from vime_pure.denominators import step_divisor
from vime_pure.errors import (LossConfigError, MetricError, Shown, VimeError, field_error,
                              type_tag)

Reduction = Literal["mean", "min", "max"]
REDUCTIONS: tuple[str, ...] = ("mean", "min", "max")



def as_real(field: str, value: object, error: type[VimeError] = MetricError) -> float:
    """``value`` as a float that is not NaN: Python and numpy numbers, 0-d tensors; strings,
    None and NaN are errors (a NaN metric is found upstream, never reduced away).

    Example: ``as_real("sum", np.float32(1.5)) == 1.5``; ``as_real("sum", "1.5")`` raises.
    """
    if value is None or isinstance(value, (str, bytes, complex, np.complexfloating)):
        raise field_error(error, field, value, "is not a real number", "pass a float")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise field_error(error, field, type_tag(value), "is not a number",
                          "pass a float") from None
    if math.isnan(number):
        raise field_error(error, field, number, "is NaN",
                          "find the NaN upstream; vime does not drop it silently")
    return number


def _fsum(field: str, values: Iterable[float]) -> float:
    """Exactly rounded sum; ``inf + -inf`` and overflow are typed errors, never a NaN."""
    try:
        return math.fsum(values)
    except (ValueError, OverflowError) as exc:
        raise field_error(MetricError, field, Shown("<sum>"), f"cannot be summed ({exc})",
                          "find the infinite or overflowing value upstream") from None


def _check_metric(m: "Metric") -> None:
    if not isinstance(m.reduction, str) or m.reduction not in REDUCTIONS:
        raise field_error(MetricError, "reduction", m.reduction, "is not a reduction",
                          f"use one of {REDUCTIONS}")
    if not math.isfinite(m.count) or m.count < 0:
        raise field_error(MetricError, "count", m.count, "must be finite and >= 0",
                          "pass the number of observations (or token weight) behind sum")


@attrs.frozen
class Metric:
    """A reducible metric: ``sum`` and ``count`` of observations, and how to combine them.

    For ``min``/``max``, ``sum`` is the extreme value and ``count`` the number of observations.
    Example: ``Metric(6.0, 4.0).value == 1.5``; ``Metric(0.0, 0.0).value is None``.
    """

    sum: float = attrs.field(converter=lambda v: as_real("sum", v))
    count: float = attrs.field(converter=lambda v: as_real("count", v))
    reduction: Reduction = "mean"

    def __attrs_post_init__(self) -> None:
        _check_metric(self)

    @property
    def value(self) -> float | None:
        """The reported number: ``sum / count`` for mean, else the extreme; None if empty."""
        if self.count == 0:
            return None
        return self.sum / self.count if self.reduction == "mean" else self.sum

    @classmethod
    def of(cls, values: Any, reduction: Any = "mean") -> "Metric":
        """Metric of observations. Example: ``Metric.of([1, 3], "max") == Metric(3, 2, "max")``."""
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise field_error(MetricError, "values", type_tag(values), "is not a list of numbers",
                              "pass the observations, e.g. [1.0, 0.0]")
        xs = [as_real(f"values[{i}]", x) for i, x in enumerate(values)]
        if reduction == "mean":
            return cls(_fsum("values", xs), len(xs), reduction)
        extreme = (min if reduction == "min" else max)(xs) if xs else 0.0
        return cls(extreme, len(xs), reduction)


def merge_metrics(items: Any, key: str = "metric") -> Metric:
    """Combine records of one metric from several ranks (exactly-rounded sums)."""
    if not isinstance(items, (list, tuple)) or not items:
        raise field_error(MetricError, key, type_tag(items) if not isinstance(items, (list, tuple))
                          else [], "has no records to merge", "pass a non-empty list of Metric")
    odd = next((i for i, m in enumerate(items) if not isinstance(m, Metric)), None)
    if odd is not None:
        raise field_error(MetricError, f"{key}[{odd}]", type_tag(items[odd]), "is not a Metric",
                          "wrap each rank's value as Metric(sum, count, reduction)")
    reductions = {m.reduction for m in items}
    if len(reductions) > 1:
        raise field_error(MetricError, key, sorted(reductions),
                          "is reported with different reductions on different ranks",
                          "use the same reduction for a key on every rank")
    reduction = items[0].reduction
    count = _fsum(f"{key}.count", (m.count for m in items))
    if reduction == "mean":
        return Metric(_fsum(f"{key}.sum", (m.sum for m in items)), count, "mean")
    seen = [m.sum for m in items if m.count > 0]
    extreme = (min if reduction == "min" else max)(seen) if seen else 0.0
    return Metric(extreme, count, reduction)


def _check_same_keys(per_rank: Any, field: str = "per_rank") -> None:
    if not isinstance(per_rank, (list, tuple)) or not per_rank:
        raise field_error(MetricError, field, type_tag(per_rank) if not isinstance(
            per_rank, (list, tuple)) else [], "is not a non-empty list", "pass one dict per rank")
    for rank, d in enumerate(per_rank):
        if not isinstance(d, Mapping):
            raise field_error(MetricError, f"{field}[{rank}]", type_tag(d), "is not a dict",
                              "pass one {name: value} dict per rank")
        odd = next((k for k in d if not isinstance(k, str)), None)
        if odd is not None:
            raise field_error(MetricError, f"{field}[{rank}] key", odd, "is not a str",
                              "name every metric with a string")
    reference = set(per_rank[0])
    for rank, d in enumerate(per_rank[1:], start=1):
        if set(d) != reference:
            missing, extra = sorted(reference - set(d)), sorted(set(d) - reference)
            raise MetricError(
                f"per_rank[{rank}] has different metric keys than per_rank[0]: missing "
                f"{missing}, extra {extra}. Fix: report every key on every rank (use "
                "Metric(0.0, 0.0) where a rank saw no data) so that collectives line up.")


def reduce_metrics(per_rank: Any) -> dict[str, Metric]:
    """Reduce per-rank metric dicts key by key; a typed error when key sets differ.

    ``per_rank``: a list of ``{name: Metric}`` dicts, one per rank (typed loosely: a user
    boundary; a plain float instead of a ``Metric`` is a ``MetricError`` naming it).
    """
    _check_same_keys(per_rank)
    for rank, d in enumerate(per_rank):
        odd = next((k for k, m in d.items() if not isinstance(m, Metric)), None)
        if odd is not None:
            raise field_error(MetricError, f"per_rank[{rank}][{odd!r}]", type_tag(d[odd]),
                              "is not a Metric", "wrap the value as Metric(sum, count), e.g. "
                              "Metric.of(values)")
    return {k: merge_metrics([d[k] for d in per_rank], k) for k in sorted(per_rank[0])}


def metric_values(metrics: Any) -> dict[str, float | None]:
    """Read the reported numbers. Example: ``{"r": Metric(2, 4), "e": Metric(0, 0)}`` ->
    ``{"r": 0.5, "e": None}``."""
    _check_same_keys([metrics], "metrics")
    odd = next((k for k, m in metrics.items() if not isinstance(m, Metric)), None)
    if odd is not None:
        raise field_error(MetricError, f"metrics[{odd!r}]", type_tag(metrics[odd]),
                          "is not a Metric", "pass {name: Metric(sum, count)}")
    return {k: m.value for k, m in metrics.items()}


def reduce_train_step(values: Any, G_s: Any, mode: Any, cp: Any = 1, *,
                      num_samples: Any = None, tokens: Any = None) -> dict[str, float | None]:
    """The train-step report of loss-like keys, identical for any split of the step.

    ``values`` holds, per rank of the DP x CP group, the sum over its micro-batches of
    ``microbatch_loss`` partial numerators, one key per reported quantity (``loss``, ``pg``,
    ``kl``, ``entropy``, ``clipfrac``...). The report of key ``k`` is
    ``sum_ranks(values[k]) / step_divisor(mode, G_s, num_samples)``. CP ranks hold disjoint
    token shards scored over full denominators, so no ``cp`` correction applies; ``cp`` only
    checks that every CP rank contributed (``len(values)`` is a multiple of ``cp``).
    ``tokens``: the step's scored tokens over all ranks, when known; 0 makes every key None
    (a step whose every token is masked measured no loss, entropy or clip fraction).
    Example: ``group_token_mean``, G_s=2, partials ``[{"loss": 21/9}, {"loss": 24/9 + 11}]``
    -> ``{"loss": 8.0}``; with ``tokens=0`` -> ``{"loss": None}``.
    """
    divisor = step_divisor(mode, G_s, num_samples)
    cp = as_int("cp", cp, 1, LossConfigError, "pass the context-parallel size")
    _check_same_keys(values, "values")
    if len(values) % cp:
        raise field_error(MetricError, "values", Shown(f"<{len(values)} ranks>"),
                          f"is not a multiple of cp={cp}: some CP rank's partial is missing",
                          "gather from the whole DP x CP group")
    sums = {k: _fsum(k, [as_real(f"values[{r}][{k!r}]", d[k]) for r, d in enumerate(values)])
            for k in sorted(values[0])}
    if tokens is not None and as_real("tokens", tokens, LossConfigError) == 0:
        return dict.fromkeys(sums)
    return {k: total / divisor for k, total in sums.items()}


def weighted_mean(values: Any, weights: Any, field: str = "values") -> float | None:
    """The ``weights``-weighted mean of the values that exist (None entries have no value and
    no weight); None when none exists. Example: ``weighted_mean([0.2, None, 0.6], [3, 5, 1])
    == 0.3``; ``weighted_mean([None], [4]) is None``."""
    for name, seq in ((field, values), ("weights", weights)):
        if not isinstance(seq, (list, tuple)):
            raise field_error(MetricError, name, type_tag(seq), "is not a list",
                              "pass one entry per step")
    if len(values) != len(weights):
        raise field_error(MetricError, "weights", Shown(f"<{len(weights)} weights>"),
                          f"do not match the {len(values)} values", "pass one weight per value")
    pairs = [(as_real(f"{field}[{i}]", v), as_real(f"weights[{i}]", w))
             for i, (v, w) in enumerate(zip(values, weights)) if v is not None]
    total = _fsum(f"{field}.weights", (w for _, w in pairs))
    return Metric(_fsum(field, (v * w for v, w in pairs)), total).value if pairs else None
