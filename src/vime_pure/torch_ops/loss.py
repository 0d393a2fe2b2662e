"""Per-micro-batch loss reduction over step-level denominators, and the Megatron scale factor.

A step's loss in every :class:`LossMode` is ``L = (1/C) * sum_{i,t} m[i,t] * x[i,t] / D[i]``
(formulas per mode in ``LossMode``'s docstring; ``D`` and ``C`` come from
``vime_pure.denominators``). A micro-batch, a DP rank and a CP shard each hold some tokens;
:func:`microbatch_loss` returns their *partial numerator* ``P = sum_{local t} m*x / D[i]`` over
the **full** step-level ``D``, so partials add up: ``sum_over_pieces(P) / C == L`` exactly, for
any split, and so do their gradients (the sum is linear in ``x``).

The shell feeds ``P * megatron_loss_scale(...)`` to Megatron, whose division by
``num_microbatches`` and DDP's average over ``dp * cp`` then cancel (derivation there). What a
trainer does, with everything per step computed by the core's micro-batch records
(``vime_pure.rank_batch``: ``D`` per sample, CP slices, the token-to-sample index)::

    scale = megatron_loss_scale(rec.loss_mode, rec.num_microbatches, rec.num_groups, dp, cp,
                                num_samples=rec.num_samples)
    # in Megatron's loss_func, per micro-batch record, on every DP x CP rank:
    partial = microbatch_loss(per_token, rec.loss_mask, rec.token_sample, rec.denominators)
    return partial * scale, {"loss": partial.detach()}               # the "pair" path
    # report: reduce_train_step over every rank's summed partials (divides by C)

Invariants the tests assert: the sum of scaled partials over micro-batches, DP ranks and zigzag
CP shards equals the whole-step value and gradient in every mode; the worked example below.

Example (``group_token_mean``): R0 = 3 samples x 3 tokens, R1 = 1 sample x 3 tokens, x = 1..12,
``D = [9, 9, 9, 3]``, ``C = G_s = 2``. One micro-batch holding samples 0-1 gives
``P = (1+..+6)/9 = 21/9``, the other ``(7+8+9)/9 + (10+11+12)/3 = 24/9 + 11``; their sum is 16
and ``L = 16 / 2 = 8.0``.
"""

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor

from vime_pure.errors import LossConfigError, field_error
from vime_pure.torch_ops.boundary import knob, tensor_boundary

__all__ = ["check_mask", "microbatch_loss", "rejection_mask", "sample_index_from_lengths"]


@tensor_boundary
def sample_index_from_lengths(lengths: Int[Tensor, " s"]) -> Int[Tensor, " t"]:
    """Per-token sample number of a packed row from per-sample token counts.

    Example: ``lengths = [2, 0, 3]`` gives ``[0, 0, 2, 2, 2]`` (an empty CP shard of sample 1
    owns no token but keeps its slot, so ``denominators`` stay aligned with samples).
    """
    if bool((lengths < 0).any()):
        raise field_error(LossConfigError, "lengths", lengths.tolist(), "has a negative entry",
                          "pass per-sample token counts >= 0")
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


