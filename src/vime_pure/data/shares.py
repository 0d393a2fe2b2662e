"""A rollout batch held in parts, scheduled from its metadata, moved to each rank as its share.

No process ever holds the whole batch. Each *holder* (an engine leader, or rank 0 for a replay)
keeps its *part*: a ``RolloutBatch`` of the work-queue chunks of prompts it generated
(``vime_pure.data.work_queue``, joined by ``vime_pure.data.held_parts``; a prompt's samples, so
its groups, never straddle chunks). The global batch is every chunk in global prompt order
(``part_starts``: a chunk's first prompt), whichever holder generated it.

1. **Metadata** (``part_meta``): per sample the numbers the schedule, the advantages and the
   metrics need (lengths, response lengths, loss-mask totals, dense group and prompt ids,
   reward, status, weight versions: 46 bytes, no token), plus the parts' original ids; one
   per chunk. ``merge_meta`` puts the chunks in prompt order and concatenates their metadata
   exactly as ``RolloutBatch.from_samples``
   numbers the merged output (dense ids in first-occurrence order, ids a rollout function left
   ``None`` numbered after the merge, an explicit id in two parts an error).
2. **Plan** (``plan_shares``): advantages (``normalize_rewards``) and the ``Schedule``
   (``plan_grouped``) of the merged metadata, with what every rank needs to build its records
   without the batch: per-sample loss-mask totals (int32), float32 advantages (what the
   records carry), each chunk's first global sample, response token and prompt (the owner map).
3. **Pieces** (``share_piece``): a holder cuts, from its part (its chunks, known by their first
   prompts), the samples one DP rank trains, in that rank's execution order, with their global
   ids and global response offsets.
4. **Share** (``assemble_share``): a rank joins its pieces in execution order: a ``RankShare``,
   which ``vime_pure.data.microbatch.share_batch`` turns into the same records
   ``rank_batch`` builds from the whole batch (tested bit for bit). Its per-response-token
   float32 columns (``RESPONSE_FLOAT_COLUMNS``: rollout and teacher log-probs, top-k
   distillation's ``opd_reverse_kl``) travel when the batch records them.

Example: chunks of 3 and 2 samples, at prompts 0 and 1, held by holders 0 and 1; the schedule
gives DP rank 1 samples ``[4, 0]``: holder 0 sends it sample 0 (its local 0), holder 1 sample 4
(its local 1); rank 1's share holds samples ``[4, 0]`` in that order, 2 samples' tokens and
nothing else.
"""

from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import numpy as np
from jaxtyping import Int64

from vime_pure.data.batch import COLUMNS, RolloutBatch
from vime_pure.data.columns import RESPONSE_FLOAT_COLUMNS, check_dtypes
from vime_pure.data.ragged import offsets_from_lengths, row_positions
from vime_pure.data.rewards import RewardNormalization, normalize_rewards
from vime_pure.data.rollout_output import fallback_ids
from vime_pure.data.work_queue import prompt_order
from vime_pure.errors import RolloutBatchError, RolloutValidationError, field_error
from vime_pure.grouping import Grouping
from vime_pure.scheduling.planner import plan_grouped
from vime_pure.scheduling.schedule import Schedule

_INT32_MAX = np.iinfo(np.int32).max

# The per-sample columns a part's metadata carries: the RolloutBatch columns that need no
# token (``vime_pure.data.batch.COLUMNS``, by the same names), in the dtype they travel in
# (lengths, loss-mask totals and dense ids fit int32; ``mask_sums`` is the batch's derived
# ``RolloutBatch.mask_sums``). The one declaration: ``part_meta`` fills these, ``merge_meta``
# concatenates them, ``BatchMeta`` checks them at construction. A new per-sample number that
# planning needs is one entry here and one field of ``BatchMeta``.
META_COLUMNS: dict[str, np.dtype] = {
    **dict.fromkeys(("lengths", "response_lengths", "mask_sums", "group_ids", "prompt_groups"),
                    np.dtype(np.int32)),
    **{name: COLUMNS[name] for name in ("rewards", "statuses", "weight_version_min",
                                        "weight_version_max")}}
