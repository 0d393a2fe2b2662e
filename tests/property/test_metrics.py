"""Properties of count-weighted metrics: exact reduction across any split of the data.

Merging is associative and commutative (to rounding), reducing per-rank dicts equals a single
rank computing over the union, empty means read 0.0, and mismatched key sets are typed errors.
"""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.loss_helpers import assert_metric_invariants
from vime_pure import Metric, MetricError, merge_metrics, metric_values, reduce_metrics

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
reductions = st.sampled_from(["mean", "min", "max"])


@st.composite
def observations_split(draw):
    """Observations per key, and a split of them over 1-5 ranks (ranks may be empty)."""
    keys = draw(st.lists(st.sampled_from(["reward", "len", "ent", "kl"]), min_size=1,
                         max_size=4, unique=True))
    kinds = {k: draw(reductions) for k in keys}
    data = {k: draw(st.lists(finite, max_size=12)) for k in keys}
    ranks = draw(st.integers(1, 5))
    owner = {k: draw(st.lists(st.integers(0, ranks - 1), min_size=len(data[k]),
                              max_size=len(data[k]))) for k in keys}
    return kinds, data, ranks, owner


def per_rank_dicts(kinds, data, ranks, owner):
    return [{k: Metric.of([x for x, o in zip(data[k], owner[k]) if o == r], kinds[k])
             for k in kinds} for r in range(ranks)]


def _same(a, b) -> bool:
    """Equal to rounding, or both None (no observation on either side)."""
    return a is None and b is None or a is not None and b is not None and \
        a == pytest.approx(b, rel=1e-9, abs=1e-6)


@given(observations_split())
def test_reduction_equals_single_rank_computation(case):
    """Means reduce through (sum, count), which add over any split; min and max are
    associative and commutative; so reducing ranks gives the union's value (to rounding)."""
    kinds, data, ranks, owner = case
    reduced = reduce_metrics(per_rank_dicts(kinds, data, ranks, owner))
    single = {k: Metric.of(data[k], kinds[k]) for k in kinds}
    assert reduced.keys() == single.keys()
    for k in kinds:
        assert_metric_invariants(reduced[k])
        assert reduced[k].count == single[k].count
        assert _same(reduced[k].value, single[k].value)


@given(st.lists(st.tuples(finite, st.integers(0, 5)), min_size=3, max_size=8),
       reductions, st.randoms(use_true_random=False))
def test_merge_is_associative_and_commutative(items, reduction, rnd):
    """Merging adds sums and counts (mean) or takes the extremum of non-empty parts (min/max),
    and both operations are associative and commutative (to rounding)."""
    ms = [Metric(s if reduction == "mean" else (s if c else 0.0), c, reduction) for s, c in items]
    left = merge_metrics([merge_metrics(ms[:2]), *ms[2:]])
    right = merge_metrics([ms[0], merge_metrics(ms[1:])])
    shuffled = list(ms)
    rnd.shuffle(shuffled)
    for other in (right, merge_metrics(shuffled)):
        assert other.count == left.count
        assert _same(other.value, left.value)


@given(st.lists(finite, min_size=1, max_size=20), st.integers(1, 6))
def test_uneven_split_reduces_to_the_overall_mean(values, ranks):
    """The count-weighted mean of the parts' means is sum / count of the whole, however
    unevenly the values are split (a plain mean of the parts' means would not be)."""
    parts = [values[r::ranks] for r in range(ranks)]
    reduced = reduce_metrics([{"x": Metric.of(p)} for p in parts])["x"]
    assert reduced.value == pytest.approx(math.fsum(values) / len(values), rel=1e-9, abs=1e-6)


@given(observations_split(), st.data())
def test_differing_key_sets_raise_typed_error(case, data):
    """``reduce_metrics`` compares every rank's key set with the first one's, so one extra key
    on any rank raises MetricError."""
    kinds, obs, ranks, owner = case
    dicts = per_rank_dicts(kinds, obs, ranks, owner)
    bad = data.draw(st.integers(0, len(dicts) - 1))
    dicts[bad] = {**dicts[bad], "only_here": Metric(1.0, 1.0)}
    if len(dicts) == 1:
        dicts.append({})
    with pytest.raises(MetricError, match="missing|extra"):
        reduce_metrics(dicts)


def test_empty_mean_has_no_value_and_extrema_skip_empty_ranks():
    reduced = reduce_metrics([{"r": Metric(0.0, 0.0), "m": Metric(0.0, 0.0, "max")},
                              {"r": Metric(0.0, 0.0), "m": Metric(-3.0, 2.0, "max")}])
    assert metric_values(reduced) == {"m": -3.0, "r": None}  # a mean over nothing: null


def test_same_key_with_different_reductions_is_rejected():
    with pytest.raises(MetricError, match="different reductions"):
        reduce_metrics([{"x": Metric(1.0, 1.0, "mean")}, {"x": Metric(1.0, 1.0, "max")}])


@pytest.mark.parametrize("kwargs, field", [
    (dict(sum=1.0, count=-1.0), "count"),
    (dict(sum=float("nan"), count=1.0), "sum"),
    (dict(sum=1.0, count=1.0, reduction="median"), "reduction"),
])
def test_invalid_metric_records_name_the_field(kwargs, field):
    with pytest.raises(MetricError, match=rf"^{field}="):
        Metric(**kwargs)
