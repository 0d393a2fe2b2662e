"""Loss modes and their step-level denominators: the one place where a denominator is computed.

Every loss mode weighs a loss-masked token ``t`` of sample ``i`` by ``m[i,t] / (D[i] * C)``:
a per-sample denominator ``D[i]`` and a step divisor ``C`` (see :class:`LossMode`). Both are
**step-level data**: computed here once, from whole samples and whole groups after masking,
carried with each sample, and never recomputed per micro-batch, DP rank or CP shard. That is
what makes the loss, its gradient and every report invariant to how a step is split.

Invariants the tests assert:
  * siblings of a group carry the same ``group_mask_sums`` value, the group's mask total;
  * for every mode, summing ``m[i,t] / D[i]`` over all tokens of a step gives the number of
    units (groups / samples) with a non-empty mask (``group_token_mean`` / ``sample_token_mean``);
  * ``step_divisor`` rejects ``G_s < 1`` with :class:`LossConfigError`, never clamps.

Example: group "a" has siblings with masks ``[1, 1, 0]`` and ``[1, 1]``, group "b" one sample
with ``[1, 0, 0, 1]``: ``group_mask_sums(["a", "a", "b"], masks) == [4, 4, 2]``.
"""

import enum
from collections.abc import Hashable, Sequence
from typing import Literal

import numpy as np
from jaxtyping import Float64, Int64

from vime_pure.errors import VimeError, field_error
from vime_pure.grouping import group_samples

RejectionDenominator = Literal["original", "surviving"]
# Masks arrive as lists of 0/1 (ints or floats) or arrays, one per sample.
Masks = Sequence[Sequence[float | int]] | Sequence[np.ndarray]
REJECTION_DENOMINATORS: tuple[str, ...] = ("original", "surviving")


class LossConfigError(VimeError):
    """A loss mode, divisor, denominator choice or scale input that cannot be used."""


class LossMode(str, enum.Enum):
    """How per-token values ``x[i,t]`` (loss mask ``m[i,t]``) of one step become one number.

    Notation: the step has ``G_s`` groups (rollout executions), ``N_s`` samples; sample ``i``
    belongs to group ``g(i)``; ``M_i = sum_t m[i,t]``, ``M_g = sum_{i in g} M_i``,
    ``M = sum_i M_i``. Every mode is ``L = (1/C) * sum_{i,t} m[i,t] * x[i,t] / D[i]``:

    * ``group_token_mean`` (default): one token-weighted mean per group, averaged over groups.
      ``L = (1/G_s) * sum_g (sum_{i in g, t} m*x) / M_g``  ->  ``D[i] = M_g(i)``, ``C = G_s``.
    * ``sample_token_mean`` (legacy): one mean per sample, averaged over samples.
      ``L = (1/N_s) * sum_i (sum_t m*x) / M_i``  ->  ``D[i] = M_i``, ``C = N_s``.
    * ``token_mean``: every loss-masked token of the step weighs the same.
      ``L = (sum_{i,t} m*x) / M``  ->  ``D[i] = M``, ``C = 1``.
    * ``sample_token_sum_norm`` (Dr. GRPO): token sums over a constant ``norm`` (e.g. the max
      response length), averaged over samples.
      ``L = (1/N_s) * sum_i (sum_t m*x) / norm``  ->  ``D[i] = norm``, ``C = N_s``.

    A unit (group or sample) whose mask is all zero contributes 0 but still counts in ``C``.
    Example: groups R0 = 3 samples x 3 tokens, R1 = 1 sample x 3 tokens, x = 1..12:
    ``group_token_mean`` = (5 + 11) / 2 = 8.0, ``token_mean`` = 78 / 12 = 6.5.
    """

    GROUP_TOKEN_MEAN = "group_token_mean"
    SAMPLE_TOKEN_MEAN = "sample_token_mean"
    TOKEN_MEAN = "token_mean"
    SAMPLE_TOKEN_SUM_NORM = "sample_token_sum_norm"

    @classmethod
    def parse(cls, value: "LossMode | str") -> "LossMode":
        """``LossMode.parse("token_mean") is LossMode.TOKEN_MEAN``; typed error otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise field_error(LossConfigError, "mode", value, "is not a loss mode",
                              f"use one of {[m.value for m in cls]}") from None


def dense_group_ids(group_ids: Sequence[Hashable] | np.ndarray) -> Int64[np.ndarray, " n"]:
    """Dense group numbers (first-occurrence order) of arbitrary hashable ids."""
    return group_samples(list(group_ids) if isinstance(group_ids, np.ndarray) else group_ids).dense


def group_totals(dense: Int64[np.ndarray, " n"],
                 per_sample: Float64[np.ndarray, " n"]) -> Float64[np.ndarray, " n"]:
    """Broadcast each group's total of ``per_sample`` back to every member sample."""
    if dense.size == 0:
        return np.zeros(0, dtype=np.float64)
    totals = np.bincount(dense, weights=per_sample)
    return totals[dense]


