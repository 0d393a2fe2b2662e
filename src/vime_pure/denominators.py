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
import math
from typing import Any, Literal, get_args

import numpy as np
from jaxtyping import Float64, Int64

from vime_pure.config import as_int
from vime_pure.errors import LossConfigError, Shown, field_error, type_tag
from vime_pure.grouping import dense_ids

RejectionDenominator = Literal["original", "surviving"]
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
    def parse(cls, value: Any) -> "LossMode":
        """``LossMode.parse("token_mean") is LossMode.TOKEN_MEAN``; typed error otherwise."""
        try:
            return cls(value) if isinstance(value, str) else cls(None)
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


def mask_rows(masks: Any, n: int, field: str) -> list[np.ndarray]:
    """``masks`` as ``n`` 1-D numeric arrays of 0/1 values (NaN, 0.5 or 2 are errors: a
    weight belongs in the loss, not in a mask). O(total tokens), one numpy pass per row.

    Example: ``mask_rows([[1, 0], (1,)], 2, "loss_masks")`` gives ``[array([1, 0]),
    array([1])]``; ``[[1, 0.5]]`` raises ``loss_masks[0]``.
    """
    if not isinstance(masks, (list, tuple, np.ndarray)):
        raise field_error(LossConfigError, field, type_tag(masks), "is not a list of masks",
                          "pass one 0/1 mask (list or array) per sample")
    if len(masks) != n:
        raise field_error(LossConfigError, field, Shown(f"<{len(masks)} masks>"),
                          f"does not have one mask per sample ({n} samples)",
                          "pass one loss mask per sample")
    rows = []
    for i, mask in enumerate(masks):
        arr = np.asarray(mask) if isinstance(mask, (list, tuple, np.ndarray)) else None
        if arr is None or arr.ndim != 1 or arr.dtype.kind not in "biuf":
            raise field_error(LossConfigError, f"{field}[{i}]", type_tag(mask) if arr is None
                              else Shown(f"<{arr.dtype}{list(arr.shape)}>"),
                              "is not a flat list or array of numbers",
                              "pass each mask as a list or 1-D array of 0/1")
        if arr.size and ((arr != 0) & (arr != 1)).any():
            bad = int(np.argmax((arr != 0) & (arr != 1)))
            raise field_error(LossConfigError, f"{field}[{i}][{bad}]", arr[bad].item(),
                              "is not 0 or 1", "use 1 for trained tokens and 0 for masked ones")
        rows.append(arr)
    return rows


def _mask_totals(rows: list[np.ndarray]) -> Float64[np.ndarray, " n"]:
    return np.array([float(r.sum()) for r in rows], dtype=np.float64).reshape(-1)


def group_mask_sums(group_ids: Any, loss_masks: Any) -> Float64[np.ndarray, " n"]:
    """Loss-mask total of each sample's whole group, computed after masking (float64).

    ``group_ids``: one int or str per sample (None: its own group); ``loss_masks``: one 0/1
    list or array per sample (typed loosely: this is a user boundary, validated here with a
    ``LossConfigError``, or a ``ScheduleError``-style message for ids, naming the entry).
    """
    dense = dense_ids(group_ids, error=LossConfigError)
    return group_totals(dense, _mask_totals(mask_rows(loss_masks, len(dense), "loss_masks")))


