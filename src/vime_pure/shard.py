"""Per-rank shards of a ``RolloutBatch`` under a ``Schedule``, and packed micro-batch rows.

``shard(batch, schedule)`` gives one ``RankShard`` per DP rank: the rank's rows in execution
order (``schedule.partitions[rank]``), gathered with numpy fancy indexing (no per-sample Python
lists), its ``micro_batch_indices``, and per step ``num_microbatches`` and ``num_groups`` (the
``G_s`` that the loss divides by). Because ``micro_batch_indices`` enumerate the partition in
order, micro-batch ``j`` is the contiguous rows ``microbatch_offsets[j]:microbatch_offsets[j+1]``.

Per-sample values computed over the *whole* batch travel with the rows: ``group_mask_sums``
(sibling totals across all ranks) and ``advantages`` (prompt-group statistics).

Invariants the tests assert: concatenating every rank's rows in schedule order reproduces the
batch rows of ``schedule.partitions``; each shard's micro-batch offsets match its
``micro_batch_indices``; per-step counts equal the schedule's.

Access path for a trainer (e.g. the Megatron shell), micro-batch ``j`` of this rank::

    shards = shard(batch, schedule_for(batch, layout, policy))
    mine = shards[dp_rank]
    for j in range(mine.num_microbatches_total):
        mb = mine.microbatch(j)     # PackedMicroBatch: one packed row
        mb.tokens                   # int32 [T], samples back to back
        mb.positions                # int64 [T], restart at 0 for every sample
        mb.cu_seqlens               # int64 [k+1], sample boundaries in the row
        mb.loss_mask                # float32 [T], 0 on prompts, the response mask elsewhere
        mb.advantages               # float32 [T], the sample's advantage on response tokens
        mb.rollout_log_probs        # float32 [T] or None, engine log-prob per token, 0 on prompts
        mb.group_mask_sums          # float64 [k], per-sample group denominators
        mb.num_groups               # G_s of the micro-batch's step (mb.step)
        mb.num_samples              # N_s of that step (for sample_token_mean's step_divisor)

Example: 2 samples of lengths 3 and 2 (response 2 and 1) packed in one micro-batch give
``positions == [0, 1, 2, 0, 1]``, ``cu_seqlens == [0, 3, 5]`` and
``loss_mask == [0, 1, 1, 0, 1]``. Per-token values sit at the token they describe; shifting
for next-token prediction is the trainer's job.
"""

import attrs
import numpy as np
from jaxtyping import Float32, Float64, Int32, Int64, TypeCheckError, UInt8

from vime_pure.batch import RolloutBatch
from vime_pure.batch_checks import check_dtypes, check_offsets, shape_checker, shape_error
from vime_pure.errors import RolloutBatchError
from vime_pure.ragged import gather_rows, offsets_from_lengths, row_positions
from vime_pure.schedule import MicroBatch, Schedule

SHARD_COLUMNS: dict[str, np.dtype] = {
    "sample_indices": np.dtype(np.int64), "tokens": np.dtype(np.int32),
    "token_offsets": np.dtype(np.int64), "lengths": np.dtype(np.int64),
    "response_lengths": np.dtype(np.int64), "loss_masks": np.dtype(np.uint8),
    "response_offsets": np.dtype(np.int64), "rollout_log_probs": np.dtype(np.float32),
    "group_ids": np.dtype(np.int64), "group_mask_sums": np.dtype(np.float64),
    "advantages": np.dtype(np.float64), "rewards": np.dtype(np.float64),
    "microbatch_offsets": np.dtype(np.int64), "step_of_microbatch": np.dtype(np.int64),
}


@attrs.frozen(kw_only=True)
class PackedMicroBatch:
    """One micro-batch as a packed row (see the module docstring for every field)."""

    step: int
    num_groups: int
    num_samples: int
    sample_indices: Int64[np.ndarray, " k"]
    cu_seqlens: Int64[np.ndarray, " k+1"]
    tokens: Int32[np.ndarray, " T"]
    positions: Int64[np.ndarray, " T"]
    loss_mask: Float32[np.ndarray, " T"]
    advantages: Float32[np.ndarray, " T"]
    rollout_log_probs: Float32[np.ndarray, " T"] | None
    group_mask_sums: Float64[np.ndarray, " k"]

    def __attrs_post_init__(self) -> None:
        try:
            shape_checker(_packed_shapes)(
                self.sample_indices, self.cu_seqlens, self.group_mask_sums, self.tokens,
                self.positions, self.loss_mask, self.advantages, self.rollout_log_probs)
        except TypeCheckError as exc:
            raise shape_error("PackedMicroBatch", self, exc) from None


