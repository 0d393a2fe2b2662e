"""Fuzz: ``Metric`` and the reductions (``reduce_metrics``, ``merge_metrics``,
``reduce_train_step``) on valid records and on plain dicts, floats, strings, NaN, inf, huge
values, mismatched keys and numpy scalars.

Success must reduce exactly like the single-rank computation and never produce a NaN; failure
a ``VimeError`` (``MetricError`` / ``LossConfigError``).
"""

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import REJECTED, close, no_nan, outcome
from tests.fuzz.strategies import JUNK, counts, or_junk
from vime_pure import LOSS_MODES, Metric, merge_metrics, reduce_metrics, reduce_train_step
from vime_pure.metrics import weighted_mean

NUMBERS = st.one_of(st.floats(-1e6, 1e6), st.integers(-10, 10), st.floats(-1e6, 1e6).map(
    np.float32), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308]))
REDUCTIONS = or_junk(st.sampled_from(["mean", "min", "max"]))


@given(or_junk(NUMBERS), or_junk(st.one_of(st.integers(0, 9), st.floats(-1, 9))), REDUCTIONS)
def test_metric(total, count, reduction):
    m = outcome("Metric", Metric, total, count, reduction)
    if m is not REJECTED:
        assert isinstance(m.sum, float) and isinstance(m.count, float)
        no_nan(m.value)


@st.composite
def per_rank(draw):
    """Per-rank ``{key: Metric}`` dicts, sometimes with a plain number, a missing key, a
    non-str key or a reduction that differs between ranks."""
    keys = draw(st.lists(st.sampled_from(["loss", "reward", "len"]), min_size=1, max_size=3,
                         unique=True))
    reduction = draw(st.sampled_from(["mean", "min", "max"]))
    ranks = [{k: Metric(draw(st.floats(-100, 100)), draw(st.integers(0, 5)), reduction)
              for k in keys} for _ in range(draw(st.integers(1, 4)))]
    bad = draw(st.sampled_from([None, None, "plain", "key", "odd_key", "reduction", "junk"]))
    if bad == "plain":
        ranks[-1][keys[0]] = draw(NUMBERS)
    elif bad == "key":
        ranks[-1].pop(keys[0])
    elif bad == "odd_key":
        ranks[-1][7] = Metric(1.0, 1.0)
    elif bad == "reduction":
        ranks[-1][keys[0]] = Metric(1.0, 1.0, "max" if reduction == "mean" else "mean")
    elif bad == "junk":
        return draw(st.one_of(JUNK, st.just(ranks[0])))
    return ranks


@given(per_rank())
def test_reduce_metrics(ranks):
    out = outcome("reduce_metrics", reduce_metrics, ranks)
    if out is not REJECTED:
        for key, m in out.items():
            no_nan(m.value)
            assert close(m.count, sum(r[key].count for r in ranks))
            if m.reduction == "mean":
                assert close(m.sum, math.fsum(r[key].sum for r in ranks))


@given(or_junk(st.lists(or_junk(st.builds(Metric, st.floats(-9, 9), st.integers(0, 4))),
                       max_size=4)))
def test_merge_metrics(items):
    m = outcome("merge_metrics", merge_metrics, items)
    if m is not REJECTED:
        no_nan(m.value)


@st.composite
def partials(draw):
    keys = draw(st.lists(st.sampled_from(["loss", "pg_loss", "kl"]), min_size=1, max_size=3,
                         unique=True))
    ranks = [{k: draw(st.floats(-50, 50)) for k in keys} for _ in range(draw(st.integers(1, 4)))]
    bad = draw(st.sampled_from([None, None, None, "value", "key", "junk"]))
    if bad == "value":
        ranks[0][keys[0]] = draw(st.one_of(NUMBERS, JUNK))
    elif bad == "key":
        ranks[0]["extra"] = 1.0
    elif bad == "junk":
        return draw(JUNK)
    return ranks


@given(partials(), counts(1, 8), or_junk(st.sampled_from(LOSS_MODES)), counts(1, 2),
       st.one_of(st.none(), counts(1, 9)))
def test_reduce_train_step(values, groups, mode, cp, samples):
    out = outcome("reduce_train_step", reduce_train_step, values, groups, mode, cp,
                  num_samples=samples)
    if out is not REJECTED:
        no_nan(out)
        assert set(out) == set(values[0])


@given(or_junk(st.lists(or_junk(st.one_of(st.none(), st.floats(-9, 9))), max_size=4)),
       or_junk(st.lists(st.integers(0, 5), max_size=4)))
def test_weighted_mean(values, weights):
    m = outcome("weighted_mean", weighted_mean, values, weights)
    if m is not REJECTED:  # None exactly when no value carries weight
        assert m is None or math.isfinite(m)
        assert (m is None) == (sum(w for v, w in zip(values, weights) if v is not None) == 0)