_DENSE_IDS = ("group_ids", "prompt_groups")  # renumbered at the merge, not concatenated
# Each optional batch column (``OPTIONAL_COLUMNS``) and the ``BatchMeta`` flag saying that the
# part records it (all parts or none: ``merge_meta``).
PRESENCE_FLAGS: dict[str, str] = {
    "rollout_log_probs": "has_log_probs", "rollout_routed_experts": "has_routes",
    "teacher_log_probs": "has_teacher", "opd_reverse_kl": "has_opd_reverse_kl"}


def _on_the_wire(name: str, values: np.ndarray) -> np.ndarray:
    """A batch column in its ``META_COLUMNS`` dtype: lengths and mask totals of one sample
    stay below 2**31 (a typed error otherwise)."""
    dtype = META_COLUMNS[name]
    if dtype == np.int32 and values.size and int(values.max()) > _INT32_MAX:
        raise field_error(RolloutBatchError, name, int(values.max()), "exceeds int32",
                          "keep every sample under 2**31 tokens")
    return values.astype(dtype, copy=False)


@attrs.frozen(kw_only=True, eq=False)
class BatchMeta:
    """Per-sample metadata of one part, or of the merged batch (``merge_meta``).

    Reads like a ``RolloutBatch`` for everything that needs no token (``rollout_record``,
    ``staleness_metrics``, ``fresh_samples``): the batch's ``META_COLUMNS`` under their batch
    names (``lengths``, ``response_lengths``, ``mask_sums``, dense ``group_ids`` /
    ``prompt_groups``, ``rewards``, ``statuses``, the weight versions), the original id values,
    ``advantages`` once planned.
    ``group_fallback[g]``: group ``g``'s id was ``None`` in the rollout output (renumbered
    when parts merge); ``prompt_fallback`` alike. ``part_sizes[p]`` / ``part_response_tokens``
    [p]: samples and response tokens of part ``p``; ``has_log_probs``: the engine recorded
    rollout log-probs (in every part); ``has_teacher``: the samples carry a teacher server's
    log-probs (``--opd-type sglang``); ``has_opd_reverse_kl``: the samples carry top-k
    distillation's reverse-KL estimates. ``part_tool_calls[p]``: the tool calls of part ``p``'s
    executions (:func:`execution_tool_calls`); None where a part was not built from samples
    (a replay, a remote engine's batch) or none of its samples counts them: not known, never 0.
    """

    lengths: np.ndarray  # int32
    response_lengths: np.ndarray  # int32
    mask_sums: np.ndarray  # int32
    group_ids: np.ndarray  # int32, dense
    group_id_values: tuple[Hashable, ...]
    group_fallback: np.ndarray  # bool, per group
    prompt_groups: np.ndarray  # int32, dense
    prompt_group_values: tuple[Hashable, ...]
    prompt_fallback: np.ndarray  # bool, per prompt group
    rewards: np.ndarray  # float64
    statuses: np.ndarray  # uint8
    weight_version_min: np.ndarray  # int64
    weight_version_max: np.ndarray  # int64
    part_sizes: np.ndarray  # int64, per part
    part_response_tokens: np.ndarray  # int64, per part
    part_outputs: np.ndarray  # int64, per part: top-level entries of its rollout output
    part_starts: np.ndarray  # int64, per part: its first global prompt index
    has_log_probs: bool
    advantages: np.ndarray | None = None  # float64: a whole batch's, or set by plan_shares
    has_routes: bool = False  # the engine recorded routed experts (MoE routing replay)
    has_teacher: bool = False  # the samples carry teacher log-probs (--opd-type sglang)
    has_opd_reverse_kl: bool = False  # the samples carry reverse-KL estimates (top-k OPD)
    part_tool_calls: np.ndarray | None = None  # int64, per part (None: not known)

    def __attrs_post_init__(self) -> None:
        """The ``META_COLUMNS`` in their dtypes, one entry per sample each (a typed error
        names the column otherwise)."""
        check_dtypes(self, META_COLUMNS, "BatchMeta", optional=())
        for name in META_COLUMNS:
            if len(getattr(self, name)) != len(self.lengths):
                raise field_error(RolloutBatchError, f"BatchMeta.{name}",
                                  len(getattr(self, name)),
                                  f"entries, not one per sample ({len(self.lengths)})",
                                  "build metadata with part_meta and merge_meta")

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def num_groups(self) -> int:
        return len(self.group_id_values)

    @property
    def nbytes(self) -> int:
        """Bytes of the per-sample arrays (what a holder sends; the id tuples come on top)."""
        return sum(v.nbytes for v in attrs.asdict(self, recurse=False).values()
                   if isinstance(v, np.ndarray))


