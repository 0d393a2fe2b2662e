"""The knobs of the policy objective, torch-free: clipping, KL, entropy, TIS and rejection.

The loss *mode* is not here: it selects the denominators ``rank_batch`` puts into the records
(``vime_pure.denominators.LossMode``), and the objective reads it from them.

Example: ``LossConfig(eps_clip=0.2, eps_clip_high=0.28, kl_coef=0.01, kl_kind="low_var_kl")``
is DAPO's clip-higher with slime's low-variance KL penalty.

Off-policy correction (decoupled PPO, ``vime_pure.torch_ops.offpolicy``): the PPO ratio clips
against the *old* (proximal) policy, the trainer's weights when the batch starts training,
recomputed for every step of a batch with stale samples; ``use_tis`` weights each token by
``clamp(pi_old / pi_behaviour, tis_clip_low, tis_clip)`` (slime's ``--use-tis --tis-clip
--tis-clip-low``); ``RejectionConfig`` masks tokens or whole samples whose ratio leaves a band
(MIS / IcePop). Example: ``LossConfig(use_tis=True, tis_clip=5.0, tis_clip_low=0.5)`` with
``RejectionConfig(level="token", lower=0.5, upper=5.0)`` is IcePop.
"""

import math
import numbers
from typing import Literal, get_args

import attrs

from vime_pure.denominators import REJECTION_DENOMINATORS
from vime_pure.errors import LossConfigError, field_error

KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
KL_KINDS: tuple[str, ...] = get_args(KLKind)  # the choice list of --kl-loss-type
# The policy-gradient surrogate (``vime_pure.torch_ops.policy_loss``): PPO's clipped token
# ratio, GSPO's clipped sequence ratio, CISPO's clipped and detached token ratio on log-probs.
Surrogate = Literal["ppo", "gspo", "cispo"]
SURROGATES: tuple[str, ...] = get_args(Surrogate)
# slime's --loss-type: the policy objective above, or supervised fine-tuning's negative
# log-likelihood of the loss-masked tokens (no ratio, no advantages)
LossType = Literal["policy_loss", "sft_loss"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
RejectionLevel = Literal["token", "sequence", "geometric"]
RS_LEVELS: tuple[str, ...] = get_args(RejectionLevel)  # the choice list of --rs-level
# The TIS weight (--tis-function; slime's --custom-tis-function-path names them): vanilla
# clamps the token ratio into [tis_clip_low, tis_clip], icepop zeroes a token ratio outside it,
# mis is slime's mis.py (levels, modes, a veto, batch normalization: MisConfig)
TisFunction = Literal["vanilla", "icepop", "mis"]
TIS_FUNCTIONS: tuple[str, ...] = get_args(TisFunction)
# mis.py's tis_mode: truncate clamps the weight at the upper bound, clip into [lower, upper],
# mask keeps it and drops the tokens whose weight leaves [lower, upper] from the loss
TisMode = Literal["truncate", "clip", "mask"]
TIS_MODES: tuple[str, ...] = get_args(TisMode)


@attrs.frozen(kw_only=True)
class LossConfig:
    """Clip ``eps_clip`` / ``eps_clip_high`` (DAPO clip-higher) / ``dual_clip``; KL penalty
    ``kl_coef * kl_kind`` against the reference; entropy bonus ``entropy_coef``; truncated
    importance sampling weights ``clamp(exp(old - rollout), tis_clip_low, tis_clip)`` when
    ``use_tis`` (slime's defaults: 0 and 2); ``surrogate``: ``ppo`` (per-token ratios),
    ``gspo`` (GSPO's sequence-level ratio) or ``cispo`` (MiniMax-M1's clipped, detached ratio
    weighting the log-prob, so clipped tokens keep their gradient); ``loss_type``:
    ``policy_loss``, or ``sft_loss`` (supervised fine-tuning: every loss-masked token's
    negative log-likelihood, through the same denominators; the policy knobs do not act);
    ``opd_kl_coef``: on-policy distillation (slime's ``--opd-kl-coef`` under ``--use-opd``; 0
    off), each token's advantage minus ``opd_kl_coef * (logp_old - logp_teacher)``, the
    student's reverse-KL estimate against the teacher (or the batch's per-token
    ``opd_reverse_kl`` under miles' top-k distillation), on top of any estimator;
    ``tis_function``: ``vanilla`` (the clamp above), ``icepop`` (the ratio where it lies in
    ``[tis_clip_low, tis_clip]``, else 0) or ``mis`` (the weights come with the records,
    computed on whole samples by ``vime_pure.torch_ops.mis`` from a ``MisConfig``);
    ``reward_kl_coef``: slime's reward-shaping
    KL (``--kl-coef``), each token's advantage minus ``reward_kl_coef * kl_kind(pi_old || ref)``
    (``vime_pure.torch_ops.policy_loss.kl_shaped_advantages``)."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    surrogate: str = "ppo"
    reward_kl_coef: float = 0.0
    loss_type: str = "policy_loss"
    opd_kl_coef: float = 0.0
    tis_function: str = "vanilla"

    def __attrs_post_init__(self) -> None:
        for name in LOSS_BOUNDS:
            value = getattr(self, name)
            if value is not None or name not in ("eps_clip_high", "dual_clip"):
                check_loss_knob(name, value)
        if not isinstance(self.use_tis, bool):
            raise field_error(LossConfigError, "use_tis", self.use_tis, "must be a bool",
                              "pass True or False")
        check_surrogate(self.surrogate, self.dual_clip)
        if not isinstance(self.tis_function, str) or self.tis_function not in TIS_FUNCTIONS:
            raise field_error(LossConfigError, "tis_function", self.tis_function,
                              "is not a TIS function", f"use one of {TIS_FUNCTIONS}")
        if not isinstance(self.loss_type, str) or self.loss_type not in LOSS_TYPES:
            raise field_error(LossConfigError, "loss_type", self.loss_type,
                              "is not a loss type", f"use one of {LOSS_TYPES}")
        if not isinstance(self.kl_kind, str) or self.kl_kind not in KL_KINDS:
            raise field_error(LossConfigError, "kl_kind", self.kl_kind, "is not a KL estimator",
                              f"use one of {KL_KINDS}")
        if not self.tis_clip_low <= self.tis_clip:  # each alone: LOSS_BOUNDS
            raise field_error(LossConfigError, "tis_clip_low", self.tis_clip_low,
                              f"must lie in [0, tis_clip={self.tis_clip}]", "use e.g. 0 or 0.5")


@attrs.frozen(kw_only=True)
class RejectionConfig:
    """Rejection of off-policy tokens (MIS / IcePop): which ratio ``pi_old / pi_behaviour`` is
    tested, the band it must stay in, and the denominator the survivors are averaged by.

    ``level``: ``"token"`` tests each token's ratio; ``"sequence"`` the product over the
    sample's loss-masked tokens; ``"geometric"`` their geometric mean (both keep or drop a
    whole sample). ``lower`` / ``upper``: the band (slime's ``rs_lower_bound`` /
    ``rs_upper_bound``). ``denominator``: ``"original"`` (slime/miles: rejected tokens still
    count in their group's denominator) or ``"surviving"`` (``vime_pure.denominators``).
    ``veto`` (mis.py's ``rs_veto_threshold``; None off): a sample any of whose loss-masked
    tokens has a ratio below it is dropped whole, whatever the level.
    Example: ``RejectionConfig(level="geometric", lower=0.999, upper=1.001)`` drops samples
    whose mean per-token log-ratio leaves about +-1e-3.
    """

    level: str = "token"
    lower: float = 0.5
    upper: float = 2.0
    denominator: str = "original"
    veto: float | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.level, str) or self.level not in RS_LEVELS:
            raise field_error(LossConfigError, "level", self.level, "is not a rejection level",
                              f"use one of {RS_LEVELS}")
        if not isinstance(self.denominator, str) or (
                self.denominator not in REJECTION_DENOMINATORS):
            raise field_error(LossConfigError, "denominator", self.denominator,
                              "is not a rejection denominator",
                              f"use one of {REJECTION_DENOMINATORS}")
        for name in ("lower", "upper"):
            _real(name, getattr(self, name), optional=False)
            # numpy numbers pass as reals; the torch kernels take plain floats only
            object.__setattr__(self, name, float(getattr(self, name)))
        if not 0.0 <= self.lower <= self.upper < math.inf:
            raise field_error(LossConfigError, "upper", self.upper,
                              f"must satisfy lower={self.lower} <= upper < inf (and lower >= 0)",
                              "use e.g. lower=0.5, upper=2.0")
        if self.veto is not None:
            _real("veto", self.veto, optional=False)
            object.__setattr__(self, "veto", float(self.veto))
            if not 0.0 < self.veto < 1.0:
                raise field_error(LossConfigError, "veto", self.veto, "must lie in (0, 1)",
                                  "use e.g. 1e-4 (mis.py's), or None to disable it")


@attrs.frozen(kw_only=True)
class MisConfig:
    """slime's mis.py importance weights (``tis_function="mis"``): the ratio
    ``pi_old / pi_behaviour`` at ``level`` (``token``; ``sequence``: the product over the
    sample's loss-masked tokens; ``geometric``: their geometric mean, spread over the sample),
    bounded by ``mode`` (``TIS_MODES``) with ``[lower, upper]`` (mis.py's ``tis_lower_bound``,
    default ``1 / upper``, and ``tis_upper_bound``), and with ``batch_normalize`` divided by
    the step's mean weight. Batch normalization at ``geometric`` level is refused here, where
    mis.py raises at the first step. Example: mis.yaml's
    ``MisConfig(level="token", mode="truncate", lower=0.5, upper=2.0, batch_normalize=True)``.
    """

    level: str = "token"
    mode: str = "truncate"
    lower: float = 0.5
    upper: float = 2.0
    batch_normalize: bool = False

    def __attrs_post_init__(self) -> None:
        for name, choices in (("level", RS_LEVELS), ("mode", TIS_MODES)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in choices:
                raise field_error(LossConfigError, name, value, "is not a choice",
                                  f"use one of {choices}")
        for name in ("lower", "upper"):
            _real(name, getattr(self, name), optional=False)
            object.__setattr__(self, name, float(getattr(self, name)))
        if not 0.0 <= self.lower <= self.upper < math.inf or self.upper == 0.0:
            raise field_error(LossConfigError, "upper", self.upper,
                              f"must satisfy 0 <= lower={self.lower} <= upper < inf, upper > 0",
                              "use e.g. lower=0.5, upper=2.0")
        if not isinstance(self.batch_normalize, bool):
            raise field_error(LossConfigError, "batch_normalize", self.batch_normalize,
                              "must be a bool", "pass True or False")
        if self.batch_normalize and self.level == "geometric":
            raise field_error(LossConfigError, "batch_normalize", True,
                              "has no mean to divide by at level geometric (mis.py raises)",
                              "use level token or sequence, or drop batch normalization")


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
    # eps_clip 1 puts the lower clip at 0, where no ratio reaches: CISPO's one-sided band
    "eps_clip": Bound(0.0, 1.0, True, False, "use e.g. 0.2 (1: no lower clip)"),
    "eps_clip_high": Bound(0.0, 10.0, True, True, "use e.g. 0.28, or None for eps_clip"),
    "dual_clip": Bound(1.0, math.inf, True, True, "use e.g. 3.0, or None to disable it"),
    "kl_coef": Bound(0.0, math.inf, False, True, "use 0 to disable it"),
    "entropy_coef": Bound(0.0, math.inf, False, True, "use 0 to disable it"),
    "tis_clip": Bound(0.0, math.inf, True, False, "use e.g. 2.0 (inf: no truncation)"),
    "tis_clip_low": Bound(0.0, math.inf, False, True, "use e.g. 0 or 0.5"),
    "reward_kl_coef": Bound(0.0, math.inf, False, True, "use 0 to disable it"),
    "opd_kl_coef": Bound(0.0, math.inf, False, True, "use e.g. 1.0 (slime's default)"),
}


def check_surrogate(surrogate: object, dual_clip: object = None) -> None:
    """``surrogate`` is one of ``SURROGATES``, and a dual clip goes with PPO's clipped
    surrogates only (LossConfig's check, and ``policy_loss``'s for a direct caller).
    Example: ``check_surrogate("cispo", 3.0)`` raises ``dual_clip=3.0: applies to PPO's
    clipped surrogate, not CISPO's``."""
    if not isinstance(surrogate, str) or surrogate not in SURROGATES:
        raise field_error(LossConfigError, "surrogate", surrogate,
                          "is not a policy-gradient surrogate", f"use one of {SURROGATES}")
    if surrogate == "cispo" and dual_clip is not None:
        raise field_error(LossConfigError, "dual_clip", dual_clip,
                          "applies to PPO's clipped surrogate, not CISPO's",
                          "drop the dual clip with cispo")


def check_loss_knob(name: str, value: object, *, field: str | None = None) -> float:
    """``value`` as a float inside ``LOSS_BOUNDS[name]``, else a ``LossConfigError`` naming
    ``field`` (default ``name``). Example: ``check_loss_knob("eps_clip", 0.2) == 0.2``;
    ``check_loss_knob("eps_clip", 0)`` raises ``eps_clip=0: must lie in (0, 1]``."""
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
