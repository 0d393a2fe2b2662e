"""Validation of per-sample scheduler inputs, with errors that name the field, value and fix."""

from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import Float64, Int64

from vime_pure.errors import ScheduleError


def as_lengths(lengths: Sequence[Any] | np.ndarray) -> Int64[np.ndarray, " n"]:
    """Per-sample token counts as int64; every entry must be a positive integer."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ScheduleError(f"lengths has shape {arr.shape}. Fix: pass a flat sequence of ints, "
                            "one total token count per sample.")
    if arr.size and not (np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_):
        bad = next((i for i, v in enumerate(arr.tolist())
                    if isinstance(v, bool) or not isinstance(v, int)), 0)
        raise ScheduleError(f"lengths[{bad}]={arr.tolist()[bad]!r} is not an integer. "
                            "Fix: pass integer token counts (prompt + response tokens).")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 1:
        bad = int(np.argmax(arr < 1))
        raise ScheduleError(f"lengths[{bad}]={int(arr[bad])} is not positive. Fix: every sample "
                            "needs at least one token; filter out empty samples before scheduling.")
    return arr


def as_flops(flops: Sequence[Any] | np.ndarray, n: int) -> Float64[np.ndarray, " n"]:
    """Per-sample workload estimates as float64: finite and non-negative, one per sample."""
    try:
        arr = np.asarray(flops, dtype=np.float64)
    except (TypeError, ValueError) as exc:
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


def check_same_length(lengths: np.ndarray, group_ids: Sequence[object] | np.ndarray) -> None:
    if len(group_ids) != len(lengths):
        raise ScheduleError(f"group_ids has {len(group_ids)} entries but lengths has "
                            f"{len(lengths)}. Fix: pass one group id per sample.")