def part_meta(part: RolloutBatch, *, group_fallback: np.ndarray | None = None,
              prompt_fallback: np.ndarray | None = None, outputs: int | None = None,
              whole: bool = False, start: int = 0, tool_calls: int | None = None
              ) -> BatchMeta:
    """The metadata of one holder's part. ``group_fallback`` / ``prompt_fallback`` flag the
    dense groups / prompt groups whose id the rollout output left ``None`` (``output_part``
    finds them); default none. ``outputs``: top-level entries of its rollout output (default
    its prompt groups). ``whole``: the part is the whole batch (a replay, a filtered batch):
    its advantages are the batch's and travel along. ``start``: the part's first global prompt
    index (a work-queue chunk's; what orders parts at the merge). ``tool_calls``: its
    executions' tool calls, when known (:func:`execution_tool_calls`). Example: a part of 2 samples
    in one group with masks summing to 2 and 1: ``mask_sums [2, 1]``, ``part_sizes [2]``."""
    flags = {"group_fallback": (group_fallback, part.num_groups),
             "prompt_fallback": (prompt_fallback, len(part.prompt_group_values))}
    resolved = {}
    for name, (given, size) in flags.items():
        arr = np.zeros(size, dtype=bool) if given is None else np.asarray(given, dtype=bool)
        if arr.shape != (size,):
            raise field_error(RolloutBatchError, name, f"<{arr.shape}>",
                              f"does not have one flag per id ({size})",
                              "pass what output_part returned")
        resolved[name] = arr
    fields: dict[str, Any] = {  # the columns, the fallback flags, the presence flags
        **{name: _on_the_wire(name, getattr(part, name)) for name in META_COLUMNS}, **resolved,
        **{flag: getattr(part, name) is not None for name, flag in PRESENCE_FLAGS.items()}}
    return BatchMeta(
        **fields,
        group_id_values=part.group_id_values, prompt_group_values=part.prompt_group_values,
        part_sizes=np.array([part.num_samples], dtype=np.int64),
        part_response_tokens=np.array([int(part.response_offsets[-1])], dtype=np.int64),
        part_outputs=np.array([len(part.prompt_group_values) if outputs is None else outputs],
                              dtype=np.int64),
        part_starts=np.array([start], dtype=np.int64),
        advantages=part.advantages if whole else None,
        part_tool_calls=None if tool_calls is None else np.array([tool_calls], dtype=np.int64))


def execution_tool_calls(samples: Sequence[Any], group_ids: np.ndarray) -> int | None:
    """The tool calls of the executions (rollout groups) these samples come from: each
    group's count once, read from the ``tool_calls`` metadata of its first sample that has it
    (an agent execution stamps its total on every leaf, ``vime_shell.agents.agent``); None
    when no sample carries the key. Example: a group of 3 leaves each saying 2 and a group
    of 1 saying 0: 2."""
    counted: dict[int, int] = {}
    for sample, group in zip(samples, group_ids.tolist()):
        calls = (getattr(sample, "metadata", None) or {}).get("tool_calls")
        if isinstance(calls, int) and not isinstance(calls, bool) and group not in counted:
            counted[group] = calls
    return sum(counted.values()) if counted else None


def output_part(output: Any, *, normalization: Any = RewardNormalization(), start: int = 0
                ) -> tuple[RolloutBatch, BatchMeta]:
    """A rollout output (one claimed chunk's, or a holder's) as a part
    (``RolloutBatch.from_samples``: validated, columnar, no ``Sample`` leaves the holder) and
    the part's metadata, with the groups and prompt groups whose ids were ``None`` flagged for
    renumbering at the merge; ``start``: its first global prompt index."""
    part = RolloutBatch.from_samples(output, normalization=normalization)
    samples = _flat_samples(output)
    none_group = np.fromiter((s.group_id is None for s in samples), dtype=bool,
                             count=len(samples))
    none_prompt = np.fromiter((s.prompt_group is None for s in samples), dtype=bool,
                              count=len(samples))
    group_flags = np.zeros(part.num_groups, dtype=bool)
    group_flags[part.group_ids[none_group]] = True
    prompt_flags = np.zeros(len(part.prompt_group_values), dtype=bool)
    prompt_flags[part.prompt_groups[none_prompt]] = True
    return part, part_meta(part, group_fallback=group_flags, prompt_fallback=prompt_flags,
                           outputs=len(output), start=start,
                           tool_calls=execution_tool_calls(samples, part.group_ids))