@attrs.frozen(kw_only=True, eq=False)
class RankShard:
    """The rows one DP rank trains, in execution order, plus the step bookkeeping.

    Row ``i`` is batch row ``sample_indices[i]``. Ragged columns are flat with offsets rebased
    to this shard. ``num_microbatches[s]`` / ``num_groups[s]`` are step ``s``'s per-rank
    micro-batch count and group count ``G_s``, ``num_samples[s]`` its sample count ``N_s``
    over all ranks; ``step_of_microbatch[j]`` is micro-batch ``j``'s step.
    """

    rank: int
    sample_indices: Int64[np.ndarray, " k"]
    tokens: Int32[np.ndarray, " t"]
    token_offsets: Int64[np.ndarray, " k+1"]
    lengths: Int64[np.ndarray, " k"]
    response_lengths: Int64[np.ndarray, " k"]
    loss_masks: UInt8[np.ndarray, " r"]
    response_offsets: Int64[np.ndarray, " k+1"]
    rollout_log_probs: Float32[np.ndarray, " r"] | None
    group_ids: Int64[np.ndarray, " k"]
    group_mask_sums: Float64[np.ndarray, " k"]
    advantages: Float64[np.ndarray, " k"]
    rewards: Float64[np.ndarray, " k"]
    micro_batch_indices: tuple[MicroBatch, ...]
    microbatch_offsets: Int64[np.ndarray, " m+1"]
    step_of_microbatch: Int64[np.ndarray, " m"]
    num_microbatches: tuple[int, ...]
    num_groups: tuple[int, ...]
    num_samples: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        _check_shard(self)
        for name in SHARD_COLUMNS:
            column = getattr(self, name)
            if column is not None:
                column.flags.writeable = False

    @property
    def num_microbatches_total(self) -> int:
        return len(self.micro_batch_indices)

    def rows(self, j: int) -> slice:
        """Rows of micro-batch ``j`` (contiguous, in execution order)."""
        return slice(int(self.microbatch_offsets[j]), int(self.microbatch_offsets[j + 1]))

    def microbatches_of_step(self, step: int) -> range:
        """This rank's micro-batch numbers in step ``step``."""
        start = sum(self.num_microbatches[:step])
        return range(start, start + self.num_microbatches[step])

    def microbatch(self, j: int) -> PackedMicroBatch:
        """Micro-batch ``j`` as one packed row: views for tokens, per-token arrays for the rest."""
        rows = self.rows(j)
        lens, resp = self.lengths[rows], self.response_lengths[rows]
        t0, t1 = int(self.token_offsets[rows.start]), int(self.token_offsets[rows.stop])
        cu = self.token_offsets[rows.start:rows.stop + 1] - t0
        total = t1 - t0
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lens)
        # Response token p of the row sits after its sample's prompt.
        r0, r1 = int(self.response_offsets[rows.start]), int(self.response_offsets[rows.stop])
        resp_pos = (np.repeat(cu[:-1] + lens - resp, resp)
                    + np.arange(r1 - r0, dtype=np.int64)
                    - np.repeat(self.response_offsets[rows] - r0, resp))
        loss_mask = np.zeros(total, dtype=np.float32)
        loss_mask[resp_pos] = self.loss_masks[r0:r1]
        advantages = np.zeros(total, dtype=np.float32)
        advantages[resp_pos] = np.repeat(self.advantages[rows], resp)
        log_probs = None
        if self.rollout_log_probs is not None:
            log_probs = np.zeros(total, dtype=np.float32)
            log_probs[resp_pos] = self.rollout_log_probs[r0:r1]
        step = int(self.step_of_microbatch[j])
        return PackedMicroBatch(
            step=step, num_groups=self.num_groups[step], num_samples=self.num_samples[step],
            sample_indices=self.sample_indices[rows], cu_seqlens=cu,
            tokens=self.tokens[t0:t1], positions=positions, loss_mask=loss_mask,
            advantages=advantages, rollout_log_probs=log_probs,
            group_mask_sums=self.group_mask_sums[rows])


def shard(batch: RolloutBatch, schedule: Schedule) -> tuple[RankShard, ...]:
    """Every DP rank's shard of ``batch`` under ``schedule`` (built for this batch)."""
    _check_schedule_matches(batch, schedule)
    per_step = tuple(step.num_microbatches for step in schedule.steps)
    groups = tuple(step.num_groups for step in schedule.steps)
    samples = tuple(step.num_samples for step in schedule.steps)
    step_of = np.repeat(np.arange(len(per_step), dtype=np.int64), per_step)
    return tuple(_rank_shard(batch, schedule, rank, per_step, groups, samples, step_of)
                 for rank in range(schedule.layout.dp))


def _rank_shard(batch: RolloutBatch, schedule: Schedule, rank: int, per_step: tuple[int, ...],
                groups: tuple[int, ...], samples: tuple[int, ...], step_of: np.ndarray
                ) -> RankShard:
    rows = np.asarray(schedule.partitions[rank], dtype=np.int64)
    tokens, token_offsets = gather_rows(batch.tokens, batch.token_offsets, rows)
    resp_pos = row_positions(batch.response_offsets, rows)
    mbs = schedule.micro_batch_indices[rank]
    return RankShard(
        rank=rank, sample_indices=rows, tokens=tokens, token_offsets=token_offsets,
        lengths=batch.lengths[rows], response_lengths=batch.response_lengths[rows],
        loss_masks=batch.loss_masks[resp_pos],
        response_offsets=offsets_from_lengths(batch.response_lengths[rows]),
        rollout_log_probs=(None if batch.rollout_log_probs is None
                           else batch.rollout_log_probs[resp_pos]),
        group_ids=batch.group_ids[rows], group_mask_sums=batch.group_mask_sums[rows],
        advantages=batch.advantages[rows], rewards=batch.rewards[rows],
        micro_batch_indices=mbs,
        microbatch_offsets=offsets_from_lengths(np.array([len(mb) for mb in mbs],
                                                         dtype=np.int64)),
        step_of_microbatch=step_of.copy(), num_microbatches=per_step, num_groups=groups,
        num_samples=samples)