def _mask_totals(loss_masks: Masks,
                 n: int, field: str) -> Float64[np.ndarray, " n"]:
    per_sample = np.array([float(np.asarray(m, dtype=np.float64).sum()) for m in loss_masks],
                          dtype=np.float64)
    if len(per_sample) != n:
        raise VimeError(f"{field} has {len(per_sample)} entries but group_ids has {n}. "
                        "Fix: pass one loss mask per sample.")
    return per_sample


def group_mask_sums(group_ids: Sequence[Hashable] | np.ndarray,
                    loss_masks: Masks) -> Float64[np.ndarray, " n"]:
    """Loss-mask total of each sample's whole group, computed after masking (float64)."""
    per_sample = _mask_totals(loss_masks, len(group_ids), "loss_masks")
    return group_totals(dense_group_ids(group_ids), per_sample)


def sample_denominators(mode: LossMode | str,
                        group_ids: Sequence[Hashable] | np.ndarray,
                        loss_masks: Masks, *,
                        norm: float | int | None = None,
                        rejection_masks: Masks | None = None,
                        denominator: RejectionDenominator | str = "original",
                        ) -> Float64[np.ndarray, " n"]:
    """Per-sample denominator ``D[i]`` of ``mode`` for one whole step (see :class:`LossMode`).

    ``rejection_masks`` (truncated/masked importance sampling) zero out rejected tokens. The
    *numerator* always uses ``loss_mask * rejection_mask``; the denominator is chosen here:
    ``"original"`` counts the loss mask before rejection (slime/miles behaviour: rejected tokens
    still dilute their group, so heavy rejection shrinks the loss), ``"surviving"`` counts only
    tokens that survived (the mean over what is actually trained on).
    Example: one group, masks ``[1,1,1]`` and ``[1,1]``, rejection ``[1,0,1]`` and ``[1,1]``:
    ``group_token_mean`` gives ``D = [5, 5]`` (original) or ``[4, 4]`` (surviving).
    """
    mode = LossMode.parse(mode)
    if denominator not in REJECTION_DENOMINATORS:
        raise field_error(LossConfigError, "denominator", denominator, "is not a choice",
                          f"use one of {REJECTION_DENOMINATORS}")
    masks = loss_masks
    if rejection_masks is not None and denominator == "surviving":
        if len(rejection_masks) != len(loss_masks):
            raise field_error(LossConfigError, "rejection_masks", f"<{len(rejection_masks)}>",
                              f"has a different length than loss_masks ({len(loss_masks)})",
                              "pass one rejection mask per sample")
        masks = [np.asarray(m, np.float64) * np.asarray(r, np.float64)
                 for m, r in zip(loss_masks, rejection_masks)]
    per_sample = _mask_totals(masks, len(group_ids), "loss_masks")
    if mode is LossMode.GROUP_TOKEN_MEAN:
        return group_totals(dense_group_ids(group_ids), per_sample)
    if mode is LossMode.SAMPLE_TOKEN_MEAN:
        return per_sample
    if mode is LossMode.TOKEN_MEAN:
        return np.full(len(per_sample), per_sample.sum(), dtype=np.float64)
    if norm is None or not np.isfinite(norm) or norm <= 0:
        raise field_error(LossConfigError, "norm", norm,
                          "must be a positive constant for sample_token_sum_norm",
                          "pass the max response length of the run, e.g. norm=4096")
    return np.full(len(per_sample), float(norm), dtype=np.float64)


def _count(field: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise field_error(LossConfigError, field, value, "must be an integer >= 1", fix)
    return int(value)


def step_divisor(mode: LossMode | str, num_groups: int, num_samples: int | None = None) -> int:
    """The step divisor ``C`` of ``mode``: ``G_s``, ``N_s`` or 1 (see :class:`LossMode`).

    ``num_groups`` (``G_s``) is validated ``>= 1`` for every mode, never clamped: a step with no
    group is a scheduling bug. Sample modes need ``num_samples``.
    Example: ``step_divisor("group_token_mean", 4) == 4``;
    ``step_divisor("sample_token_mean", 4, num_samples=6) == 6``.
    """
    mode = LossMode.parse(mode)
    g = _count("G_s (num_groups)", num_groups,
               "pass the number of groups in the optimizer step (a step has at least one)")
    if mode is LossMode.GROUP_TOKEN_MEAN:
        return g
    if mode is LossMode.TOKEN_MEAN:
        return 1
    return _count("num_samples", num_samples,
                  f"{mode.value} averages over samples: pass the step's sample count N_s")
