"""Per-group loss denominators: the one place where a sample's denominator is computed.

Each sample carries the loss-mask total of its *whole* group (all siblings, after masking), so a
group's token-weighted mean is ``sum_over_siblings(sum(mask * x)) / group_mask_sum`` no matter how
its siblings are split over micro-batches, DP ranks or CP ranks.

Example: group "a" has siblings with masks ``[1, 1, 0]`` and ``[1, 1]``, group "b" one sample
with ``[1, 0, 0, 1]``: ``group_mask_sums(["a", "a", "b"], masks) == [4, 4, 2]``.
"""

from collections.abc import Hashable, Sequence

import numpy as np
from jaxtyping import Float64, Int64

from vime_pure.grouping import group_samples


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


def group_mask_sums(group_ids: Sequence[Hashable] | np.ndarray,
                    loss_masks: Sequence[Sequence[float]] | Sequence[np.ndarray]
                    ) -> Float64[np.ndarray, " n"]:
    """Loss-mask total of each sample's whole group, computed after masking (float64)."""
    per_sample = np.array([float(np.asarray(m, dtype=np.float64).sum()) for m in loss_masks],
                          dtype=np.float64)
    if len(per_sample) != len(group_ids):
        from vime_pure.errors import VimeError

        raise VimeError(f"loss_masks has {len(per_sample)} entries but group_ids has "
                        f"{len(group_ids)}. Fix: pass one loss mask per sample.")
    return group_totals(dense_group_ids(group_ids), per_sample)