def _flat_samples(output: Any) -> list:
    """The samples of a (validated) nested output in flattening order."""
    out, stack = [], [output]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def _merged_values(parts: Sequence[BatchMeta], values: str, flags: str, field: str
                   ) -> tuple[tuple[Hashable, ...], np.ndarray]:
    """The merged original ids (fallback ones renumbered as over the merged output) and the
    dense offset of every part."""
    owner: dict[Hashable, int] = {}
    for p, meta in enumerate(parts):
        for value, fallback in zip(getattr(meta, values), getattr(meta, flags).tolist()):
            if fallback:
                continue
            first = owner.setdefault(value, p)
            if first != p:
                raise field_error(
                    RolloutValidationError, field, value,
                    f"is used by the outputs of two engines or prompt chunks (the ones from "
                    f"prompt {int(parts[first].part_starts[0])} and from prompt "
                    f"{int(meta.part_starts[0])}); merged, two rollout groups (or prompts) "
                    "would become one",
                    "derive explicit ids from the global prompt index "
                    "(RolloutContext.prompt_offset, as the built-in rollouts do) or leave them "
                    "None so they are numbered after the merge")
    merged = [None if f else v for meta in parts
              for v, f in zip(getattr(meta, values), getattr(meta, flags).tolist())]
    sizes = np.array([len(getattr(meta, values)) for meta in parts], dtype=np.int64)
    return tuple(fallback_ids(merged)), offsets_from_lengths(sizes)


def merge_meta(parts: Sequence[BatchMeta]) -> BatchMeta:
    """The metadata of the parts concatenated in global prompt order (``part_starts``,
    whatever order they come in: work-queue chunks of any engines), numbered as
    ``RolloutBatch.from_samples`` numbers the merged output. Example: chunks starting at
    prompts 4 and 0 merge as the chunk of prompt 0, then the one of prompt 4."""
    if not parts:
        raise RolloutValidationError("no part holds a sample. Fix: generate at least one.")
    parts = _in_prompt_order(parts)
    for name, flag in PRESENCE_FLAGS.items():
        if len({getattr(m, flag) for m in parts}) > 1:
            raise RolloutValidationError(
                f"{name} are recorded by some engines' rollout functions and not by others. "
                "Fix: record them for every sample or for none.")
    groups, g_off = _merged_values(parts, "group_id_values", "group_fallback", "group_id")
    prompts, p_off = _merged_values(parts, "prompt_group_values", "prompt_fallback",
                                    "prompt_group")

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(m, name) for m in parts])

    fields: dict[str, Any] = {  # the columns but the renumbered ids, the presence flags
        **{name: cat(name) for name in META_COLUMNS if name not in _DENSE_IDS},
        **{flag: getattr(parts[0], flag) for flag in PRESENCE_FLAGS.values()}}
    return BatchMeta(
        **fields,
        group_ids=np.concatenate([m.group_ids + np.int32(o) for m, o in zip(parts, g_off)]),
        group_id_values=groups, group_fallback=np.zeros(len(groups), dtype=bool),
        prompt_groups=np.concatenate([m.prompt_groups + np.int32(o)
                                      for m, o in zip(parts, p_off)]),
        prompt_group_values=prompts, prompt_fallback=np.zeros(len(prompts), dtype=bool),
        part_sizes=cat("part_sizes"), part_response_tokens=cat("part_response_tokens"),
        part_outputs=cat("part_outputs"), part_starts=cat("part_starts"),
        advantages=cat("advantages") if all(m.advantages is not None for m in parts) else None,
        part_tool_calls=(cat("part_tool_calls")
                         if all(m.part_tool_calls is not None for m in parts) else None))


