"""The type boundary of the torch functions: shape and dtype checks that raise typed errors.

``@tensor_boundary`` is ``@jaxtyped(typechecker=beartype)`` (the annotations are checked on
every call, in production too) with its ``TypeCheckError``, a ``TypeError`` of many lines,
turned into one ``LossConfigError`` line naming the function, the parameter, its value and
the expected type. So a public torch function either runs or raises a ``VimeError``.

Example: ``microbatch_loss(torch.ones(3), torch.ones(2), ...)`` raises ``LossConfigError:
microbatch_loss: loss_mask=f32[2](torch): is not a Float[Tensor, 't'] (axes: t=3). Fix: ...``.
"""

import functools
import math
from collections.abc import Callable
from typing import TypeVar

from beartype import beartype
from jaxtyping import TypeCheckError, jaxtyped

from vime_pure.errors import LossConfigError, VimeError, field_error, type_check_error

F = TypeVar("F", bound=Callable)
FIX = ("pass torch tensors of the annotated dtypes (float values, integer indices), with "
       "equal lengths where the axis names match, and numbers for the scalar knobs")


def tensor_boundary(fn: F | None = None, *, error: type[VimeError] = LossConfigError):
    """Check ``fn``'s annotations on every call; a mismatch raises ``error``.

    Use as ``@tensor_boundary`` or ``@tensor_boundary(error=CPConfigError)``.
    """
    if fn is None:
        return functools.partial(tensor_boundary, error=error)
    checked = jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return checked(*args, **kwargs)
        except TypeCheckError as exc:
            raise type_check_error(error, fn.__name__, exc, FIX) from None

    return call


def knob(field: str, value: float | int, lo: float | int, hi: float | int, fix: str, *,
         lo_open: bool = False) -> float:
    """A scalar setting as a float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``): NaN, an int
    too large for a float, or a value outside the range is a ``LossConfigError`` (a Python int
    of 2**70 would otherwise overflow inside torch with a bare ``OverflowError``).

    Example: ``knob("cap", 2, 0, math.inf, "...", lo_open=True) == 2.0``.
    """
    try:
        number = float(value)
    except OverflowError:
        number = math.nan
    inside = (lo < number if lo_open else lo <= number) and number <= hi  # NaN fails both
    if not inside:
        band = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise field_error(LossConfigError, field, value, f"is not in {band}", fix)
    return number
