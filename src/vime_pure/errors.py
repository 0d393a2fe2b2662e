"""Typed errors of the functional core.

Every rejected input raises a subclass of :class:`VimeError` (itself a ``ValueError``) whose
message names the field, the offending value and the change that would fix it.
"""

import re
from typing import TypeVar


class VimeError(ValueError):
    """Base class of every error vime raises for bad input or an infeasible configuration.

    The message is one line whatever values it quotes (an array's repr spans lines): the CLI
    prints it as the single line of a failed command.
    """

    def __init__(self, message: str = "", *args: object) -> None:
        super().__init__(re.sub(r"\s*\n\s*", " ", str(message)), *args)


class ScheduleError(VimeError):
    """A workload, layout or policy that cannot be scheduled, with the reason and the fix."""


# field_error returns the class it was given, so a caller typed to return a subclass stays typed.
_Error = TypeVar("_Error", bound=VimeError)


def field_error(cls: type[_Error], field: str, value: object, problem: str, fix: str) -> _Error:
    """Build ``cls`` with the house format: ``field=value: problem. Fix: fix.``

    The value is shown on one line, at most 120 characters (an array's repr spans lines).
    """
    return cls(f"{field}={one_line(repr(value))}: {problem}. Fix: {fix}.")


def one_line(text: str, limit: int = 120) -> str:
    """``text`` without line breaks, cut to ``limit`` characters."""
    flat = re.sub(r"\s*\n\s*", " ", text)
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def relayed(what: str, failures: list[tuple[str, str]], fix: str) -> str:
    """One line for failures other ranks reported: the first in full, keeping its own ``Fix:``
    (the others are named only), so the line never holds two; ``fix`` when it has none.

    Example: ``relayed("rollout 3", [("engine 1 (rank 1)", "RewardError: r=nan: is not finite.
    Fix: clip it."), ("engine 2 (rank 2)", "...")], "see that rank's log")`` is ``"rollout 3
    failed on engine 1 (rank 1) (and on engine 2 (rank 2)): RewardError: r=nan: is not finite.
    Fix: clip it."``.
    """
    (where, message), others = failures[0], [w for w, _ in failures[1:]]
    also = f" (and on {', '.join(others)})" if others else ""
    text = f"{what} failed on {where}{also}: {one_line(message, 2000).rstrip('. ')}"
    return f"{text}." if "Fix:" in message else f"{text}. Fix: {fix}."


class Shown(str):
    """A value ``field_error`` shows as written, without quotes: ``Shown("<generator>")``."""

    def __repr__(self) -> str:
        return str(self)


def type_tag(value: object) -> Shown:
    """``<typename>``, for values whose repr would be long or useless (``<generator>``)."""
    return Shown(f"<{type(value).__name__}>")


class RolloutValidationError(VimeError):
    """A rollout function's output (nesting, ids, masks, tokens, rewards) is malformed."""


class RewardError(VimeError):
    """Rewards that cannot be normalised: missing, non-finite, or unequal among siblings."""


class RolloutBatchError(VimeError):
    """Columns of a ``RolloutBatch`` or ``TrainMicroBatch`` that disagree in dtype, shape or value."""


class DumpFormatError(VimeError):
    """A rollout dump that is truncated, corrupt, of another version, or holds an invalid batch."""


class LossConfigError(VimeError):
    """A loss mode, divisor, denominator choice or scale input that cannot be used."""


class MetricError(VimeError):
    """Metric records or per-rank metric dicts that cannot be reduced together."""


class CPConfigError(VimeError):
    """A context-parallel rank/size or sample length that cannot be laid out."""


class ScheduleInvariantError(VimeError):
    """A ``Schedule`` broke one of its invariants (a bug: please report it)."""


class FlopsModelError(VimeError):
    """A model config from which per-sample FLOPs cannot be estimated."""


class MemoryEstimateError(VimeError):
    """Sizes from which per-GPU memory cannot be estimated (a layout that does not divide)."""


def type_check_error(cls: type[VimeError], where: str, exc: Exception, fix: str) -> VimeError:
    """One line from jaxtyping's multi-line ``TypeCheckError``: the parameter, its value, the
    expected type and the axis sizes bound so far.

    Example: ``microbatch_loss: loss_mask=f32[2](torch): is not a Float[Tensor, 't'] (axes:
    t=3). Fix: ...``.
    """
    text = str(exc)
    param = re.search(r"parameter '(\w+)'", text)
    actual = re.search(r"^Actual value: (.*)$", text, flags=re.M)
    expected = re.search(r"^Expected type: (?:<class ')?(.*?)(?:'>)?\.?$", text, flags=re.M)
    axes = ", ".join(re.findall(r"^(\w+=\d+)$", text, flags=re.M))
    name = param.group(1) if param else "return value"
    value = actual.group(1)[:80] if actual else "?"
    want = expected.group(1) if expected else "the annotated type"
    return cls(f"{where}: {name}={value}: is not a {want}" + (f" (axes: {axes})" if axes else "")
               + f". Fix: {fix}.")
