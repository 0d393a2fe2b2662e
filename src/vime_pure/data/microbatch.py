"""What a trainer rank consumes: its micro-batches as packed rows, built once by the core.

Purpose: ``rank_batch(batch, schedule, dp_rank=..., loss_mode=..., cp_size=, cp_rank=)`` turns a
``RolloutBatch`` and the ``Schedule`` planned for it into that (DP, CP) rank's
``TrainMicroBatch`` records, step by step. The trainer only converts records to tensors
(attention mask or THD ``PackedSeqParams``, device); every number in them is decided here.

One record is one packed row (the micro-batch's samples back to back):

- ``tokens``, ``positions`` (restarting at 0 for every sample) and ``labels`` (the next token of
  the same sample; 0 after a sample's last token) over the row's ``T`` local positions;
- per response token this rank scores (``R`` of them): ``logit_index`` (the local position whose
  output predicts it), ``response_index`` (its place in the batch's flat response columns, so
  the token keeps its batch identity), ``share_index`` (its place in this rank's share, the
  ``RankShare``'s flat response columns: log-prob arrays are share-sized and indexed by it),
  ``token_sample`` (its sample's position in
  the row), ``loss_mask``, ``advantages`` and the engine's ``rollout_log_probs``; ``old_log_probs``
  ``ref_log_probs`` and ``teacher_log_probs`` (on-policy distillation's teacher) once attached
  with :func:`with_log_probs` (a teacher server's, ``--opd-type sglang``, come with the share);
  ``opd_reverse_kl`` (top-k on-policy distillation's per-token reverse-KL estimates, not
  log-probs) comes with the share when the batch records it;
  ``is_weights`` (``--tis-function mis``: each token's importance weight, computed on whole
  samples, ``vime_pure.data.rejection.with_is_weights``);
- ``routed_experts`` (MoE routing replay, when the batch has ``rollout_routed_experts``): one
  row of ``layers * topk`` expert ids per local position, gathered with the tokens (a padding
  position repeats its sample's last token's row: it scores nothing, any valid route is exact);
- per sample: ``denominators``, the step-level ``D`` of ``loss_mode``
  (``vime_pure.denominators.step_denominators``: whole step, whole group, never this row);
- the step's ``G_s`` (``num_groups``), ``N_s`` (``num_samples``) and per-rank micro-batch count
  ``K`` (``num_microbatches``): with ``loss_mode`` they give ``megatron_loss_scale``.

Context parallelism (``cp_size > 1``): every sample is padded to ``2*cp*chunk`` positions and the
row keeps this CP rank's two zigzag chunks of each sample, cut by ``vime_pure.cp``; the response
tokens kept are those whose logit position is local. ``seq_lengths`` are the padded (global)
lengths, the ``cu_seqlens`` of THD packing.

Invariants the tests assert (``tests/data_invariants.py``, ``assert_microbatch_invariants``): over the
CP ranks of a micro-batch every response token of its samples appears exactly once; the token at
``labels[logit_index]`` is that response token; ``denominators`` equal ``step_denominators``;
the records of every (DP, CP) rank together cover exactly the scheduled samples, in schedule
order.

Example: samples ``[5, 6, 7]`` (response 2) and ``[8, 9]`` (response 1) in one micro-batch give
``tokens [5, 6, 7, 8, 9]``, ``positions [0, 1, 2, 0, 1]``, ``labels [6, 7, 0, 9, 0]`` and
``logit_index [0, 1, 3]``; under ``group_token_mean`` with masks ``[1, 0]`` and ``[1]`` in two
groups, ``denominators [1, 1]``.
"""

from typing import Any

import attrs
import numpy as np
from jaxtyping import Float32, Float64, Int16, Int32, Int64, TypeCheckError

from vime_pure.config import as_int
from vime_pure.cp import zigzag_row_positions
from vime_pure.data.batch import RolloutBatch
from vime_pure.data.columns import (RESPONSE_FLOAT_COLUMNS, all_finite, check_dtypes,
                                    first_bad, shape_checker, shape_error)