@tensor_boundary
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

    Never silently wrong: ``LossConfigError`` when a mask value is not 0/1, a sample index is
    outside ``[0, len(denominators))`` (a negative one would wrap), or a ``D`` is negative,
    non-finite, or 0 under a non-zero mask (O(t), one host sync).
    """
    _check_row(loss_mask, sample_index, denominators)
    return (per_token * token_weights(loss_mask, sample_index, denominators,
                                       per_token.dtype)).sum()


@tensor_boundary
def microbatch_losses(per_token: Float[Tensor, "k t"], loss_mask: Float[Tensor, " t"],
                      sample_index: Int[Tensor, " t"], denominators: Float[Tensor, " s"]
                      ) -> Float[Tensor, " k"]:
    """:func:`microbatch_loss` of ``k`` per-token series of one row at once (the loss and the
    terms a step reports), with one check of the row and one weight computation.

    Example: ``x = [[1, 2, 3], [0, 1, 0]]``, ``m = [1, 1, 0]``, ``sample_index = [0, 0, 1]``,
    ``D = [4, 2]`` gives ``[0.75, 0.25]``.
    """
    _check_row(loss_mask, sample_index, denominators)
    weights = token_weights(loss_mask, sample_index, denominators, per_token.dtype)
    return (per_token * weights).sum(dim=-1)


def token_weights(loss_mask: Tensor, sample_index: Tensor, denominators: Tensor,
                   dtype: torch.dtype) -> Tensor:
    """``m[t] / D[sample_index[t]]``: the one place a token meets its denominator."""
    # Replace D=0 by 1 before dividing: those tokens have m=0 (checked by _check_row), and a
    # 0/0 would poison the gradient with NaN even though the forward value is masked out.
    safe = torch.where(denominators > 0, denominators, torch.ones_like(denominators))
    return loss_mask / safe.to(dtype)[sample_index]


def check_mask(loss_mask: Tensor, field: str = "loss_mask") -> None:
    """Every value 0 or 1 (NaN and weights are errors); one reduction, one host sync."""
    mask = loss_mask.detach()
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise field_error(LossConfigError, f"{field}[{i}]", float(mask[i]), "is not 0 or 1",
                          "pass 1 for trained tokens and 0 for masked ones (weights such as "
                          "TIS belong in the per-token values)")


def _check_row(loss_mask: Tensor, sample_index: Tensor, denominators: Tensor) -> None:
    """What the division would silently get wrong, as four flags read with one host sync."""
    n = denominators.numel()
    mask, dens = loss_mask.detach(), denominators.detach()
    bad_index = (sample_index < 0) | (sample_index >= n)
    counted = mask != 0
    if n:
        token_den = dens[sample_index.clamp(0, n - 1)]
        zero_den = counted & ~(token_den > 0) & ~bad_index
    else:
        zero_den = torch.zeros_like(counted)
    flags = torch.stack([bad_index.any(), ((mask != 0) & (mask != 1)).any(),
                         (~torch.isfinite(dens) | (dens < 0)).any(), zero_den.any()]).tolist()
    if flags[0]:
        i = int(torch.nonzero(bad_index)[0, 0])
        raise field_error(LossConfigError, f"sample_index[{i}]", int(sample_index[i]),
                          f"is outside [0, {n}) (len(denominators))",
                          "pass each token's sample position in the row, e.g. "
                          "sample_index_from_lengths(lengths)")
    if flags[1]:
        check_mask(loss_mask)
    if flags[2]:
        k = int(torch.nonzero(~torch.isfinite(dens) | (dens < 0))[0, 0])
        raise field_error(LossConfigError, f"denominators[{k}]", float(dens[k]),
                          "is negative or not finite", "pass step-level denominators from "
                          "sample_denominators / the micro-batch record (D >= 0)")
    if flags[3]:
        i = int(torch.nonzero(zero_den)[0, 0])
        k = int(sample_index[i])
        raise field_error(LossConfigError, f"denominators[{k}]", float(dens[k]),
                          f"is 0 but token {i} of sample {k} has loss_mask 1 (a D of 0 belongs "
                          "to a sample whose whole mask is 0)",
                          "compute D over the whole step after masking (sample_denominators)")


@tensor_boundary
def rejection_mask(log_ratio: Float[Tensor, " t"], loss_mask: Float[Tensor, " t"], *,
                   low: float | int, high: float | int,
                   sample_index: Int[Tensor, " t"] | None = None,
                   reduce: str = "mean") -> Float[Tensor, " t"]:
    """Masked importance sampling: ``loss_mask`` with rejected tokens set to 0.

    A token is rejected when its importance ratio ``exp(log_ratio)`` (e.g. trainer over rollout
    log-probs) lies outside ``[low, high]``. With ``sample_index``, rejection is per sample:
    a sample is dropped when the geometric mean of its masked ratios (``reduce="mean"``), or
    their product (``reduce="sum"`` of the log-ratios: sequence-level IS), leaves the band.
    Compute it on whole (unsliced) samples, at step level, so that the ``"surviving"``
    denominator (``sample_denominators``) can be computed before micro-batching; then slice.
    Example: ``log_ratio = log([1.0, 3.0, 0.5])``, mask ones, band ``[0.6, 2]`` -> ``[1, 0, 0]``.
    """
    low = knob("low", low, 0, math.inf, "pass e.g. low=0.5, high=2.0")
    high = knob("high", high, low, math.inf, "pass e.g. low=0.5, high=2.0 (low <= high)")
    check_mask(loss_mask)
    if reduce not in ("mean", "sum"):
        raise field_error(LossConfigError, "reduce", reduce, "is not a reduction",
                          "use 'mean' (geometric mean of ratios) or 'sum' (their product)")
    if sample_index is not None and sample_index.numel() and bool((sample_index < 0).any()):
        i = int(torch.nonzero(sample_index < 0)[0, 0])
        raise field_error(LossConfigError, f"sample_index[{i}]", int(sample_index[i]),
                          "is negative", "pass each token's sample position (>= 0)")
    # Compare in log space (float64): ratios themselves can overflow for large log gaps.
    lo = torch.log(torch.tensor(low, dtype=torch.float64))
    hi = torch.log(torch.tensor(high, dtype=torch.float64))
    ratio = log_ratio.detach().to(torch.float64)
    if sample_index is None:
        keep = (ratio >= lo) & (ratio <= hi)
    else:
        n = int(sample_index.max()) + 1 if sample_index.numel() else 0
        mask64 = loss_mask.detach().to(torch.float64)
        total = torch.zeros(n, dtype=torch.float64).index_add_(0, sample_index, ratio * mask64)
        count = torch.zeros(n, dtype=torch.float64).index_add_(0, sample_index, mask64)
        mean = total / count.clamp(min=1.0) if reduce == "mean" else total
        keep = ((mean >= lo) & (mean <= hi))[sample_index]
    return loss_mask * keep.to(loss_mask.dtype)
