"""``RolloutBatch``: the frozen, columnar form of one rollout batch, validated at construction.

Ragged per-token data is stored flat with int64 offsets (``vime_pure.data.ragged``): ``tokens``
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
from typing import Any

import attrs
import numpy as np
from jaxtyping import Bool, Float32, Float64, Int32, Int64, TypeCheckError, UInt8

from vime_pure.data.columns import (all_finite, check_dtypes, check_offsets, first_bad,
                                    shape_checker, shape_error)
from vime_pure.data.convert import batch_columns
from vime_pure.data.ragged import row_sums
from vime_pure.data.rewards import RewardNormalization
from vime_pure.data.sample import STATUSES
from vime_pure.denominators import group_totals
from vime_pure.errors import (RolloutBatchError, RolloutValidationError, field_error,
                              type_tag)
from vime_pure.grouping import Grouping
from vime_pure.scheduling.planner import plan_grouped
from vime_pure.scheduling.schedule import Schedule

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
    def from_samples(cls, output: Any, *, reward_key: Any = None,
                     normalization: Any = RewardNormalization()) -> "RolloutBatch":
        """Validate a rollout output (any nesting, see ``vime_pure.data.rollout_output``) and build columns.

        ``reward_key`` picks the trained reward from dict rewards; ``normalization`` turns
        rewards into advantages per prompt group. Raises a ``VimeError`` subclass naming the
        sample's path (e.g. ``output[3][1]``) on any malformed input (arguments are typed
        loosely: this is the user boundary).
        """
        if reward_key is not None and not isinstance(reward_key, str):
            raise field_error(RolloutValidationError, "reward_key", reward_key, "is not a str",
                              "name the dict reward to train on, or pass None")
        if not isinstance(normalization, RewardNormalization):
            raise field_error(RolloutValidationError, "normalization", type_tag(normalization),
                              "is not a RewardNormalization", "pass RewardNormalization(...)")
        return cls(**batch_columns(output, reward_key, normalization))


def schedule_for(batch: Any, layout: Any, policy: Any, flops: Any = None) -> Schedule:
    """The ``Schedule`` of ``batch``: ``build_schedule`` on its lengths and group ids.

    The batch's dense first-occurrence group numbers go straight into the planner (no round
    trip through the original ids); dropped groups are still reported by their original ids.
    Typed loosely (a user boundary): a ``RolloutBatch``, a ``ParallelLayout``, a
    ``BatchingPolicy``; anything else is a typed error.
    """
    if not isinstance(batch, RolloutBatch):
        raise RolloutBatchError(f"batch is a {type(batch).__name__}. Fix: pass a RolloutBatch "
                                "(RolloutBatch.from_samples(...)).")
    grouping = Grouping.from_dense(batch.group_ids, batch.group_id_values)
    return plan_grouped(batch.lengths, grouping, layout, policy, flops)


# -- construction-time checks ---------------------------------------------------------------
def check_batch(b: RolloutBatch) -> None:
    """Every invariant of the module docstring; a typed error naming the column and row."""
    check_dtypes(b, COLUMNS, "RolloutBatch")
    try:
        shape_checker(_shapes)(
            b.lengths, b.token_offsets, b.response_lengths, b.response_offsets, b.tokens,
            b.rollout_log_probs, b.loss_masks, b.group_ids, b.prompt_groups,
            b.group_mask_sums, b.rewards, b.advantages, b.statuses, b.removed, b.sample_indices)
    except TypeCheckError as exc:
        raise shape_error("RolloutBatch", b, exc) from None
    first_bad(b.lengths < 1, "lengths", b.lengths, "every sample needs at least one token")
    first_bad((b.response_lengths < 0) | (b.response_lengths > b.lengths), "response_lengths",
               b.response_lengths, "must lie in [0, lengths[i]]")
    check_offsets("token_offsets", b.token_offsets, b.lengths, "tokens", len(b.tokens),
                  "lengths")
    check_offsets("response_offsets", b.response_offsets, b.response_lengths, "loss_masks",
                  len(b.loss_masks), "response_lengths")
    # Per-token columns are large: one reduction each, the locating pass only on failure.
    if b.tokens.size and b.tokens.min() < 0:
        first_bad(b.tokens < 0, "tokens", b.tokens, "token ids are non-negative")
    if b.loss_masks.size and b.loss_masks.max() > 1:
        first_bad(b.loss_masks > 1, "loss_masks", b.loss_masks, "masks are 0/1")
    mask_sums = row_sums(b.loss_masks, b.response_offsets)
    first_bad(b.removed & (mask_sums > 0), "loss_masks of removed sample", mask_sums,
               "remove_sample zeroes the mask")
    if b.rollout_log_probs is not None and not all_finite(b.rollout_log_probs):
        first_bad(~np.isfinite(b.rollout_log_probs), "rollout_log_probs", b.rollout_log_probs,
                   "log-probs are finite")
    _check_dense("group_ids", b.group_ids, b.group_id_values)
    _check_dense("prompt_groups", b.prompt_groups, b.prompt_group_values)
    first = np.unique(b.group_ids, return_index=True)[1]
    first_bad(b.prompt_groups != b.prompt_groups[first][b.group_ids], "prompt_groups",
               b.prompt_groups, "a rollout group answers one prompt")
    expected = group_totals(b.group_ids, mask_sums.astype(np.float64))
    first_bad(b.group_mask_sums != expected, "group_mask_sums", b.group_mask_sums,
               f"must equal the group's loss-mask total (here {expected.tolist()[:4]}...)")
    for name in ("rewards", "advantages"):
        col = getattr(b, name)
        first_bad(~np.isfinite(col), name, col, "must be finite")
        first_bad(col != col[first][b.group_ids], name, col, "siblings share one value")
    first_bad(b.statuses >= len(STATUSES), "statuses", b.statuses,
               f"codes index {[s.value for s in STATUSES]}")
    first_bad(b.sample_indices < -1, "sample_indices", b.sample_indices, "-1 means unknown")


def _check_dense(name: str, ids: np.ndarray, values: Any) -> None:
    if not isinstance(values, tuple):
        raise RolloutBatchError(f"{name} original values are a {type(values).__name__}. Fix: "
                                "pass a tuple of the distinct int/str ids.")
    bad = [v for v in values if type(v) not in (int, str)]
    if bad or len(set(values)) != len(values):
        raise RolloutBatchError(f"{name} original values {list(values)[:8]} must be distinct "
                                "ints or strs. Fix: use unique int/str ids.")
    uniq, first = np.unique(ids, return_index=True)
    if not np.array_equal(uniq, np.arange(len(values))) or np.any(np.diff(first) <= 0):
        raise RolloutBatchError(f"{name} must number {len(values)} groups 0..{len(values) - 1} "
                                f"in first-occurrence order, got {ids[:8].tolist()}... Fix: "
                                "densify with vime_pure.grouping.group_samples.")


def _shapes(lengths: Int64[np.ndarray, " n"], token_offsets: Int64[np.ndarray, " n+1"],
            response_lengths: Int64[np.ndarray, " n"],
            response_offsets: Int64[np.ndarray, " n+1"], tokens: Int32[np.ndarray, " t"],
            rollout_log_probs: Float32[np.ndarray, " r"] | None,
            loss_masks: UInt8[np.ndarray, " r"],
            group_ids: Int64[np.ndarray, " n"], prompt_groups: Int64[np.ndarray, " n"],
            group_mask_sums: Float64[np.ndarray, " n"], rewards: Float64[np.ndarray, " n"],
            advantages: Float64[np.ndarray, " n"], statuses: UInt8[np.ndarray, " n"],
            removed: Bool[np.ndarray, " n"], sample_indices: Int64[np.ndarray, " n"]) -> None:
    """Cross-field shapes: per-sample columns n, offsets n+1, masks and log-probs alike."""