from vime_pure.data.ragged import offsets_from_lengths
from vime_pure.data.shares import RankShare, response_floats, share_of_batch
from vime_pure.denominators import LossMode, step_denominators
from vime_pure.errors import RolloutBatchError, Shown, field_error, type_tag
from vime_pure.scheduling.schedule import Schedule


@attrs.frozen(kw_only=True, eq=False)
class TrainMicroBatch:
    """One micro-batch of one (DP, CP) rank as a packed row (fields: module docstring)."""

    step: int
    loss_mode: LossMode = attrs.field(converter=lambda v: LossMode.parse(v))
    num_groups: int
    num_samples: int
    num_microbatches: int
    cp_rank: int
    cp_size: int
    sample_indices: Int64[np.ndarray, " k"]
    seq_lengths: Int64[np.ndarray, " k"]
    denominators: Float64[np.ndarray, " k"]
    tokens: Int32[np.ndarray, " T"]
    positions: Int32[np.ndarray, " T"]
    labels: Int32[np.ndarray, " T"]
    logit_index: Int32[np.ndarray, " R"]
    response_index: Int64[np.ndarray, " R"]
    share_index: Int32[np.ndarray, " R"]
    token_sample: Int32[np.ndarray, " R"]
    loss_mask: Float32[np.ndarray, " R"]
    advantages: Float32[np.ndarray, " R"]
    rollout_log_probs: Float32[np.ndarray, " R"] | None = None
    old_log_probs: Float32[np.ndarray, " R"] | None = None
    ref_log_probs: Float32[np.ndarray, " R"] | None = None
    teacher_log_probs: Float32[np.ndarray, " R"] | None = None
    opd_reverse_kl: Float32[np.ndarray, " R"] | None = None
    routed_experts: Int16[np.ndarray, "T e"] | None = None
    is_weights: Float32[np.ndarray, " R"] | None = None

    def __attrs_post_init__(self) -> None:
        _check_counts(self)
        check_dtypes(self, MICROBATCH_COLUMNS, "TrainMicroBatch",
                     optional=(*SCORED_FLOAT_COLUMNS, "routed_experts", "is_weights"))
        try:
            shape_checker(_shapes)(
                self.sample_indices, self.seq_lengths, self.denominators, self.tokens,
                self.positions, self.labels, self.logit_index, self.response_index,
                self.share_index, self.token_sample, self.loss_mask, self.advantages,
                self.rollout_log_probs, self.old_log_probs, self.ref_log_probs,
                self.teacher_log_probs, self.opd_reverse_kl, self.routed_experts,
                self.is_weights)
        except TypeCheckError as exc:
            raise shape_error("TrainMicroBatch", self, exc) from None
        _check_values(self)

    @property
    def num_tokens(self) -> int:
        """Local row length ``T`` (this CP rank's positions)."""
        return len(self.tokens)

    @property
    def token_denominators(self) -> Float64[np.ndarray, " R"]:
        """``D`` of every scored token: its sample's step-level denominator."""
        return self.denominators[self.token_sample]


@attrs.frozen(kw_only=True, eq=False)
class StepBatch:
    """One optimizer step on one rank: ``G_s``, ``N_s`` and the rank's ``K`` micro-batches."""

    num_groups: int
    num_samples: int
    microbatches: tuple[TrainMicroBatch, ...]


@attrs.frozen(kw_only=True, eq=False)
class RankBatch:
    """Everything one (DP, CP) rank trains from one rollout batch, step by step.

    ``num_response_tokens`` is the rank's share's flat response length: log-prob arrays in
    share coordinates (``share_index``) have this size, never the whole batch's.
    """

    dp_rank: int
    cp_rank: int
    cp_size: int
    loss_mode: LossMode
    num_response_tokens: int
    steps: tuple[StepBatch, ...]

    @property
    def microbatches(self) -> tuple[TrainMicroBatch, ...]:
        """Every micro-batch of every step, in execution order."""
        return tuple(mb for step in self.steps for mb in step.microbatches)