def _in_prompt_order(parts: Sequence[BatchMeta]) -> list[BatchMeta]:
    """``parts`` sorted by their first prompt; their parts must not interleave."""
    order = prompt_order(np.array([int(m.part_starts[0]) for m in parts], dtype=np.int64))
    ordered = [parts[i] for i in order.tolist()]
    starts = np.concatenate([m.part_starts for m in ordered])
    if np.any(np.diff(starts) <= 0):
        raise field_error(RolloutValidationError, "part_starts", starts.tolist(),
                          "interleave or repeat across the parts", "merge single chunks")
    return ordered


@attrs.frozen(kw_only=True, eq=False)
class SharePlan:
    """What every rank receives before its share: the ``Schedule``, per sample the loss-mask
    total (int32) and the advantage as the records carry it (float32), per part (a work-queue
    chunk, in global prompt order) its first global sample, response token and prompt: the
    owner map, since a holder knows the first prompts of the chunks it holds (``share_piece``).
    ``fresh`` (bool per sample, optional): the caller's flag of samples generated by the
    trainer's weights."""

    schedule: Schedule
    mask_sums: np.ndarray
    advantages: np.ndarray
    part_offsets: np.ndarray  # int64, parts + 1
    part_response_offsets: np.ndarray  # int64, parts + 1
    part_starts: np.ndarray  # int64, per part: its first global prompt
    fresh: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the plan's arrays (what the broadcast carries, pickled raw)."""
        s = self.schedule
        arrays = (s.lengths_array, s.group_array, s.sample_ids, s.mb_offsets,
                  s.step_microbatches, s.step_groups, s.dropped_array, self.mask_sums,
                  self.advantages, self.part_offsets, self.part_response_offsets,
                  self.part_starts, *(() if self.fresh is None else (self.fresh,)))
        return sum(a.nbytes for a in arrays)


def plan_shares(meta: BatchMeta, layout: Any, policy: Any, flops: Any = None, *,
                normalization: Any = RewardNormalization()
                ) -> tuple[BatchMeta, SharePlan]:
    """Advantages and schedule of the merged ``meta`` (the core's ``normalize_rewards`` and
    ``plan_grouped``, on the same inputs ``RolloutBatch.from_samples`` and ``schedule_for``
    give them; a whole batch's own advantages are kept, e.g. a replayed dump's); returns the
    metadata with its advantages and the plan."""
    groups = meta.group_ids.astype(np.int64)
    advantages = meta.advantages
    if advantages is None:
        advantages = normalize_rewards(meta.rewards, groups,
                                       meta.prompt_groups.astype(np.int64), normalization)
    schedule = plan_grouped(meta.lengths.astype(np.int64),
                            Grouping.from_dense(groups, meta.group_id_values), layout, policy,
                            flops)
    plan = SharePlan(schedule=schedule, mask_sums=meta.mask_sums,
                     advantages=advantages.astype(np.float32),
                     part_offsets=offsets_from_lengths(meta.part_sizes),
                     part_response_offsets=offsets_from_lengths(meta.part_response_tokens),
                     part_starts=meta.part_starts)
    return attrs.evolve(meta, advantages=advantages), plan


@attrs.frozen(kw_only=True, eq=False)
class RankShare:
    """The samples one DP rank trains, in its execution order, and nothing else.

    ``sample_ids``: global sample indices; ``response_starts``: each sample's first response
    token in the global batch (so records keep batch coordinates in ``response_index``);
    ragged ``tokens`` / ``loss_masks`` / ``RESPONSE_FLOAT_COLUMNS`` (``rollout_log_probs``,
    ``teacher_log_probs``, ``opd_reverse_kl``) with local offsets;
    ``advantages`` (float32) per sample.
    """

    sample_ids: np.ndarray  # int64
    response_starts: np.ndarray  # int64
    lengths: np.ndarray  # int64
    response_lengths: np.ndarray  # int64
    tokens: np.ndarray  # int32
    token_offsets: np.ndarray  # int64
    loss_masks: np.ndarray  # uint8
    response_offsets: np.ndarray  # int64
    rollout_log_probs: np.ndarray | None  # float32
    advantages: np.ndarray  # float32
    rollout_routed_experts: np.ndarray | None = None  # int16 [tokens, layers * topk]
    teacher_log_probs: np.ndarray | None = None  # float32, per response token
    opd_reverse_kl: np.ndarray | None = None  # float32, per response token

    def __attrs_post_init__(self) -> None:
        n = len(self.sample_ids)
        for name in ("response_starts", "lengths", "response_lengths", "advantages"):
            if len(getattr(self, name)) != n:
                raise field_error(RolloutBatchError, f"RankShare.{name}",
                                  len(getattr(self, name)), f"is not {n} entries long",
                                  "build shares with share_piece and assemble_share")
        for flat, offsets, lengths in (("tokens", "token_offsets", "lengths"),
                                       ("loss_masks", "response_offsets", "response_lengths")):
            off = getattr(self, offsets)
            if (len(off) != n + 1 or off[0] != 0 or off[-1] != len(getattr(self, flat))
                    or not np.array_equal(np.diff(off), getattr(self, lengths))):
                raise field_error(RolloutBatchError, f"RankShare.{offsets}", f"<{len(off)}>",
                                  f"does not cut {flat} by {lengths}",
                                  "build shares with share_piece and assemble_share")

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_offsets[-1])

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in attrs.asdict(self, recurse=False).values()
                   if isinstance(v, np.ndarray))


