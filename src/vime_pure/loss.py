"""Per-micro-batch loss reduction over step-level denominators, and the Megatron scale factor.

A step's loss in every :class:`LossMode` is ``L = (1/C) * sum_{i,t} m[i,t] * x[i,t] / D[i]``
(formulas per mode in ``LossMode``'s docstring; ``D`` and ``C`` come from
``vime_pure.denominators``). A micro-batch, a DP rank and a CP shard each hold some tokens;
:func:`microbatch_loss` returns their *partial numerator* ``P = sum_{local t} m*x / D[i]`` over
the **full** step-level ``D``, so partials add up: ``sum_over_pieces(P) / C == L`` exactly, for
any split, and so do their gradients (the sum is linear in ``x``).

The shell feeds ``P * megatron_loss_scale(...)`` to Megatron, whose division by
``num_microbatches`` and DDP's average over ``dp * cp`` then cancel (derivation there)::

    # once per step, from whole samples (numpy, torch-free):
    dens = sample_denominators(mode, group_ids, loss_masks)          # D[i], one per sample
    scale = megatron_loss_scale(mode, K, G_s, dp, cp, num_samples=N_s)
    # in Megatron's loss_func, per micro-batch, on every DP x CP rank:
    mask, lengths = slice_packed_response(row_mask, total_lens, resp_lens, cp_rank, cp)
    partial = microbatch_loss(per_token, mask, sample_index_from_lengths(lengths),
                              dens_of_row_samples)
    return partial * scale, {"loss": partial.detach()}               # the "pair" path
    # report: sum "loss" partials over micro-batches and DP x CP ranks, divide by
    # step_divisor(mode, G_s, N_s)  (reduce_train_step / all_reduce_step_sums).

Invariants the tests assert: the sum of scaled partials over micro-batches, DP ranks and zigzag
CP shards equals the whole-step value and gradient in every mode; the worked example below.

Example (``group_token_mean``): R0 = 3 samples x 3 tokens, R1 = 1 sample x 3 tokens, x = 1..12,
``D = [9, 9, 9, 3]``, ``C = G_s = 2``. One micro-batch holding samples 0-1 gives
``P = (1+..+6)/9 = 21/9``, the other ``(7+8+9)/9 + (10+11+12)/3 = 24/9 + 11``; their sum is 16
and ``L = 16 / 2 = 8.0``.
"""

from typing import Literal

import torch
from jaxtyping import Float, Int, jaxtyped
from beartype import beartype
from torch import Tensor

from vime_pure.denominators import LossConfigError, LossMode, step_divisor
from vime_pure.errors import field_error

MegatronPath = Literal["pair", "triple", "per_token"]
MEGATRON_PATHS: tuple[str, ...] = ("pair", "triple", "per_token")

__all__ = ["LossMode", "MegatronPath", "megatron_loss_scale", "microbatch_loss",
           "rejection_mask", "sample_index_from_lengths"]


@jaxtyped(typechecker=beartype)
def sample_index_from_lengths(lengths: Int[Tensor, " s"]) -> Int[Tensor, " t"]:
    """Per-token sample number of a packed row from per-sample token counts.

    Example: ``lengths = [2, 0, 3]`` gives ``[0, 0, 2, 2, 2]`` (an empty CP shard of sample 1
    owns no token but keeps its slot, so ``denominators`` stay aligned with samples).
    """
    if bool((lengths < 0).any()):
        raise field_error(LossConfigError, "lengths", lengths.tolist(), "has a negative entry",
                          "pass per-sample token counts >= 0")
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


@jaxtyped(typechecker=beartype)
def microbatch_loss(per_token: Float[Tensor, " t"], loss_mask: Float[Tensor, " t"],
                    sample_index: Int[Tensor, " t"],
                    denominators: Float[Tensor, " s"]) -> Float[Tensor, ""]:
    """Partial numerator ``sum_t m[t] * x[t] / D[sample_index[t]]`` of one packed row.

    ``per_token``/``loss_mask``/``sample_index`` cover the tokens this rank holds (after CP
    slicing); ``denominators[k]`` is the step-level ``D`` of the row's ``k``-th sample, taken
    from the step (``sample_denominators``), never from this micro-batch. The mask may be a
    rejection-modified mask. A sample whose ``D`` is 0 has an all-zero mask and contributes 0.
    Example: ``x = [1, 2, 3]``, ``m = [1, 1, 0]``, ``sample_index = [0, 0, 1]``,
    ``D = [4, 2]`` gives ``(1 + 2) / 4 = 0.75``.
    """
    # Replace D=0 by 1 before dividing: those tokens have m=0, and a 0/0 would poison the
    # gradient with NaN even though the forward value is masked out.
    safe = torch.where(denominators > 0, denominators, torch.ones_like(denominators))
    weights = loss_mask / safe.to(per_token.dtype)[sample_index]
    return (per_token * weights).sum()


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


@jaxtyped(typechecker=beartype)
def rejection_mask(log_ratio: Float[Tensor, " t"], loss_mask: Float[Tensor, " t"], *,
                   low: float | int, high: float | int,
                   sample_index: Int[Tensor, " t"] | None = None) -> Float[Tensor, " t"]:
    """Masked importance sampling: ``loss_mask`` with rejected tokens set to 0.

    A token is rejected when its importance ratio ``exp(log_ratio)`` (e.g. trainer over rollout
    log-probs) lies outside ``[low, high]``. With ``sample_index``, rejection is per sample:
    a sample is dropped when the geometric mean of its masked ratios leaves the band.
    Compute it on whole (unsliced) samples, at step level, so that the ``"surviving"``
    denominator (``sample_denominators``) can be computed before micro-batching; then slice.
    Example: ``log_ratio = log([1.0, 3.0, 0.5])``, mask ones, band ``[0.6, 2]`` -> ``[1, 0, 0]``.
    """
    if not 0 <= low <= high:
        raise field_error(LossConfigError, "low/high", (low, high),
                          "is not a band 0 <= low <= high", "pass e.g. low=0.5, high=2.0")
    # Compare in log space (float64): ratios themselves can overflow for large log gaps.
    lo = torch.log(torch.tensor(float(low), dtype=torch.float64))
    hi = torch.log(torch.tensor(float(high), dtype=torch.float64))
    ratio = log_ratio.detach().to(torch.float64)
    if sample_index is None:
        keep = (ratio >= lo) & (ratio <= hi)
    else:
        n = int(sample_index.max()) + 1 if sample_index.numel() else 0
        mask64 = loss_mask.detach().to(torch.float64)
        total = torch.zeros(n, dtype=torch.float64).index_add_(0, sample_index, ratio * mask64)
        count = torch.zeros(n, dtype=torch.float64).index_add_(0, sample_index, mask64)
        mean = total / count.clamp(min=1.0)
        keep = ((mean >= lo) & (mean <= hi))[sample_index]
    return loss_mask * keep.to(loss_mask.dtype)