def rank_batch(batch: Any, schedule: Any, *, dp_rank: Any,
               loss_mode: Any = LossMode.GROUP_TOKEN_MEAN, cp_size: Any = 1,
               cp_rank: Any = 0, norm: Any = None, row_multiple: Any = 1) -> RankBatch:
    """The records DP rank ``dp_rank`` / CP rank ``cp_rank`` trains (see the module docstring).

    ``row_multiple``: every row's length is padded up to a multiple of it (the TP size under
    Megatron's sequence parallelism, which splits the row over the TP ranks); the pad extends
    the row's last sample and is never scored. Example: samples of 5 and 6 tokens at
    ``row_multiple=4`` give ``seq_lengths [5, 7]`` (a row of 12).

    Typed loosely on purpose (a user boundary): a ``RolloutBatch``, its ``Schedule``, int
    ranks, a ``LossMode`` or its name; every value is checked here with a typed error.
    ``norm``: the constant of ``sample_token_sum_norm`` (e.g. the max response length).
    Raises ``RolloutBatchError`` when the schedule was planned for another batch or a rank is
    out of range, ``LossConfigError`` for a bad mode or norm. The rank's samples are cut from
    the batch (``share_of_batch``) and built by :func:`share_batch`, the loop's path.
    """
    _check_schedule_matches(batch, schedule)
    dp_rank = _rank("dp_rank", dp_rank, schedule.layout.dp)
    share = share_of_batch(batch, schedule.rank_sample_ids(dp_rank))
    return share_batch(share, schedule, batch.mask_sums, dp_rank=dp_rank, loss_mode=loss_mode,
                       cp_size=cp_size, cp_rank=cp_rank, norm=norm, row_multiple=row_multiple)


def share_batch(share: Any, schedule: Any, mask_sums: Any, *, dp_rank: Any,
                loss_mode: Any = LossMode.GROUP_TOKEN_MEAN, cp_size: Any = 1,
                cp_rank: Any = 0, norm: Any = None, row_multiple: Any = 1) -> RankBatch:
    """The records of DP rank ``dp_rank`` from its ``RankShare`` alone (``vime_pure.data.
    shares``): the same records ``rank_batch`` builds from the whole batch.

    ``mask_sums``: every sample's loss-mask total (``RolloutBatch.mask_sums``, or the plan's
    int32 column): the step denominators need the whole step, which only these numbers cover.
    Cost: O(share tokens) plus O(samples) on small int arrays; no whole-batch token is read.
    Example: a share of 2 of a batch's 8 samples gives that rank's 1 micro-batch of 2.
    """
    if not isinstance(share, RankShare) or not isinstance(schedule, Schedule):
        raise RolloutBatchError(f"share_batch(share, schedule) got {type(share).__name__} and "
                                f"{type(schedule).__name__}. Fix: pass the RankShare "
                                "assemble_share built and the plan's Schedule.")
    mode = LossMode.parse(loss_mode)
    dp_rank = _rank("dp_rank", dp_rank, schedule.layout.dp)
    cp_size = as_int("cp_size", cp_size, 1, RolloutBatchError, "pass the context-parallel size")
    if cp_size > MAX_CP:  # each sample is padded to a multiple of 2 * cp_size (int64 math)
        raise field_error(RolloutBatchError, "cp_size", cp_size, f"exceeds {MAX_CP}",
                          "pass the context-parallel size of the trainer")
    cp_rank = _rank("cp_rank", cp_rank, cp_size)
    row_multiple = as_int("row_multiple", row_multiple, 1, RolloutBatchError,
                          "pass the TP size under sequence parallelism, else 1")
    if row_multiple > 1 and cp_size > 1:
        raise field_error(RolloutBatchError, "row_multiple", row_multiple,
                          f"is not wired with cp_size={cp_size} (each CP chunk would need it)",
                          "use sequence parallelism without context parallelism")
    _check_share_matches(share, schedule, dp_rank, mask_sums)
    if share.num_response_tokens >= 2**31:  # share_index is int32
        raise field_error(RolloutBatchError, "share", share.num_response_tokens,
                          "response tokens on one DP rank exceed 2**31",
                          "spread the batch over more DP ranks or use fewer samples")
    dens = step_denominators(mode, schedule.group_array,
                             np.asarray(mask_sums).astype(np.float64),
                             step_of_sample(schedule), norm=norm)
    sizes, offsets = np.diff(schedule.mb_offsets), schedule.mb_offsets
    steps, pos = [], 0
    for s, count in enumerate(schedule.step_microbatches.tolist()):
        lo, hi = schedule.step_mb_range(s)
        num_groups = int(schedule.step_groups[s])
        num_samples = int(offsets[hi] - offsets[lo])  # every rank's, from the offsets
        records = []
        for m in range(lo + dp_rank * count, lo + (dp_rank + 1) * count):
            k = int(sizes[m])
            records.append(_record(share, pos, pos + k, dens, cp_rank, cp_size, row_multiple,
                                   step=s, loss_mode=mode, num_groups=num_groups,
                                   num_samples=num_samples, num_microbatches=count))
            pos += k
        steps.append(StepBatch(num_groups=num_groups, num_samples=num_samples,
                               microbatches=tuple(records)))
    return RankBatch(dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp_size, loss_mode=mode,
                     num_response_tokens=share.num_response_tokens, steps=tuple(steps))


