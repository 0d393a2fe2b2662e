"""The knobs of the policy objective, torch-free: clipping, KL, entropy and TIS settings.

The loss *mode* is not here: it selects the denominators ``rank_batch`` puts into the records
(``vime_pure.denominators.LossMode``), and the objective reads it from them.

Example: ``LossConfig(eps_clip=0.2, eps_clip_high=0.28, kl_coef=0.01, kl_kind="low_var_kl")``
is DAPO's clip-higher with slime's low-variance KL penalty.
"""

import math
import numbers
from typing import Literal, get_args

import attrs

from vime_pure.errors import LossConfigError, field_error

KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
KL_KINDS: tuple[str, ...] = get_args(KLKind)  # the choice list of --kl-loss-type


@attrs.frozen(kw_only=True)
class LossConfig:
    """Clip ``eps_clip`` / ``eps_clip_high`` (DAPO clip-higher) / ``dual_clip``; KL penalty
    ``kl_coef * kl_kind`` against the reference; entropy bonus ``entropy_coef``; truncated
    importance sampling weights ``min(exp(old - rollout), tis_clip)`` when ``use_tis``;
    ``sequence_ratio``: GSPO's sequence-level importance ratio instead of per-token ratios."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    sequence_ratio: bool = False

    def __attrs_post_init__(self) -> None:
        for name in LOSS_BOUNDS:
            value = getattr(self, name)
            if value is not None or name not in ("eps_clip_high", "dual_clip"):
                check_loss_knob(name, value)
        for name in ("use_tis", "sequence_ratio"):
            if not isinstance(getattr(self, name), bool):
                raise field_error(LossConfigError, name, getattr(self, name), "must be a bool",
                                  "pass True or False")
        if not isinstance(self.kl_kind, str) or self.kl_kind not in KL_KINDS:
            raise field_error(LossConfigError, "kl_kind", self.kl_kind, "is not a KL estimator",
                              f"use one of {KL_KINDS}")


@attrs.frozen
class Bound:
    """An interval of a scalar knob: ``(lo, hi)`` with each end open or closed."""

    lo: float
    hi: float
    lo_open: bool
    hi_open: bool
    fix: str

    def contains(self, x: float) -> bool:
        """NaN is outside every interval (both comparisons are False)."""
        above = self.lo < x if self.lo_open else self.lo <= x
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def text(self) -> str:
        return (f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.hi_open else ']'}")


# The one home of every loss knob's range: LossConfig checks it, TrainConfig reaches it by
# building a LossConfig, the torch functions' scalar arguments check against it too.
# eps_clip 0 would freeze the ratio band at [1, 1] (every gradient clipped away): open at 0.
LOSS_BOUNDS: dict[str, Bound] = {
    "eps_clip": Bound(0.0, 1.0, True, True, "use e.g. 0.2"),
    "eps_clip_high": Bound(0.0, 10.0, True, True, "use e.g. 0.28, or None for eps_clip"),
    "dual_clip": Bound(1.0, math.inf, True, True, "use e.g. 3.0, or None to disable it"),
    "kl_coef": Bound(0.0, math.inf, False, True, "use 0 to disable it"),
    "entropy_coef": Bound(0.0, math.inf, False, True, "use 0 to disable it"),
    "tis_clip": Bound(0.0, math.inf, True, False, "use e.g. 2.0 (inf: no truncation)"),
}


def check_loss_knob(name: str, value: object, *, field: str | None = None) -> float:
    """``value`` as a float inside ``LOSS_BOUNDS[name]``, else a ``LossConfigError`` naming
    ``field`` (default ``name``). Example: ``check_loss_knob("eps_clip", 0.2) == 0.2``;
    ``check_loss_knob("eps_clip", 0)`` raises ``eps_clip=0: must lie in (0, 1)``."""
    field = field or name
    _real(field, value, optional=False)
    bound = LOSS_BOUNDS[name]
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int of 2**1100: no float holds it
        number = math.nan
    if not bound.contains(number):
        raise field_error(LossConfigError, field, value, f"must lie in {bound.text()}",
                          bound.fix)
    return number


def _real(name: str, value: object, optional: bool) -> None:
    """A number (Python or numpy, bools excluded), or None when ``optional``: the range
    checks compare it, and a string would raise a bare ``TypeError`` there."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise field_error(LossConfigError, name, value, "is not a number",
                          "pass a float such as 0.2" + (", or None" if optional else ""))