def _check_schedule_matches(batch: RolloutBatch, schedule: Schedule) -> None:
    if not isinstance(batch, RolloutBatch) or not isinstance(schedule, Schedule):
        raise RolloutBatchError(f"shard(batch, schedule) got {type(batch).__name__} and "
                                f"{type(schedule).__name__}. Fix: pass a RolloutBatch and the "
                                "Schedule built for it (schedule_for(batch, layout, policy)).")
    lengths = np.asarray(schedule.lengths, dtype=np.int64)
    groups = np.asarray(schedule.sample_group, dtype=np.int64)
    if not (np.array_equal(lengths, batch.lengths) and np.array_equal(groups, batch.group_ids)):
        raise RolloutBatchError(
            f"the schedule was built for another batch ({len(lengths)} samples, lengths "
            f"{lengths[:4].tolist()}...) than this one ({batch.num_samples} samples, lengths "
            f"{batch.lengths[:4].tolist()}...). Fix: schedule this batch with "
            "schedule_for(batch, layout, policy).")


def _check_shard(s: RankShard) -> None:
    check_dtypes(s, SHARD_COLUMNS, "RankShard")
    try:
        shape_checker(_shapes)(
            s.sample_indices, s.lengths, s.response_lengths, s.group_ids, s.group_mask_sums,
            s.advantages, s.rewards, s.token_offsets, s.response_offsets, s.tokens,
            s.rollout_log_probs, s.loss_masks, s.step_of_microbatch, s.microbatch_offsets)
    except TypeCheckError as exc:
        raise shape_error("RankShard", s, exc) from None
    check_offsets("token_offsets", s.token_offsets, s.lengths, "tokens", len(s.tokens),
                  "lengths")
    check_offsets("response_offsets", s.response_offsets, s.response_lengths, "loss_masks",
                  len(s.loss_masks), "response_lengths")
    sizes = np.array([len(mb) for mb in s.micro_batch_indices], dtype=np.int64)
    starts = [mb[0] if mb else -1 for mb in s.micro_batch_indices]
    if (not np.array_equal(offsets_from_lengths(sizes), s.microbatch_offsets)
            or starts != s.microbatch_offsets[:-1].tolist()
            or int(s.microbatch_offsets[-1]) != len(s.lengths)):
        raise RolloutBatchError(f"RankShard {s.rank}: micro_batch_indices do not enumerate its "
                                "rows in order. Fix: build shards with shard(batch, schedule).")
    expected_steps = np.repeat(np.arange(len(s.num_microbatches)), s.num_microbatches)
    if (not len(s.num_groups) == len(s.num_samples) == len(s.num_microbatches)
            or not np.array_equal(expected_steps, s.step_of_microbatch)):
        raise RolloutBatchError(f"RankShard {s.rank}: num_microbatches={s.num_microbatches}, "
                                f"num_groups={s.num_groups}, num_samples={s.num_samples} and "
                                "step_of_microbatch disagree. "
                                "Fix: build shards with shard(batch, schedule).")


def _shapes(sample_indices: Int64[np.ndarray, " k"], lengths: Int64[np.ndarray, " k"],
            response_lengths: Int64[np.ndarray, " k"], group_ids: Int64[np.ndarray, " k"],
            group_mask_sums: Float64[np.ndarray, " k"], advantages: Float64[np.ndarray, " k"],
            rewards: Float64[np.ndarray, " k"], token_offsets: Int64[np.ndarray, " k+1"],
            response_offsets: Int64[np.ndarray, " k+1"], tokens: Int32[np.ndarray, " t"],
            rollout_log_probs: Float32[np.ndarray, " r"] | None,
            loss_masks: UInt8[np.ndarray, " r"],
            step_of_microbatch: Int64[np.ndarray, " m"],
            microbatch_offsets: Int64[np.ndarray, " m+1"]) -> None:
    """Cross-field shapes of a shard: rows k, offsets k+1, masks/log-probs r, micro-batches m."""


def _packed_shapes(sample_indices: Int64[np.ndarray, " k"], cu_seqlens: Int64[np.ndarray, " k+1"],
                   group_mask_sums: Float64[np.ndarray, " k"], tokens: Int32[np.ndarray, " T"],
                   positions: Int64[np.ndarray, " T"], loss_mask: Float32[np.ndarray, " T"],
                   advantages: Float32[np.ndarray, " T"],
                   rollout_log_probs: Float32[np.ndarray, " T"] | None) -> None:
    """Cross-field shapes of a packed row: k samples, T tokens."""