def with_log_probs(rank: Any, *, old_log_probs: Any = None, ref_log_probs: Any = None,
                   teacher_log_probs: Any = None, old_from_step: Any = 0) -> RankBatch:
    """``rank`` with ``old_log_probs`` / ``ref_log_probs`` / ``teacher_log_probs`` attached to
    every record.

    Both are flat float arrays in share coordinates (``num_response_tokens`` long, e.g. from
    the trainer's log-prob pass); each record gathers its tokens by ``share_index``.
    ``old_from_step=1`` leaves step 0's records without old log-probs: a trainer then uses the
    current ones, detached (ratio 1), which is exact on policy, where step 0 trains the weights
    that generated the batch; later steps follow an update and need the recomputed values.
    Example: ``with_log_probs(rb, old_log_probs=logps)`` gives records whose ``old_log_probs``
    equal ``logps[mb.share_index]``.
    """
    if not isinstance(rank, RankBatch):
        raise field_error(RolloutBatchError, "rank", type_tag(rank), "is not a RankBatch",
                          "pass what rank_batch returned")
    columns = {}
    for name, values in (("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs),
                         ("teacher_log_probs", teacher_log_probs)):
        if values is None:
            continue
        arr = values if isinstance(values, np.ndarray) else None
        if arr is None or arr.shape != (rank.num_response_tokens,) or arr.dtype.kind != "f":
            raise field_error(RolloutBatchError, name, type_tag(values) if arr is None else
                              Shown(f"<{arr.dtype}{list(arr.shape)}>"),
                              f"is not a float array of the batch's {rank.num_response_tokens} "
                              "response tokens", "pass log-probs in share coordinates "
                              "(the trainer's compute_log_probs)")
        columns[name] = arr  # NaN where another rank scores the token: only ours must be finite
    if isinstance(old_from_step, bool) or not isinstance(old_from_step, int) or old_from_step < 0:
        raise field_error(RolloutBatchError, "old_from_step", old_from_step,
                          "is not a step index >= 0", "pass 0 (every step) or 1 (on policy)")
    steps = []
    for s, step in enumerate(rank.steps):
        names = [n for n in columns if n != "old_log_probs" or s >= old_from_step]
        records = []
        for mb in step.microbatches:
            attached = {name: columns[name][mb.share_index] for name in names}
            for name, mine in attached.items():
                if not all_finite(mine):
                    first_bad(~np.isfinite(mine), f"{name}[response_index]", mine, "is finite",
                              "fill every token this rank scores (the trainer's log-prob pass)")
            records.append(attrs.evolve(mb, **{name: mine.astype(np.float32, copy=False)
                                               for name, mine in attached.items()}))
        steps.append(attrs.evolve(step, microbatches=tuple(records)))
    return attrs.evolve(rank, steps=tuple(steps))


def _record(share: RankShare, a: int, b: int, dens: np.ndarray, cp_rank: int, cp_size: int,
            row_multiple: int, **step_fields) -> TrainMicroBatch:
    """The packed row of the share's samples ``a .. b - 1`` (one micro-batch, consecutive in
    the share's execution order); vectorised over its samples (CP cuts per sample)."""
    lens, resp = share.lengths[a:b], share.response_lengths[a:b]
    seq = lens if cp_size == 1 else -(-lens // (2 * cp_size)) * (2 * cp_size)
    if row_multiple > 1 and len(seq):  # the pad extends the last sample (rank_batch)
        seq = seq.copy()
        seq[-1] += -int(seq.sum()) % row_multiple
    starts = offsets_from_lengths(seq)[:-1]
    total = int(seq.sum())
    # Real tokens of sample k sit at starts[k] .. starts[k] + lens[k]; CP padding after them.
    real = _within(seq, lens)
    tokens = np.zeros(total, dtype=np.int32)
    tokens[real] = share.tokens[share.token_offsets[a]:share.token_offsets[b]]
    routes = share.rollout_routed_experts
    source = None  # MoE routing replay only: each position's share token (a padding
    if routes is not None:  # position: its sample's last token), to gather its route row
        source = np.repeat(share.token_offsets[a:b] + lens - 1, seq)
        source[real] = np.arange(share.token_offsets[a], share.token_offsets[b],
                                 dtype=np.int64)
    positions = (np.arange(total, dtype=np.int64) - np.repeat(starts, seq)).astype(np.int32)
    labels = np.zeros(total, dtype=np.int32)
    has_next = _within(seq, lens - 1)  # every position but each sample's last real one
    labels[np.flatnonzero(has_next)] = tokens[np.flatnonzero(has_next) + 1]
    within = _ranks_within(resp)
    response_index = np.repeat(share.response_starts[a:b], resp) + within
    share_index = np.arange(share.response_offsets[a], share.response_offsets[b],
                            dtype=np.int32)
    # Response token j of sample k is predicted by row position starts + P - 1 + j.
    first_logit = starts + lens - resp - 1
    logit_index = np.repeat(first_logit, resp) + within
    token_sample = np.repeat(np.arange(b - a, dtype=np.int32), resp)
    keep = slice(None)
    if cp_size > 1:
        local = zigzag_row_positions(seq.tolist(), cp_rank, cp_size)
        to_local = np.full(total, -1, dtype=np.int64)
        to_local[local] = np.arange(len(local))
        keep = to_local[logit_index] >= 0
        tokens, positions, labels = tokens[local], positions[local], labels[local]
        logit_index = to_local[logit_index[keep]]
        source = None if source is None else source[local]
    share_index = share_index[keep]
    idx = share.sample_ids[a:b]
    return TrainMicroBatch(
        **step_fields, cp_rank=cp_rank, cp_size=cp_size, sample_indices=idx,
        seq_lengths=seq.astype(np.int64, copy=False), denominators=dens[idx], tokens=tokens,
        positions=positions, labels=labels, logit_index=logit_index.astype(np.int32),
        response_index=response_index[keep], share_index=share_index,
        token_sample=token_sample[keep],
        loss_mask=share.loss_masks[share_index].astype(np.float32),
        advantages=np.repeat(share.advantages[a:b], resp)[keep].astype(np.float32, copy=False),
        **response_floats(share, share_index),
        routed_experts=None if routes is None else routes[source])


def _ranks_within(sizes: np.ndarray) -> np.ndarray:
    """``[0..sizes[0]), [0..sizes[1]), ...`` concatenated. Example: ``[2, 0, 3]`` -> 0 1 0 1 2."""
    total = int(sizes.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(offsets_from_lengths(sizes)[:-1], sizes)


def _within(seq: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Per row position: is it among the first ``limit[k]`` positions of its sample ``k``?"""
    return _ranks_within(seq) < np.repeat(limit, seq)


def step_of_sample(schedule: Schedule) -> np.ndarray:
    """Step of every sample of the schedule's batch; -1 for dropped samples (from the flat
    arrays: no tuple is built)."""
    out = np.full(len(schedule.lengths_array), -1, dtype=np.int64)
    mb_step = np.repeat(np.arange(schedule.num_steps, dtype=np.int64),
                        schedule.step_microbatches * schedule.layout.dp)
    out[schedule.sample_ids] = np.repeat(mb_step, np.diff(schedule.mb_offsets))
    return out


LOG_PROB_COLUMNS = ("rollout_log_probs", "old_log_probs", "ref_log_probs", "teacher_log_probs")
# The optional float32 columns of one value per scored token: the log-probs and the share's
# reverse-KL estimates (``RESPONSE_FLOAT_COLUMNS``), each None or finite.
SCORED_FLOAT_COLUMNS = tuple(dict.fromkeys((*LOG_PROB_COLUMNS, *RESPONSE_FLOAT_COLUMNS)))
# int32 where a row or a share bounds the value (ids, row positions, share positions: half the
# bytes per token); int64 for per-sample columns and response_index (batch coordinates, which
# pass 2**31 at ~1M samples of a few thousand tokens).
MICROBATCH_COLUMNS: dict[str, np.dtype] = {
    **dict.fromkeys(("sample_indices", "seq_lengths", "response_index"), np.dtype(np.int64)),
    **dict.fromkeys(("tokens", "positions", "labels", "logit_index", "share_index",
                     "token_sample"), np.dtype(np.int32)),
    "denominators": np.dtype(np.float64),
    **dict.fromkeys(("loss_mask", "advantages", "is_weights", *SCORED_FLOAT_COLUMNS),
                    np.dtype(np.float32)),
    "routed_experts": np.dtype(np.int16),
}
MAX_CP = 2**16  # context-parallel ranks; a larger cp_size is a bug, not a layout
_RECORD_FIX = "build records with rank_batch(batch, schedule_for(batch, layout, policy), ...)"


def _check_counts(mb: "TrainMicroBatch") -> None:
    for field, lo in (("step", 0), ("num_groups", 1), ("num_samples", 1),
                      ("num_microbatches", 1), ("cp_size", 1), ("cp_rank", 0)):
        as_int(field, getattr(mb, field), lo, RolloutBatchError, _RECORD_FIX)
    if mb.cp_rank >= mb.cp_size:
        raise field_error(RolloutBatchError, "cp_rank", mb.cp_rank,
                          f"is not below cp_size={mb.cp_size}", _RECORD_FIX)


def _check_values(mb: "TrainMicroBatch") -> None:
    """What the loss would get silently wrong: indices out of the row, masks other than 0/1,
    denominators <= 0 under a non-zero mask, non-finite values (O(T + R), numpy)."""
    k, t = len(mb.sample_indices), len(mb.tokens)
    for name, values, bad, rule in (
            ("seq_lengths", mb.seq_lengths, mb.seq_lengths < 1, "every sample has a token"),
            ("token_sample", mb.token_sample, (mb.token_sample < 0) | (mb.token_sample >= k),
             f"indexes one of the row's {k} samples"),
            ("logit_index", mb.logit_index, (mb.logit_index < 0) | (mb.logit_index >= t),
             f"indexes one of the row's {t} positions"),
            ("response_index", mb.response_index, mb.response_index < 0, "is >= 0"),
            ("share_index", mb.share_index, mb.share_index < 0, "is >= 0"),
            ("loss_mask", mb.loss_mask, (mb.loss_mask != 0) & (mb.loss_mask != 1), "is 0 or 1"),
            ("denominators", mb.denominators, ~np.isfinite(mb.denominators)
             | (mb.denominators < 0), "is finite and >= 0"),
            ("advantages", mb.advantages, ~np.isfinite(mb.advantages), "is finite"),
            *(() if mb.is_weights is None else (
                ("is_weights", mb.is_weights, ~np.isfinite(mb.is_weights) | (mb.is_weights < 0),
                 "is finite and >= 0"),))):
        first_bad(bad, name, values, rule, _RECORD_FIX)
    counted = np.bincount(mb.token_sample, weights=mb.loss_mask, minlength=k)
    first_bad((counted > 0) & (mb.denominators <= 0), "denominators", mb.denominators,
              "is > 0 for a sample with loss-masked tokens", _RECORD_FIX)
    for name in SCORED_FLOAT_COLUMNS:
        values = getattr(mb, name)
        if values is not None and not all_finite(values):
            first_bad(~np.isfinite(values), name, values, "is finite", _RECORD_FIX)


def _rank(field: str, value: object, size: int) -> int:
    rank = as_int(field, value, 0, RolloutBatchError, f"pass a rank in [0, {size})")
    if rank >= size:
        raise field_error(RolloutBatchError, field, value, f"is not below the group size {size}",
                          f"pass a rank in [0, {size})")
    return rank


def _check_schedule_matches(batch: RolloutBatch, schedule: Schedule) -> None:
    if not isinstance(batch, RolloutBatch) or not isinstance(schedule, Schedule):
        raise RolloutBatchError(f"rank_batch(batch, schedule) got {type(batch).__name__} and "
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


def _check_share_matches(share: RankShare, schedule: Schedule, dp_rank: int,
                         mask_sums: Any) -> None:
    """The share holds the schedule's samples of ``dp_rank`` with their lengths (O(share))."""
    want = schedule.rank_sample_ids(dp_rank)
    if not (np.array_equal(share.sample_ids, want)
            and np.array_equal(share.lengths, schedule.lengths_array[want])):
        raise RolloutBatchError(
            f"the share holds samples {share.sample_ids[:4].tolist()}... but the schedule "
            f"gives DP rank {dp_rank} {len(want)} samples {want[:4].tolist()}... Fix: build "
            "the share for this rank (assemble_share) from the plan of this schedule.")
    sums = np.asarray(mask_sums)
    if sums.shape != schedule.lengths_array.shape or sums.dtype.kind not in "iu":
        raise field_error(RolloutBatchError, "mask_sums",
                          Shown(f"<{sums.dtype}{list(sums.shape)}>"),
                          f"is not one integer loss-mask total per sample of the schedule "
                          f"({len(schedule.lengths_array)})",
                          "pass RolloutBatch.mask_sums or the plan's mask_sums")


def _shapes(sample_indices: Int64[np.ndarray, " k"], seq_lengths: Int64[np.ndarray, " k"],
            denominators: Float64[np.ndarray, " k"], tokens: Int32[np.ndarray, " T"],
            positions: Int32[np.ndarray, " T"], labels: Int32[np.ndarray, " T"],
            logit_index: Int32[np.ndarray, " R"], response_index: Int64[np.ndarray, " R"],
            share_index: Int32[np.ndarray, " R"], token_sample: Int32[np.ndarray, " R"],
            loss_mask: Float32[np.ndarray, " R"],
            advantages: Float32[np.ndarray, " R"],
            rollout_log_probs: Float32[np.ndarray, " R"] | None,
            old_log_probs: Float32[np.ndarray, " R"] | None,
            ref_log_probs: Float32[np.ndarray, " R"] | None,
            teacher_log_probs: Float32[np.ndarray, " R"] | None,
            opd_reverse_kl: Float32[np.ndarray, " R"] | None,
            routed_experts: Int16[np.ndarray, "T e"] | None,
            is_weights: Float32[np.ndarray, " R"] | None) -> None:
    """Cross-field shapes of a packed row: ``k`` samples, ``T`` local positions, ``R`` tokens."""