def take_samples(source: Any, rows: np.ndarray, *, sample_ids: np.ndarray,
                 response_starts: np.ndarray, advantages: np.ndarray) -> RankShare:
    """Rows ``rows`` (local indices) of a ``RolloutBatch`` or ``RankShare`` as a share."""
    rows = np.asarray(rows, dtype=np.int64)
    tok = row_positions(source.token_offsets, rows)
    resp = row_positions(source.response_offsets, rows)
    lengths, response_lengths = source.lengths[rows], source.response_lengths[rows]
    return RankShare(
        sample_ids=np.asarray(sample_ids, dtype=np.int64),
        response_starts=np.asarray(response_starts, dtype=np.int64),
        lengths=lengths.astype(np.int64), response_lengths=response_lengths.astype(np.int64),
        tokens=source.tokens[tok], token_offsets=offsets_from_lengths(lengths),
        loss_masks=source.loss_masks[resp], response_offsets=offsets_from_lengths(response_lengths),
        advantages=np.asarray(advantages, dtype=np.float32),
        rollout_routed_experts=None if source.rollout_routed_experts is None
        else source.rollout_routed_experts[tok],
        **response_floats(source, resp))


def response_floats(source: Any, positions: np.ndarray) -> dict[str, Any]:
    """The ``RESPONSE_FLOAT_COLUMNS`` of a batch, share or piece at its flat response
    ``positions`` (None where not recorded): what a cut carries of them."""
    return {name: None if (col := getattr(source, name)) is None else col[positions]
            for name in RESPONSE_FLOAT_COLUMNS}


def share_of_batch(batch: RolloutBatch, ids: np.ndarray) -> RankShare:
    """The share of global samples ``ids`` cut from a whole batch (the reference path)."""
    ids = np.asarray(ids, dtype=np.int64)
    return take_samples(batch, ids, sample_ids=ids, response_starts=batch.response_offsets[ids],
                        advantages=batch.advantages[ids].astype(np.float32))


def share_piece(part: RolloutBatch, plan: SharePlan, dp_rank: int, *,
                starts: Int64[np.ndarray, " k"]) -> RankShare:
    """The samples of a holder's ``part`` that DP rank ``dp_rank`` trains, in its order.

    ``starts``: the first global prompt of each chunk the part holds, in the part's order
    (claim order; one entry for a contiguous block or a whole batch). The plan's per-chunk
    offsets (global prompt order) locate each chunk's samples globally; the part holds them
    back to back. Example: a part holding the chunks at prompts 0 and 8, of 2 and 3 samples,
    which the plan puts at global samples 0-1 and 4-6: global sample 5 is the part's row 3.
    """
    starts = np.asarray(starts, dtype=np.int64)
    chunks = np.searchsorted(plan.part_starts, starts)
    if (chunks >= len(plan.part_starts)).any() \
            or not np.array_equal(plan.part_starts[np.minimum(chunks, len(plan.part_starts) - 1)],
                                  starts):
        raise field_error(RolloutBatchError, "starts", starts.tolist(),
                          "name chunks the plan does not hold",
                          "cut pieces with the starts of the metadata the plan merged")
    sizes = plan.part_offsets[chunks + 1] - plan.part_offsets[chunks]
    if part.num_samples != int(sizes.sum()):
        raise field_error(RolloutBatchError, "part", part.num_samples,
                          f"samples, but the plan gives its chunks {int(sizes.sum())}",
                          "cut pieces from the part whose metadata the plan merged")
    first_row = offsets_from_lengths(sizes)[:-1]
    slot = np.full(len(plan.part_starts), -1, dtype=np.int64)
    slot[chunks] = np.arange(len(chunks))
    ids = plan.schedule.rank_sample_ids(dp_rank)
    chunk_of = np.searchsorted(plan.part_offsets, ids, side="right") - 1
    held = slot[chunk_of]
    keep = held >= 0
    mine, held, chunk_of = ids[keep], held[keep], chunk_of[keep]
    local = first_row[held] + (mine - plan.part_offsets[chunk_of])
    starts_resp = (plan.part_response_offsets[chunk_of] + part.response_offsets[local]
                   - part.response_offsets[first_row[held]])
    return take_samples(part, local, sample_ids=mine, response_starts=starts_resp,
                        advantages=plan.advantages[mine])