def sample_denominators(mode: Any, group_ids: Any, loss_masks: Any, *, norm: Any = None,
                        rejection_masks: Any = None, denominator: Any = "original",
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
    if not isinstance(denominator, str) or denominator not in REJECTION_DENOMINATORS:
        raise field_error(LossConfigError, "denominator", denominator, "is not a choice",
                          f"use one of {REJECTION_DENOMINATORS}")
    dense = dense_ids(group_ids, error=LossConfigError)
    masks = mask_rows(loss_masks, len(dense), "loss_masks")
    if rejection_masks is not None:  # checked even when unused: a wrong one is a bug upstream
        rejected = mask_rows(rejection_masks, len(dense), "rejection_masks")
        short = next((i for i, (m, r) in enumerate(zip(masks, rejected)) if len(m) != len(r)),
                     None)
        if short is not None:
            raise field_error(LossConfigError, f"rejection_masks[{short}]",
                              Shown(f"<{len(rejected[short])} values>"),
                              f"does not match loss_masks[{short}] ({len(masks[short])} values)",
                              "pass one rejection value per loss-mask token")
        if denominator == "surviving":
            masks = [m * r for m, r in zip(masks, rejected)]
    per_sample = _mask_totals(masks)
    one_step = np.zeros(len(per_sample), dtype=np.int64)
    return step_denominators(mode, dense, per_sample, one_step, norm=norm)


def step_denominators(mode: Any, group_ids: Any, mask_sums: Any, step_of_sample: Any, *,
                      norm: Any = None) -> Float64[np.ndarray, " n"]:
    """``D[i]`` of ``mode`` for every sample of a batch, each step from its own samples only.

    ``group_ids``: dense group numbers; ``mask_sums[i]``: sample ``i``'s loss-mask total;
    ``step_of_sample[i]``: its step, ``-1`` when it is not trained (its ``D`` is NaN, so any use
    shows). Groups never straddle steps, so a group's total is its step-level total.
    Example: masks summing to ``[2, 3, 4]``, groups ``[0, 0, 1]``, steps ``[0, 0, 1]``:
    ``group_token_mean`` ``[5, 5, 4]``; ``token_mean`` ``[5, 5, 4]`` (the step totals);
    ``sample_token_mean`` ``[2, 3, 4]``.
    Inputs are validated (typed loosely: a user boundary): integer ids in ``[0, n)``, finite
    non-negative mask sums, steps in ``[-1, n)``, all of one length ``n``.
    """
    mode = LossMode.parse(mode)
    group_ids, mask_sums, step_of_sample = _step_columns(group_ids, mask_sums, step_of_sample)
    if norm is not None or mode is LossMode.SAMPLE_TOKEN_SUM_NORM:
        norm = _norm(norm)  # checked even when unused: a junk norm is a bug upstream
    trained = step_of_sample >= 0
    if mode is LossMode.GROUP_TOKEN_MEAN:
        dens = group_totals(group_ids, mask_sums)
    elif mode is LossMode.SAMPLE_TOKEN_MEAN:
        dens = mask_sums.astype(np.float64, copy=True)
    elif mode is LossMode.TOKEN_MEAN:
        steps = np.where(trained, step_of_sample, 0)
        dens = np.bincount(steps, weights=np.where(trained, mask_sums, 0.0))[steps]
    else:
        dens = np.full(len(mask_sums), norm, dtype=np.float64)
    return np.where(trained, dens, np.nan)


def _norm(norm: Any) -> float:
    """``sample_token_sum_norm``'s constant: a finite number > 0."""
    ok = not isinstance(norm, (bool, np.bool_, np.complexfloating)) and isinstance(
        norm, (int, float, np.number)) and 0 < norm < math.inf
    if not ok:
        raise field_error(LossConfigError, "norm", norm,
                          "must be a positive constant (sample_token_sum_norm's divisor)",
                          "pass the max response length of the run, e.g. norm=4096, or None")
    return float(norm)


def _step_columns(group_ids: Any, mask_sums: Any, step_of_sample: Any
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three per-sample columns of ``step_denominators``, checked (one pass each)."""
    columns = []
    for field, value, kinds in (("group_ids", group_ids, "iu"), ("mask_sums", mask_sums, "iuf"),
                                ("step_of_sample", step_of_sample, "iu")):
        arr = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
        if arr is None or arr.ndim != 1 or arr.dtype.kind not in kinds or (
                arr.size and arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max):
            raise field_error(LossConfigError, field, type_tag(value) if arr is None else
                              Shown(f"<{arr.dtype}{list(arr.shape)}>"),
                              "is not a 1-D " + ("integer" if kinds == "iu" else "numeric")
                              + " array", "pass one entry per sample")
        columns.append(arr.astype(np.int64 if kinds == "iu" else np.float64, copy=False))
    groups, sums, steps = columns
    n = len(groups)
    if len(sums) != n or len(steps) != n:
        raise field_error(LossConfigError, "mask_sums/step_of_sample",
                          Shown(f"<{len(sums)}, {len(steps)} entries>"),
                          f"do not have one entry per sample ({n} group_ids)",
                          "pass the three columns of one batch")
    for field, arr, lo, bad in (("group_ids", groups, 0, (groups < 0) | (groups >= n)),
                                ("mask_sums", sums, 0, ~np.isfinite(sums) | (sums < 0)),
                                ("step_of_sample", steps, -1, (steps < -1) | (steps >= n))):
        if bad.any():
            i = int(np.argmax(bad))
            raise field_error(LossConfigError, f"{field}[{i}]", arr[i].item(),
                              f"is outside [{lo}, {n})" if field != "mask_sums" else
                              "is not a finite count >= 0",
                              "pass dense group numbers, mask totals and steps (-1: untrained)")
    return groups, sums, steps


def _count(field: str, value: object, fix: str) -> int:
    return as_int(field, value, 1, LossConfigError, fix)


def step_divisor(mode: Any, num_groups: Any, num_samples: Any = None) -> int:
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


def megatron_loss_scale(mode: Any, num_microbatches: Any, num_groups: Any, dp: Any, cp: Any, *,
                        num_samples: Any = None, path: Any = "pair",
                        total_num_tokens: Any = None) -> float:
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
    k, dp, cp = (as_int(field, value, 1, LossConfigError, f"pass the trainer's {field}")
                 for field, value in (("num_microbatches", num_microbatches), ("dp", dp),
                                      ("cp", cp)))
    if not isinstance(path, str):  # `array == "pair"` would compare element-wise
        raise field_error(LossConfigError, "path", type_tag(path), "is not a Megatron loss path",
                          f"use one of {MEGATRON_PATHS}")
    if path == "pair":
        return k * dp / divisor
    if path == "triple":
        return k * dp * cp / divisor
    if path == "per_token":
        tokens = as_int("total_num_tokens", total_num_tokens, 0, LossConfigError,
                        "pass the num_tokens Megatron all-reduces over dp*cp (path='per_token' "
                        "needs it)")
        return tokens / divisor
    raise field_error(LossConfigError, "path", path, "is not a Megatron loss path",
                      f"use one of {MEGATRON_PATHS}")
