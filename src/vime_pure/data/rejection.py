"""Rejection (MIS / IcePop) applied to a rank's micro-batch records, with the chosen denominator.

``vime_pure.torch_ops.offpolicy.rejection_keep`` decides, on whole samples, which response
tokens survive (``keep``, one 0/1 per flat response token of the rank's ``RankShare``: a
sample's verdict needs only its own tokens, so each DP rank judges its own share).
:func:`with_rejection` multiplies every record's ``loss_mask`` by it and, for the
``"surviving"`` denominator, recomputes each sample's step-level ``D`` from the surviving
mask totals of every sample of the batch (``vime_pure.denominators.step_denominators``, whole
step and whole group, never one row): each rank contributes its share's totals
(:func:`surviving_sums`, placed by :func:`batch_sums`), one number per sample, summed over
the DP ranks by the caller. ``"original"`` keeps the ``D`` of the unrejected masks
(slime/miles). Either way every token's weight depends only on its step, so the loss stays
split-invariant.

Example: one group, masks ``[1, 1, 1]`` and ``[1, 1]``, keep ``[1, 0, 1]`` and ``[1, 1]``:
``group_token_mean`` records get masks ``[1, 0, 1]``, ``[1, 1]`` and ``D = [5, 5]``
(original) or ``[4, 4]`` (surviving); ``rejected_token_frac`` is 1/5.
"""

from typing import Any

import attrs
import numpy as np
from jaxtyping import Float, Float64, Int64

from vime_pure.data.microbatch import RankBatch, step_of_sample
from vime_pure.data.ragged import row_sums
from vime_pure.data.shares import RankShare
from vime_pure.denominators import REJECTION_DENOMINATORS, step_denominators
from vime_pure.errors import RolloutBatchError, Shown, field_error, type_tag
from vime_pure.metrics import Metric
from vime_pure.scheduling.schedule import Schedule


def with_rejection(rank: Any, share: Any, schedule: Any, keep: Any, *,
                   denominator: Any = "original", surviving: Any = None,
                   norm: Any = None) -> RankBatch:
    """``rank``'s records with ``keep`` applied to their masks (see the module docstring).

    ``rank`` must come from ``share_batch(share, schedule, ...)`` with the same ``norm``;
    ``surviving`` (the ``"surviving"`` denominator only): every batch sample's surviving
    mask total, :func:`batch_sums` summed over the DP ranks. Raises ``RolloutBatchError`` for
    a ``keep`` that is not a 0/1 float array of the share's response tokens, or a missing or
    misshapen ``surviving``.
    """
    if not isinstance(rank, RankBatch) or not isinstance(share, RankShare) or not isinstance(
            schedule, Schedule):
        raise field_error(RolloutBatchError, "rank/share/schedule", type_tag(rank),
                          "are not a RankBatch, its RankShare and its Schedule",
                          "pass share_batch(share, schedule, ...), share and schedule")
    if denominator not in REJECTION_DENOMINATORS:
        raise field_error(RolloutBatchError, "denominator", denominator, "is not a choice",
                          f"use one of {REJECTION_DENOMINATORS}")
    keep = _keep_column(keep, share.num_response_tokens)
    dens = None
    if denominator == "surviving":
        n = len(schedule.lengths_array)
        if not isinstance(surviving, np.ndarray) or surviving.shape != (n,):
            raise field_error(RolloutBatchError, "surviving", type_tag(surviving),
                              f"is not one surviving mask total per batch sample ({n})",
                              "pass batch_sums(...) summed over the DP ranks")
        dens = step_denominators(rank.loss_mode, schedule.group_array,
                                 surviving.astype(np.float64), step_of_sample(schedule),
                                 norm=norm)
    steps = []
    for step in rank.steps:
        records = tuple(attrs.evolve(
            mb, loss_mask=(mb.loss_mask * keep[mb.share_index]).astype(np.float32),
            **({} if dens is None else {"denominators": dens[mb.sample_indices]}))
            for mb in step.microbatches)
        steps.append(attrs.evolve(step, microbatches=records))
    return attrs.evolve(rank, steps=tuple(steps))