def assemble_share(pieces: Sequence[RankShare], plan: SharePlan, dp_rank: int) -> RankShare:
    """A rank's pieces (from every holder) joined in its execution order; every sample the
    schedule gives the rank must arrive exactly once (a typed error names the first missing)."""
    want = plan.schedule.rank_sample_ids(dp_rank)
    pieces = [p for p in pieces if p.num_samples] or list(pieces[:1])
    if not pieces:
        got = np.zeros(0, dtype=np.int64)
    else:
        got = np.concatenate([p.sample_ids for p in pieces])
    if len(got) != len(want) or not np.array_equal(np.sort(got), np.sort(want)):
        missing = np.setdiff1d(want, got)
        raise field_error(RolloutBatchError, "share", f"<{len(got)} samples>",
                          f"does not hold DP rank {dp_rank}'s {len(want)} scheduled samples "
                          f"(first missing: {missing[:1].tolist()})",
                          "send every rank the pieces share_piece cuts for it")
    if not pieces:
        return share_of_empty()
    joined = pieces[0] if len(pieces) == 1 else _concat(pieces)
    order = np.argsort(got, kind="stable")
    rows = order[np.searchsorted(got[order], want)]
    if np.array_equal(rows, np.arange(len(rows))):
        return joined
    return take_samples(joined, rows, sample_ids=joined.sample_ids[rows],
                        response_starts=joined.response_starts[rows],
                        advantages=joined.advantages[rows])


def share_of_empty() -> RankShare:
    zero = np.zeros(0, dtype=np.int64)
    return RankShare(sample_ids=zero, response_starts=zero, lengths=zero, response_lengths=zero,
                     tokens=np.zeros(0, np.int32), token_offsets=np.zeros(1, np.int64),
                     loss_masks=np.zeros(0, np.uint8), response_offsets=np.zeros(1, np.int64),
                     rollout_log_probs=None, advantages=np.zeros(0, np.float32))


def _concat(pieces: Sequence[RankShare]) -> RankShare:
    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in pieces])

    lengths, response_lengths = cat("lengths"), cat("response_lengths")
    return RankShare(sample_ids=cat("sample_ids"), response_starts=cat("response_starts"),
                     lengths=lengths, response_lengths=response_lengths, tokens=cat("tokens"),
                     token_offsets=offsets_from_lengths(lengths), loss_masks=cat("loss_masks"),
                     response_offsets=offsets_from_lengths(response_lengths),
                     advantages=cat("advantages"), rollout_routed_experts=routes_of(pieces),
                     **{name: optional_cat([getattr(p, name) for p in pieces])
                        for name in RESPONSE_FLOAT_COLUMNS})


def optional_cat(columns: Sequence[np.ndarray | None]) -> np.ndarray | None:
    """An optional column of several parts, concatenated: None unless every part has it."""
    present = [c for c in columns if c is not None]
    return np.concatenate(present) if present and len(present) == len(columns) else None


def routes_of(parts: Sequence[Any]) -> np.ndarray | None:
    """The parts' routed experts concatenated (None unless every part has them)."""
    return optional_cat([p.rollout_routed_experts for p in parts])
