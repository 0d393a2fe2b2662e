"""``RolloutBatch``: the frozen, columnar form of one rollout batch, validated at construction.

Ragged per-token data is stored flat with int64 offsets (``vime_pure.ragged``): ``tokens``
(int32, prompt + response) with ``token_offsets``, and ``loss_masks`` (uint8 0/1, response
tokens only) plus ``rollout_log_probs`` (float32 or None) with ``response_offsets``. Every
other column has one entry per sample. Group ids are stored dense (first-occurrence order, as
the scheduler numbers them) next to the original ids: ``group_id_values[group_ids[i]]`` is
sample ``i``'s ``group_id``; the same holds for prompt groups. Sample ``metadata`` stays on the
``Sample`` objects: the batch holds what training and analysis read as arrays.

Invariants (checked in ``__attrs_post_init__``, asserted by the tests): dtypes as documented;
cross-field shapes (checked with jaxtyping); offsets start at 0 and step by the lengths;
``lengths >= 1``; ``0 <= response_lengths <= lengths``; masks are 0/1 and all-zero on removed
samples; dense ids are dense and in first-occurrence order; a rollout group lies in one prompt
group; ``group_mask_sums`` are the group totals of the masks (``vime_pure.denominators``);
rewards and advantages are finite and equal among siblings. Columns are read-only.

Example: ``RolloutBatch.from_samples([[Sample(tokens=[1, 2, 3], response_length=2,
reward=1.0), Sample(tokens=[1, 2, 4, 5], response_length=2, reward=0.0)]])`` has
``token_offsets == [0, 3, 7]``, ``group_ids == [0, 1]``, ``prompt_groups == [0, 0]``,
``group_mask_sums == [2, 2]`` and GRPO advantages ``[~1, ~-1]``.
"""

from collections.abc import Hashable

import attrs
import numpy as np
from jaxtyping import Bool, Float32, Float64, Int32, Int64, UInt8

from vime_pure.config import BatchingPolicy, ParallelLayout
from vime_pure.errors import RolloutBatchError
from vime_pure.rewards import RewardNormalization
from vime_pure.schedule import Schedule, build_schedule

# Column name -> dtype. Order is the on-disk order of dumps.
COLUMNS: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int32), "token_offsets": np.dtype(np.int64),
    "lengths": np.dtype(np.int64), "response_lengths": np.dtype(np.int64),
    "loss_masks": np.dtype(np.uint8), "response_offsets": np.dtype(np.int64),
    "rollout_log_probs": np.dtype(np.float32), "group_ids": np.dtype(np.int64),
    "prompt_groups": np.dtype(np.int64), "group_mask_sums": np.dtype(np.float64),
    "rewards": np.dtype(np.float64), "advantages": np.dtype(np.float64),
    "statuses": np.dtype(np.uint8), "removed": np.dtype(np.bool_),
    "sample_indices": np.dtype(np.int64),
}


@attrs.frozen(eq=False)
class RolloutBatch:
    """One rollout batch as columns. Build it with ``RolloutBatch.from_samples``."""

    tokens: Int32[np.ndarray, " t"]
    token_offsets: Int64[np.ndarray, " n+1"]
    lengths: Int64[np.ndarray, " n"]
    response_lengths: Int64[np.ndarray, " n"]
    loss_masks: UInt8[np.ndarray, " r"]
    response_offsets: Int64[np.ndarray, " n+1"]
    rollout_log_probs: Float32[np.ndarray, " r"] | None
    group_ids: Int64[np.ndarray, " n"]
    group_id_values: tuple[Hashable, ...]
    prompt_groups: Int64[np.ndarray, " n"]
    prompt_group_values: tuple[Hashable, ...]
    group_mask_sums: Float64[np.ndarray, " n"]
    rewards: Float64[np.ndarray, " n"]
    advantages: Float64[np.ndarray, " n"]
    statuses: UInt8[np.ndarray, " n"]
    removed: Bool[np.ndarray, " n"]
    sample_indices: Int64[np.ndarray, " n"]

    def __attrs_post_init__(self) -> None:
        from vime_pure.batch_checks import check_batch

        check_batch(self)
        for name in COLUMNS:
            column = getattr(self, name)
            if column is not None:
                column.flags.writeable = False

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def num_groups(self) -> int:
        return len(self.group_id_values)

    @property
    def prompt_lengths(self) -> Int64[np.ndarray, " n"]:
        return self.lengths - self.response_lengths

    def columns(self) -> dict[str, np.ndarray | None]:
        """Every array column by name (``COLUMNS`` order); ``rollout_log_probs`` may be None."""
        return {name: getattr(self, name) for name in COLUMNS}

    def original_group_ids(self) -> list[Hashable]:
        """Each sample's original ``group_id`` (what the scheduler reports dropped groups by)."""
        values = self.group_id_values
        return [values[g] for g in self.group_ids.tolist()]

    def sample_tokens(self, i: int) -> Int32[np.ndarray, " l"]:
        """Tokens of sample ``i`` (a read-only view)."""
        return self.tokens[self.token_offsets[i]:self.token_offsets[i + 1]]

    def sample_loss_mask(self, i: int) -> UInt8[np.ndarray, " l"]:
        """Response loss mask of sample ``i`` (a read-only view)."""
        return self.loss_masks[self.response_offsets[i]:self.response_offsets[i + 1]]

    @classmethod
    def from_samples(cls, output: object, *, reward_key: str | None = None,
                     normalization: RewardNormalization = RewardNormalization()
                     ) -> "RolloutBatch":
        """Validate a rollout output (any nesting, see ``vime_pure.rollout``) and build columns.

        ``reward_key`` picks the trained reward from dict rewards; ``normalization`` turns
        rewards into advantages per prompt group. Raises a ``VimeError`` subclass naming the
        sample's path (e.g. ``output[3][1]``) on any malformed input.
        """
        from vime_pure.convert import batch_columns

        return cls(**batch_columns(output, reward_key, normalization))


def schedule_for(batch: RolloutBatch, layout: ParallelLayout, policy: BatchingPolicy,
                 flops: Float64[np.ndarray, " n"] | None = None) -> Schedule:
    """``build_schedule`` on the batch's lengths and original group ids."""
    if not isinstance(batch, RolloutBatch):
        raise RolloutBatchError(f"batch is a {type(batch).__name__}. Fix: pass a RolloutBatch "
                                "(RolloutBatch.from_samples(...)).")
    return build_schedule(batch.lengths, batch.original_group_ids(), layout, policy, flops)
