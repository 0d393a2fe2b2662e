"""Rejection (MIS / IcePop) applied to a rank's micro-batch records, with the chosen denominator.

``vime_pure.torch_ops.offpolicy.rejection_keep`` decides, once per batch on whole samples, which
response tokens survive (``keep``, one 0/1 per flat response token of the ``RolloutBatch``).
:func:`with_rejection` multiplies every record's ``loss_mask`` by it and, for the
``"surviving"`` denominator, recomputes each sample's step-level ``D`` from the surviving
masks (``vime_pure.denominators.step_denominators``, whole step and whole group, never one
row); ``"original"`` keeps the ``D`` of the unrejected masks (slime/miles). Either way every
token's weight depends only on its step, so the loss stays split-invariant.

Example: one group, masks ``[1, 1, 1]`` and ``[1, 1]``, keep ``[1, 0, 1]`` and ``[1, 1]``:
``group_token_mean`` records get masks ``[1, 0, 1]``, ``[1, 1]`` and ``D = [5, 5]``
(original) or ``[4, 4]`` (surviving); ``rejected_token_frac`` is 1/5.
"""

from typing import Any

import attrs
import numpy as np
from jaxtyping import Float

from vime_pure.data.batch import RolloutBatch
from vime_pure.data.microbatch import RankBatch, step_of_sample
from vime_pure.data.ragged import row_sums
from vime_pure.denominators import REJECTION_DENOMINATORS, step_denominators
from vime_pure.errors import RolloutBatchError, Shown, field_error, type_tag
from vime_pure.metrics import Metric
from vime_pure.scheduling.schedule import Schedule


def with_rejection(rank: Any, batch: Any, schedule: Any, keep: Any, *,
                   denominator: Any = "original", norm: Any = None) -> RankBatch:
    """``rank``'s records with ``keep`` applied to their masks (see the module docstring).

    ``rank`` must come from ``rank_batch(batch, schedule, ...)`` with the same ``norm``.
    Raises ``RolloutBatchError`` for a ``keep`` that is not a 0/1 float array of the batch's
    response tokens.
    """
    if not isinstance(rank, RankBatch) or not isinstance(batch, RolloutBatch) or not isinstance(
            schedule, Schedule):
        raise field_error(RolloutBatchError, "rank/batch/schedule", type_tag(rank),
                          "are not a RankBatch, its RolloutBatch and its Schedule",
                          "pass rank_batch(batch, schedule, ...), batch and schedule")
    if denominator not in REJECTION_DENOMINATORS:
        raise field_error(RolloutBatchError, "denominator", denominator, "is not a choice",
                          f"use one of {REJECTION_DENOMINATORS}")
    keep = _keep_column(keep, int(batch.response_offsets[-1]))
    dens = None
    if denominator == "surviving":
        surviving = row_sums(batch.loss_masks * keep, batch.response_offsets)
        dens = step_denominators(rank.loss_mode, batch.group_ids, surviving.astype(np.float64),
                                 step_of_sample(schedule), norm=norm)
    steps = []
    for step in rank.steps:
        records = tuple(attrs.evolve(
            mb, loss_mask=(mb.loss_mask * keep[mb.response_index]).astype(np.float32),
            **({} if dens is None else {"denominators": dens[mb.sample_indices]}))
            for mb in step.microbatches)
        steps.append(attrs.evolve(step, microbatches=records))
    return attrs.evolve(rank, steps=tuple(steps))


def rejection_metrics(batch: RolloutBatch, schedule: Schedule, keep: Any) -> dict[str, Metric]:
    """``rejected_token_frac``: loss-masked tokens of trained samples that ``keep`` rejects,
    over all loss-masked tokens of trained samples. Example: module docstring (1/5)."""
    keep = _keep_column(keep, int(batch.response_offsets[-1]))
    trained = np.repeat(step_of_sample(schedule) >= 0, batch.response_lengths)
    counted = batch.loss_masks.astype(np.float64) * trained
    return {"rejected_token_frac": Metric(float((counted * (1.0 - keep)).sum()),
                                          float(counted.sum()))}


def _keep_column(keep: Any, size: int) -> Float[np.ndarray, " r"]:
    arr = keep if isinstance(keep, np.ndarray) else None
    if arr is None or arr.shape != (size,) or arr.dtype.kind != "f" or (
            arr.size and ((arr != 0) & (arr != 1)).any()):
        raise field_error(RolloutBatchError, "keep", type_tag(keep) if arr is None else
                          Shown(f"<{arr.dtype}{list(arr.shape)}>"),
                          f"is not a 0/1 float array of the batch's {size} response tokens",
                          "pass rejection_keep(...) over the batch's flat response tokens")
    return arr.astype(np.float64, copy=False)