def with_is_weights(rank: Any, weights: Any) -> RankBatch:
    """``rank``'s records with ``is_weights`` (``--tis-function mis``): ``weights`` holds one
    finite weight >= 0 per flat response token of the rank's share (share coordinates, e.g.
    ``vime_pure.torch_ops.mis.mis_weights`` over the share), and each record gathers its
    tokens by ``share_index``, as the log-probs. Raises ``RolloutBatchError`` otherwise.
    Example: weights ``[2, 1, 1]`` and a record of share tokens ``[2, 0]``: ``[1, 2]``."""
    if not isinstance(rank, RankBatch):
        raise field_error(RolloutBatchError, "rank", type_tag(rank), "is not a RankBatch",
                          "pass what rank_batch returned")
    arr = weights if isinstance(weights, np.ndarray) else None
    if arr is None or arr.shape != (rank.num_response_tokens,) or arr.dtype.kind != "f" or (
            arr.size and not (np.isfinite(arr).all() and (arr >= 0).all())):
        raise field_error(RolloutBatchError, "weights", type_tag(weights) if arr is None else
                          Shown(f"<{arr.dtype}{list(arr.shape)}>"),
                          f"is not a finite float array >= 0 of the share's "
                          f"{rank.num_response_tokens} response tokens",
                          "pass mis_weights(...).weights over the share's flat response tokens")
    steps = [attrs.evolve(step, microbatches=tuple(
        attrs.evolve(mb, is_weights=arr[mb.share_index].astype(np.float32))
        for mb in step.microbatches)) for step in rank.steps]
    return attrs.evolve(rank, steps=tuple(steps))


def surviving_sums(share: RankShare, keep: Any) -> Float64[np.ndarray, " k"]:
    """Each share sample's loss-mask total after ``keep`` (share order). Example: masks
    ``[1, 1, 1]`` and ``[1, 1]``, keep ``[1, 0, 1, 1, 1]``: ``[2, 2]``."""
    keep = _keep_column(keep, share.num_response_tokens)
    return row_sums(share.loss_masks.astype(np.float64) * keep, share.response_offsets)


def batch_sums(share: RankShare, values: Any, num_samples: int) -> Float64[np.ndarray, " n"]:
    """``values`` (one per share sample) at the share's global sample ids of a batch of
    ``num_samples``, 0 elsewhere: summed over the DP ranks, every sample's value. Example: a
    share of samples ``[3, 0]`` with values ``[5, 7]`` in a batch of 4: ``[7, 0, 0, 5]``."""
    out = np.zeros(num_samples, dtype=np.float64)
    ids: Int64[np.ndarray, " k"] = share.sample_ids
    if len(values) != len(ids) or (len(ids) and int(ids.max()) >= num_samples):
        raise field_error(RolloutBatchError, "values", len(values),
                          f"do not match the share's {len(ids)} samples of {num_samples}",
                          "pass one value per share sample, the share of this batch")
    out[ids] = values
    return out


def rejection_metrics(share: RankShare, keep: Any) -> dict[str, Metric]:
    """``rejected_token_frac`` of this share (every share sample is trained): loss-masked
    tokens ``keep`` rejects over all loss-masked tokens; merge the ranks' with
    ``vime_pure.metrics``. Example: module docstring (1/5)."""
    keep = _keep_column(keep, share.num_response_tokens)
    counted = share.loss_masks.astype(np.float64)
    return {"rejected_token_frac": Metric(float((counted * (1.0 - keep)).sum()),
                                          float(counted.sum()))}


def _keep_column(keep: Any, size: int) -> Float[np.ndarray, " r"]:
    arr = keep if isinstance(keep, np.ndarray) else None
    if arr is None or arr.shape != (size,) or arr.dtype.kind != "f" or (
            arr.size and ((arr != 0) & (arr != 1)).any()):
        raise field_error(RolloutBatchError, "keep", type_tag(keep) if arr is None else
                          Shown(f"<{arr.dtype}{list(arr.shape)}>"),
                          f"is not a 0/1 float array of the share's {size} response tokens",
                          "pass rejection_keep(...) over the share's flat response tokens")
    return arr.astype(np.float64, copy=False)
