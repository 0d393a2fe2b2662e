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
        for name in ("eps_clip", "eps_clip_high", "dual_clip", "kl_coef", "entropy_coef",
                     "tis_clip"):
            _real(name, getattr(self, name), optional=name in ("eps_clip_high", "dual_clip"))
        for name in ("use_tis", "sequence_ratio"):
            if not isinstance(getattr(self, name), bool):
                raise field_error(LossConfigError, name, getattr(self, name), "must be a bool",
                                  "pass True or False")
        if not 0.0 < self.eps_clip < 1.0:
            raise field_error(LossConfigError, "eps_clip", self.eps_clip, "must lie in (0, 1)",
                              "use e.g. 0.2")
        if self.eps_clip_high is not None and not 0.0 < self.eps_clip_high < 10.0:
            raise field_error(LossConfigError, "eps_clip_high", self.eps_clip_high,
                              "must lie in (0, 10)", "use e.g. 0.28, or None for eps_clip")
        if self.dual_clip is not None and not 1.0 < self.dual_clip < math.inf:
            raise field_error(LossConfigError, "dual_clip", self.dual_clip,
                              "must be finite and > 1", "use e.g. 3.0, or None to disable it")
        for name in ("kl_coef", "entropy_coef"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise field_error(LossConfigError, name, getattr(self, name),
                                  "must be finite and >= 0", "use 0 to disable it")
        if not isinstance(self.kl_kind, str) or self.kl_kind not in KL_KINDS:
            raise field_error(LossConfigError, "kl_kind", self.kl_kind, "is not a KL estimator",
                              f"use one of {KL_KINDS}")
        if not self.tis_clip > 0.0:  # NaN fails too; inf means no truncation
            raise field_error(LossConfigError, "tis_clip", self.tis_clip, "must be > 0",
                              "use e.g. 2.0")


def _real(name: str, value: object, optional: bool) -> None:
    """A number (Python or numpy, bools excluded), or None when ``optional``: the range
    checks compare it, and a string would raise a bare ``TypeError`` there."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise field_error(LossConfigError, name, value, "is not a number",
                          "pass a float such as 0.2" + (", or None" if optional else ""))
