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
from typing import Literal, get_args

import numpy as np
from jaxtyping import Float64, Int64

from vime_pure.errors import LossConfigError, field_error
from vime_pure.grouping import dense_ids

RejectionDenominator = Literal["original", "surviving"]
# Masks arrive as lists of 0/1 (ints or floats) or arrays, one per sample.
Masks = Sequence[Sequence[float | int]] | Sequence[np.ndarray]
REJECTION_DENOMINATORS: tuple[str, ...] = ("original", "surviving")
MegatronPath = Literal["pair", "triple", "per_token"]
MEGATRON_PATHS: tuple[str, ...] = get_args(MegatronPath)



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
                              f"use one of {list(LOSS_MODES)}") from None


LOSS_MODES: tuple[str, ...] = tuple(m.value for m in LossMode)  # the choice list of --loss-mode

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
        raise LossConfigError(f"{field} has {len(per_sample)} entries but group_ids has {n}. "
                        "Fix: pass one loss mask per sample.")
    return per_sample


def group_mask_sums(group_ids: Sequence[Hashable] | np.ndarray,
                    loss_masks: Masks) -> Float64[np.ndarray, " n"]:
    """Loss-mask total of each sample's whole group, computed after masking (float64)."""
    per_sample = _mask_totals(loss_masks, len(group_ids), "loss_masks")
    return group_totals(dense_ids(group_ids), per_sample)


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
    one_step = np.zeros(len(per_sample), dtype=np.int64)
    return step_denominators(mode, dense_ids(group_ids), per_sample, one_step, norm=norm)


def step_denominators(mode: LossMode | str, group_ids: Int64[np.ndarray, " n"],
                      mask_sums: Float64[np.ndarray, " n"], step_of_sample: Int64[np.ndarray, " n"],
                      *, norm: float | int | None = None) -> Float64[np.ndarray, " n"]:
    """``D[i]`` of ``mode`` for every sample of a batch, each step from its own samples only.

    ``group_ids``: dense group numbers; ``mask_sums[i]``: sample ``i``'s loss-mask total;
    ``step_of_sample[i]``: its step, ``-1`` when it is not trained (its ``D`` is NaN, so any use
    shows). Groups never straddle steps, so a group's total is its step-level total.
    Example: masks summing to ``[2, 3, 4]``, groups ``[0, 0, 1]``, steps ``[0, 0, 1]``:
    ``group_token_mean`` ``[5, 5, 4]``; ``token_mean`` ``[5, 5, 4]`` (the step totals);
    ``sample_token_mean`` ``[2, 3, 4]``.
    """
    mode = LossMode.parse(mode)
    trained = step_of_sample >= 0
    if mode is LossMode.GROUP_TOKEN_MEAN:
        dens = group_totals(group_ids, mask_sums)
    elif mode is LossMode.SAMPLE_TOKEN_MEAN:
        dens = mask_sums.astype(np.float64, copy=True)
    elif mode is LossMode.TOKEN_MEAN:
        steps = np.where(trained, step_of_sample, 0)
        dens = np.bincount(steps, weights=np.where(trained, mask_sums, 0.0))[steps]
    else:
        if isinstance(norm, bool) or not isinstance(norm, (int, float, np.number)) \
                or not np.isfinite(norm) or norm <= 0:
            raise field_error(LossConfigError, "norm", norm,
                              "must be a positive constant for sample_token_sum_norm",
                              "pass the max response length of the run, e.g. norm=4096")
        dens = np.full(len(mask_sums), float(norm), dtype=np.float64)
    return np.where(trained, dens, np.nan)


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


def megatron_loss_scale(mode: LossMode | str, num_microbatches: int, num_groups: int, dp: int,
                        cp: int, *, num_samples: int | None = None,
                        path: MegatronPath | str = "pair",
                        total_num_tokens: int | None = None) -> float:
    """Factor ``s`` that the shell multiplies into each micro-batch's partial ``P``.

    Goal: the gradient Megatron applies equals ``grad L = (1/C) * sum_{r,k} grad P[r,k]`` over
    the ``dp*cp`` ranks ``r`` and each rank's ``K = num_microbatches`` micro-batches ``k``.

    * ``"pair"`` (loss_func returns ``(loss, metrics)``): Megatron multiplies by ``cp`` and
      divides by ``K``; DDP averages over ``dp*cp``. Applied: ``s * cp / K / (dp*cp) *
      sum grad P``, so ``s = K * dp / C``.
    * ``"triple"`` (returns ``(loss, num_tokens, metrics)``, ``calculate_per_token_loss=False``;
      the shell returns ``num_tokens = 1``): Megatron divides by ``num_tokens`` and ``K``, DDP
      by ``dp*cp``, so ``s = K * dp * cp / C``.
    * ``"per_token"`` (``calculate_per_token_loss=True``): no division per micro-batch, DDP
      sums, ``finalize_model_grads`` divides by ``T``, the ``num_tokens`` returned by all
      micro-batches summed over ``dp*cp``: ``s = T / C``. Pass ``total_num_tokens=T``: the step's
      loss-token count ``M`` when each CP rank returns its local count, ``cp * M`` when CP ranks
      return unsliced per-sample counts (the ``cp`` correction).

    ``C = step_divisor(mode, num_groups, num_samples)``; ``num_groups = G_s >= 1`` is validated.
    Example: ``group_token_mean``, K=3, G_s=4, dp=2, cp=2: ``"pair"`` gives 3*2/4 = 1.5,
    ``"triple"`` 3*2*2/4 = 3.0.
    """
    divisor = step_divisor(mode, num_groups, num_samples)
    for field, value in (("num_microbatches", num_microbatches), ("dp", dp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise field_error(LossConfigError, field, value, "must be an integer >= 1",
                              f"pass the trainer's {field}")
    if path == "pair":
        return num_microbatches * dp / divisor
    if path == "triple":
        return num_microbatches * dp * cp / divisor
    if path == "per_token":
        if isinstance(total_num_tokens, bool) or not isinstance(total_num_tokens, int) \
                or total_num_tokens < 0:
            raise field_error(LossConfigError, "total_num_tokens", total_num_tokens,
                              "is required by path='per_token' and must be an integer >= 0",
                              "pass the num_tokens Megatron all-reduces over dp*cp")
        return total_num_tokens / divisor
    raise field_error(LossConfigError, "path", path, "is not a Megatron loss path",
                      f"use one of {MEGATRON_PATHS}")
