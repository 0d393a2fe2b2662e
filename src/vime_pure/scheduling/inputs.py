"""Validation of per-sample scheduler inputs, with errors that name the field, value and fix.

Example: ``as_lengths([900, 300, 2.5])`` raises ``lengths[2]=2.5: is a float ...`` (the
position of the first bad entry, never 0 by default); ``as_lengths(np.array([2**64 - 1],
dtype=np.uint64))`` reports 18446744073709551615, not the -1 an int64 cast would show.
"""

from typing import Any

import numpy as np
from jaxtyping import Float64, Int64

from vime_pure.errors import ScheduleError, Shown, field_error, type_tag

# Far above any context length, far below where a step's token sum could overflow int64.
MAX_LENGTH = 2**40
_LENGTH_FIX = "pass integer token counts (prompt + response tokens), one per sample"


def as_lengths(lengths: Any) -> Int64[np.ndarray, " n"]:
    """Per-sample token counts as int64; every entry an integer in ``[1, MAX_LENGTH]``."""
    if isinstance(lengths, np.ndarray):
        if lengths.ndim != 1:
            raise field_error(ScheduleError, "lengths.shape", lengths.shape, "is not 1-D",
                              "pass a flat sequence of ints, one token count per sample")
        if lengths.dtype.kind in "iu":
            return _bounded(lengths)
        if lengths.dtype.kind != "O":
            first = lengths[:1].tolist()[0] if lengths.size else None
            raise field_error(ScheduleError, "lengths", Shown(f"<{lengths.dtype} array>"),
                              f"is not an integer array (lengths[0]={first!r})", _LENGTH_FIX)
        items = lengths.tolist()
    elif isinstance(lengths, (list, tuple, range)):
        items = lengths
    else:
        raise field_error(ScheduleError, "lengths", type_tag(lengths),
                          "is not a list, tuple or 1-D integer array", _LENGTH_FIX)
    if not set(map(type, items)) <= {int}:
        for i, v in enumerate(items):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise field_error(ScheduleError, f"lengths[{i}]", v,
                                  f"is a {type(v).__name__}, not an integer", _LENGTH_FIX)
        items = [int(v) for v in items]
    if items and (max(items) > MAX_LENGTH or min(items) < 1):
        _bounded(np.array([min(max(v, 0), MAX_LENGTH + 1) for v in items], dtype=np.int64),
                  items)
    return np.array(items, dtype=np.int64).reshape(-1)


def _bounded(arr: np.ndarray, original: Any = None) -> Int64[np.ndarray, " n"]:
    """``arr`` as int64 once every entry is in ``[1, MAX_LENGTH]``; errors show the original
    value (a uint64 ``2**64 - 1`` is not reported as the ``-1`` of an int64 cast)."""
    if arr.size:
        bad = (arr < 1) | (arr > MAX_LENGTH)
        if bad.any():
            i = int(np.argmax(bad))
            value = (original if original is not None else arr.tolist())[i]
            problem = ("is not positive: every sample needs at least one token" if value < 1 else
                       f"exceeds {MAX_LENGTH} (2**40) tokens: a unit or overflow bug")
            raise field_error(ScheduleError, f"lengths[{i}]", value, problem,
                              "filter out empty samples and pass real token counts")
    return arr.astype(np.int64, copy=False)


def as_flops(flops: Any, n: int) -> Float64[np.ndarray, " n"]:
    """Per-sample workload estimates as float64: finite and non-negative, one per sample."""
    try:
        arr = np.asarray(flops, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ScheduleError(f"flops could not be read as numbers ({exc}). "
                            "Fix: pass one float per sample.") from None
    if arr.shape != (n,):
        raise ScheduleError(f"flops has shape {arr.shape} but there are {n} samples. "
                            "Fix: pass one workload estimate per sample, or flops=None.")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        raise ScheduleError(f"flops[{int(bad[0])}]={float(arr[bad[0]])!r} is negative or not "
                            "finite. Fix: pass finite, non-negative workload estimates.")
    return arr


def check_same_length(lengths: np.ndarray, group_ids: np.ndarray) -> None:
    if len(group_ids) != len(lengths):
        raise ScheduleError(f"group_ids has {len(group_ids)} entries but lengths has "
                            f"{len(lengths)}. Fix: pass one group id per sample.")
