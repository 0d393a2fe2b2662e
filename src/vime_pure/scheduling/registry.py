"""Kernel sets: the pure-Python kernels, or their numba twins when ``vime[fast]`` is installed.

Both sets speak one flat form for bins: ``(items, offsets)``, bin ``b`` is
``items[offsets[b]:offsets[b + 1]]``. The pure set wraps ``vime_pure.scheduling.kernels`` and
``rank_balance`` (the oracle); the compiled set is ``compiled_kernels``, ``compiled_balance``
(the straggler policy) and ``compiled_steps`` (``plan_steps``: every step of a batch in one
call, one compiled loop per policy), imported the first time ``kernel_set()`` is asked for it,
never at ``import vime_pure``. Both give bit-identical schedules (property-tested), so the
choice changes only the speed.

Choice: ``VIME_KERNELS=pure`` or ``VIME_KERNELS=compiled`` in the environment forces a set
(CI runs the scheduler suites both ways; ``compiled`` without numba is an error naming the fix).
Otherwise the compiled set runs when numba is importable and the batch has at least
``COMPILED_MIN_SAMPLES`` samples. Why the size rule: the first compiled schedule compiles the
kernels of its policy once (CPU on this 2-core machine: 17-27 s for FFD or FLOPs packing,
43-49 s for the straggler balance, then well under 1 s from numba's disk cache), while
below 8192 samples the pure kernels plan a batch in under about 30 ms; so a demo, a small run
or a test never pays the compile, and a large batch, where the kernels save 5-10x per
rollout, pays it once. The loaded set is memoised: compiling twice would only cost time.

Example: ``kernel_set("pure").ffd(np.array([300, 800, 200, 700]), 1000)`` gives
``(array([1, 2, 3, 0]), array([0, 2, 4]))``.
"""

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from itertools import chain

import attrs
import numpy as np

from vime_pure.errors import ScheduleError
from vime_pure.scheduling import kernels, rank_balance

Flat = tuple[np.ndarray, np.ndarray]  # (items, offsets)
KERNEL_SETS: tuple[str, ...] = ("pure", "compiled")


def to_flat(bins: kernels.Bins) -> Flat:
    """``[[1, 2], [3]]`` -> ``(array([1, 2, 3]), array([0, 2, 3]))``."""
    sizes = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    items = np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=int(offsets[-1]))
    return items, offsets


def to_bins(flat: Flat) -> kernels.Bins:
    items, offsets = flat[0].tolist(), flat[1].tolist()
    return [items[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


@attrs.frozen(kw_only=True)
class KernelSet:
    """The scheduler's kernels, all in flat form (see the module docstring)."""

    name: str
    ffd: Callable[[np.ndarray, int], Flat]
    ffd_sorted: Callable[[np.ndarray, np.ndarray, int], Flat]
    first_fit: Callable[[np.ndarray, int], Flat]
    flops_pack: Callable[[np.ndarray, np.ndarray, int, int], Flat]
    split_to_count: Callable[[Flat, np.ndarray, int], Flat | None]
    karmarkar_karp: Callable[[np.ndarray, int], np.ndarray]  # [parts, k / parts] positions
    lpt_ranks: Callable[[np.ndarray, np.ndarray, int], np.ndarray]  # (work, bounds, dp)
    # (order, ranks, sizes, work, cap, dp, multiple) -> ((items, offsets), per-rank count)
    balance_step: Callable[..., tuple[Flat, int] | None]
    # Every step in one call (``compiled_steps.plan_steps``), or None: the planner's loop.
    plan_steps: Callable[..., tuple | None] | None = None


def _pure_split(flat: Flat, sizes: np.ndarray, target: int) -> Flat | None:
    out = kernels.split_to_count(to_bins(flat), sizes, target)
    return None if out is None else to_flat(out)


def _pure_balance(order: np.ndarray, ranks: np.ndarray, sizes: np.ndarray, work: np.ndarray,
                  cap: int, dp: int, multiple: int) -> tuple[Flat, int] | None:
    out = rank_balance.balance_step(order, ranks, sizes, work, cap, dp, multiple)
    return None if out is None else (to_flat(out[1]), len(out[0][0]))


PURE = KernelSet(
    name="pure",
    ffd=lambda sizes, cap: to_flat(kernels.first_fit_decreasing(sizes, cap)),
    ffd_sorted=lambda order, sizes, cap: to_flat(
        kernels.ffd_sorted(order.tolist(), sizes.tolist(), cap)),
    first_fit=lambda sizes, cap: to_flat(kernels.first_fit(sizes, cap)),
    flops_pack=lambda sizes, work, cap, num_bins: to_flat(
        kernels.flops_balanced_pack(sizes, work, cap, num_bins)),
    split_to_count=_pure_split,
    karmarkar_karp=lambda weights, parts: np.asarray(
        kernels.karmarkar_karp_equal(weights, parts), dtype=np.int64).reshape(parts, -1),
    lpt_ranks=rank_balance.lpt_ranks,
    balance_step=_pure_balance,
)


def numba_available() -> bool:
    return importlib.util.find_spec("numba") is not None


@functools.cache
def _compiled() -> KernelSet:
    mod = importlib.import_module("vime_pure.scheduling.compiled_kernels")
    balance = importlib.import_module("vime_pure.scheduling.compiled_balance")
    steps = importlib.import_module("vime_pure.scheduling.compiled_steps")
    return KernelSet(name="compiled", ffd=mod.ffd_flat, ffd_sorted=mod.ffd_sorted_flat,
                     first_fit=mod.first_fit_flat,
                     flops_pack=mod.flops_pack_flat,
                     split_to_count=lambda flat, sizes, target: mod.split_to_count_flat(
                         flat[0], flat[1], sizes, target),
                     karmarkar_karp=mod.karmarkar_karp_parts, lpt_ranks=mod.lpt_ranks,
                     balance_step=balance.balance_step_flat, plan_steps=steps.plan_steps)


COMPILED_MIN_SAMPLES = 8192


def kernel_set(name: str | None = None, *, num_samples: int | None = None) -> KernelSet:
    """The named set, or the environment's choice (``VIME_KERNELS``), or by the batch's size:
    compiled for ``num_samples >= COMPILED_MIN_SAMPLES`` when numba is present (or for any size
    when ``num_samples`` is not given), pure otherwise. Example: ``kernel_set(num_samples=1024)``
    is ``PURE`` unless ``VIME_KERNELS=compiled``."""
    large = num_samples is None or num_samples >= COMPILED_MIN_SAMPLES
    choice = name or os.environ.get("VIME_KERNELS") or (
        "compiled" if large and numba_available() else "pure")
    if choice not in KERNEL_SETS:
        raise ScheduleError(f"VIME_KERNELS={choice!r}: is not a kernel set. Fix: use one of "
                            f"{list(KERNEL_SETS)}, or unset it.")
    if choice == "pure":
        return PURE
    if not numba_available():
        raise ScheduleError("VIME_KERNELS='compiled': numba is not installed. Fix: pip install "
                            "'vime[fast]', or unset VIME_KERNELS.")
    return _compiled()
