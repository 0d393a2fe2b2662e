"""Shared Hypothesis strategies of the fuzz harness: valid values most of the time, and every
kind of bad one: wrong types, NaN and inf, negatives, huge values, numpy scalars, mismatched
lengths; file corruptions (truncation, bit flips) live with the file tests.

Each ``*_or_junk`` strategy draws the valid kind about three times in four, so most examples
get past the first check and exercise the later ones.
"""

import numpy as np
from hypothesis import strategies as st

NUMPY_SCALARS = st.sampled_from([
    np.int64(3), np.int8(-1), np.uint64(2**64 - 1), np.float32("nan"), np.float64("inf"),
    np.float64(1.0), np.bool_(True), np.str_("a"), np.complex128(1j)])


def _generator():
    return (k for k in range(3))


# Values of the wrong kind for almost any parameter.
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.binary(max_size=4), NUMPY_SCALARS, st.lists(st.integers(-3, 3), max_size=3),
    st.tuples(st.integers(-3, 3)), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.builds(object), st.builds(_generator), st.just(np.zeros((2, 2))))


def mostly(valid: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` three times in four, else ``bad``. (``st.one_of(v, v, v, bad)`` would not do:
    Hypothesis flattens nested ``one_of``s, so the many branches of ``JUNK`` would win.)"""
    # Hypothesis draws small integers more often, so the last value is the bad branch.
    return st.integers(0, 3).flatmap(lambda k: bad if k == 3 else valid)


def or_junk(valid: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` three times in four, else ``JUNK``."""
    return mostly(valid, JUNK)


def good_ints(lo: int, hi: int) -> st.SearchStrategy:
    """Integers in ``[lo, hi]``, as Python or numpy ints."""
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), st.integers(lo, hi).map(np.int64))


def bad_ints(lo: int) -> st.SearchStrategy:
    """Below ``lo``, absurdly large, or not an integer at all."""
    return st.one_of(st.integers(-5, lo - 1), st.integers(2**62, 2**70), JUNK)


def good_reals(lo: float, hi: float) -> st.SearchStrategy:
    return st.one_of(st.floats(lo, hi), st.floats(lo, hi).map(np.float64))


BAD_REALS = st.one_of(st.sampled_from([float("nan"), float("inf"), -1.0, 1e308, -1e308]), JUNK)


def counts(lo: int = 1, hi: int = 8) -> st.SearchStrategy:
    """Mostly ``good_ints(lo, hi)``, sometimes ``bad_ints(lo)``."""
    return mostly(good_ints(lo, hi), bad_ints(lo))


def reals(lo: float, hi: float) -> st.SearchStrategy:
    """Mostly ``good_reals(lo, hi)``, sometimes NaN, inf, negative, huge or junk."""
    return mostly(good_reals(lo, hi), BAD_REALS)


@st.composite
def one_bad(draw, valid: dict, bad: dict | None = None) -> dict:
    """Keyword arguments: all drawn from ``valid``, or (half the time) with exactly one
    replaced by a draw from ``bad[name]`` (default ``JUNK``), so a rejection is attributable
    and half the examples get past every check."""
    kwargs = {name: draw(strategy) for name, strategy in valid.items()}
    if kwargs and draw(st.booleans()):
        name = draw(st.sampled_from(sorted(kwargs)))
        kwargs[name] = draw((bad or {}).get(name, JUNK))
    return kwargs


GOOD_ID = st.one_of(st.integers(-5, 5), st.text("ab", max_size=2), st.none(),
                    st.integers(0, 5).map(np.int64))
BAD_ID = st.sampled_from([1.0, True, float("nan"), (1,), b"a", np.float64(2.0), np.bool_(False)])
GROUP_ID = mostly(GOOD_ID, BAD_ID)


@st.composite
def id_lists(draw, n: int):
    """``n`` valid group ids: ints, strs, None (its own group) or numpy ints, as a list, a
    tuple or an integer / str array."""
    kind = draw(st.sampled_from(["ints", "mixed", "array"]))
    if kind == "ints":
        return draw(st.lists(st.integers(0, max(n // 2, 1)), min_size=n, max_size=n))
    if kind == "mixed":
        ids = draw(st.lists(GOOD_ID, min_size=n, max_size=n))
        return tuple(ids) if draw(st.booleans()) else ids
    dtype = draw(st.sampled_from([np.int64, np.uint64, np.int32, str]))
    return np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), dtype=dtype)


@st.composite
def bad_id_lists(draw, n: int):
    """Ids with one that would merge groups (float, bool, NaN) or is no id (tuple, bytes), an
    array of floats or bools, a wrong length, or no sequence at all."""
    kind = draw(st.sampled_from(["entry", "array", "length", "junk"]))
    ids = draw(id_lists(n))
    if kind == "entry" and n:
        ids = list(ids.tolist() if isinstance(ids, np.ndarray) else ids)
        ids[draw(st.integers(0, n - 1))] = draw(BAD_ID)
        return ids
    if kind == "array":
        return np.zeros(n, dtype=draw(st.sampled_from([np.float64, np.bool_, np.complex64])))
    if kind == "length":
        return list(range(n + draw(st.sampled_from([-1, 1]))) if n else [0])
    return draw(JUNK)


def length_lists(n: int) -> st.SearchStrategy:
    """``n`` valid token counts, as a list or an integer array."""
    good = st.lists(st.integers(1, 300), min_size=n, max_size=n)
    return st.one_of(good, good.map(lambda v: np.array(v, dtype=np.uint64)),
                     good.map(lambda v: np.array(v, dtype=np.int32)))


@st.composite
def bad_length_lists(draw, n: int):
    """Token counts with a float, bool, zero, negative, huge or NaN entry, a float or bool
    array, a wrong length, or no sequence at all."""
    kind = draw(st.sampled_from(["entry", "array", "length", "junk"]))
    lengths = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    if kind == "entry" and n:
        lengths[draw(st.integers(0, n - 1))] = draw(st.sampled_from(
            [2.5, True, 0, -3, 2**64 - 1, 2**80, None, "7", np.uint64(2**64 - 1), float("nan")]))
        return lengths
    if kind == "array":
        return np.array(lengths, dtype=draw(st.sampled_from([np.float64, np.bool_, object])))
    if kind == "length":
        return lengths + [1] if draw(st.booleans()) or not n else lengths[:-1]
    return draw(JUNK)


@st.composite
def masks(draw, n: int, length: int | None = None):
    """``n`` valid 0/1 masks: lists of ints, floats or bools, or arrays."""
    out = []
    for _ in range(n):
        k = draw(st.integers(0, 5)) if length is None else length
        values = draw(st.lists(st.sampled_from([0, 1]), min_size=k, max_size=k))
        kind = draw(st.sampled_from([int, float, bool, np.float32, np.uint8]))
        out.append(np.asarray(values, dtype=kind) if kind in (np.float32, np.uint8)
                   else [kind(v) for v in values])
    return out


@st.composite
def bad_masks(draw, n: int):
    """Masks with a 0.5, 2, -1, NaN or inf value, a str / int / None in place of a mask, one
    mask too few, or no list at all."""
    out = draw(masks(n))
    kind = draw(st.sampled_from(["value", "type", "count", "junk"]))
    if kind == "value" and any(len(m) for m in out):
        i = next(j for j, m in enumerate(out) if len(m))
        out[i] = [float(v) for v in out[i]]
        out[i][draw(st.integers(0, len(out[i]) - 1))] = draw(
            st.sampled_from([0.5, 2, -1, float("nan"), float("inf")]))
        return out
    if kind == "type" and out:
        out[draw(st.integers(0, n - 1))] = draw(st.sampled_from(["101", 1, None, {"a": 1}]))
        return out
    if kind == "count":
        return out[:-1] if out else [[1]]
    return draw(JUNK)
