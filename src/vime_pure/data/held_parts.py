"""A holder's work-queue chunks as its one part, and holders' parts joined into the batch.

An engine leader generates the chunks it claims (``vime_pure.data.work_queue``), in claim
order, which is its own prompt order. ``claimed_part`` converts each chunk to columns
(``output_part``: one ``BatchMeta`` per chunk, what rank 0 merges in global prompt order) and
joins them back to back as the holder's part (``join_chunks``): what ``share_piece`` cuts.
For inspection, ``join_parts`` with ``held_rows`` puts every holder's chunks back in global
prompt order, the batch of contiguous blocks (tested bit for bit).

Example: engine 0 claims the chunks at prompts 0 and 8 (2 and 1 samples), engine 1 the one at
4 (2 samples); stacked in holder order the rows are ``[0, 1, 2 | 3, 4]``, in prompt order ``[0,
1, 3, 4, 2]``.
"""

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
from jaxtyping import Int64

from vime_pure.data.batch import RolloutBatch
from vime_pure.data.columns import RESPONSE_FLOAT_COLUMNS
from vime_pure.data.ragged import offsets_from_lengths, row_positions
from vime_pure.data.rewards import RewardNormalization
from vime_pure.data.shares import BatchMeta, merge_meta, optional_cat, output_part, routes_of
from vime_pure.data.work_queue import prompt_order
from vime_pure.errors import RolloutBatchError, field_error


def claimed_part(chunks: Sequence[tuple[int, Any]], *,
                 normalization: Any = RewardNormalization()
                 ) -> tuple[RolloutBatch | None, tuple[BatchMeta, ...]]:
    """A holder's work-queue chunks ``(first prompt, rollout output)`` as its part, the
    chunks' columns back to back in prompt order, and one metadata per chunk (``output_part``:
    what rank 0 merges in prompt order). An explicit id in two of its chunks is the merge's
    error, raised here. Example: chunks at prompts 0 and 8 -> a part of both, two metadata."""
    # In prompt order (a queue's claims are; sorting keeps a caller's other order safe):
    # the part's rows and its metadata then follow one order, which share_piece relies on.
    converted = [output_part(out, normalization=normalization, start=start)
                 for start, out in sorted(chunks, key=lambda c: c[0]) if out]
    if not converted:
        return None, ()
    metas = tuple(m for _, m in converted)
    return join_chunks([b for b, _ in converted], metas), metas


def join_chunks(batches: Sequence[RolloutBatch], metas: Sequence[BatchMeta]) -> RolloutBatch:
    """One holder's chunk batches (claim order = its prompt order) as its part: their columns
    back to back, ids numbered over the holder's chunks (``merge_meta``; the plan numbers
    globally, the part's ids only name samples in its errors)."""
    if len(batches) == 1:
        return batches[0]
    own = attrs.evolve(merge_meta(metas),
                       advantages=np.concatenate([b.advantages for b in batches]))
    return join_parts(batches, own)


def held_rows(held: Sequence[Sequence[BatchMeta]]) -> Int64[np.ndarray, " n"]:
    """Rows of the holders' parts stacked in holder order, in global prompt order: ``held[h]``
    are holder ``h``'s chunk metadata in its part's order. Example: holder 0 holds the chunks
    at prompts 0 and 8 (2 and 1 samples), holder 1 the one at 4 (2 samples): ``[0, 1, 3, 4,
    2]``."""
    return chunk_rows([[(int(s), n) for m in metas
                        for s, n in zip(m.part_starts, m.part_sizes.tolist())]
                       for metas in held])


def chunk_rows(held: Sequence[Sequence[tuple[int, int]]]) -> Int64[np.ndarray, " n"]:
    """:func:`held_rows` from each holder's chunks as ``(first prompt, samples)`` pairs (what
    a dump of parts records). Example: ``[[(0, 2), (8, 1)], [(4, 2)]]`` gives ``[0, 1, 3, 4,
    2]``."""
    chunks = [(int(s), int(n)) for pairs in held for s, n in pairs]
    first = offsets_from_lengths(np.array([n for _, n in chunks], dtype=np.int64))
    order = prompt_order(np.array([s for s, _ in chunks], dtype=np.int64))
    pieces = [np.arange(first[i], first[i + 1]) for i in order.tolist()]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


@attrs.frozen(kw_only=True, eq=False)
class PlannedIds:
    """What :func:`join_parts` takes from the planned metadata: the merged batch's dense
    group and prompt ids with their original values, and its advantages (a dump of parts
    records these in its index; ``BatchMeta`` has them too)."""

    group_ids: np.ndarray
    group_id_values: tuple
    prompt_groups: np.ndarray
    prompt_group_values: tuple
    advantages: np.ndarray | None


def join_parts(parts: Sequence[RolloutBatch], meta: BatchMeta | PlannedIds, *,
               rows: Int64[np.ndarray, " n"] | None = None) -> RolloutBatch:
    """The whole ``RolloutBatch`` of the parts (concatenated, then ``rows`` of that in order:
    ``held_rows`` puts work-queue chunks in prompt order) with the merged, planned ``meta``'s
    ids and advantages: a holder's own chunks (``join_chunks``: one copy of its columns, what
    ``share_piece`` cuts) and inspection (``RolloutEvent.gather_batch``: the whole batch, never
    on the training path). Validated by the batch's own checks."""
    if meta.advantages is None:
        raise field_error(RolloutBatchError, "meta.advantages", None, "are not planned",
                          "pass the metadata plan_shares returned")

    names = ("tokens", "lengths", "response_lengths", "loss_masks", "group_mask_sums",
             "rewards", "statuses", "removed", "sample_indices", "weight_version_min",
             "weight_version_max")
    cols: dict[str, Any] = {n: np.concatenate([getattr(p, n) for p in parts]) for n in names}
    cols.update({name: optional_cat([getattr(p, name) for p in parts])
                 for name in RESPONSE_FLOAT_COLUMNS})
    cols["rollout_routed_experts"] = routes_of(parts)
    if rows is not None:
        cols = _take_rows(cols, np.asarray(rows, dtype=np.int64))

    def cat(name: str) -> np.ndarray:
        return cols[name]

    lengths, response_lengths = cat("lengths"), cat("response_lengths")
    return RolloutBatch(
        tokens=cat("tokens"), token_offsets=offsets_from_lengths(lengths), lengths=lengths,
        response_lengths=response_lengths, loss_masks=cat("loss_masks"),
        response_offsets=offsets_from_lengths(response_lengths),
        group_ids=meta.group_ids.astype(np.int64), group_id_values=meta.group_id_values,
        prompt_groups=meta.prompt_groups.astype(np.int64),
        prompt_group_values=meta.prompt_group_values, group_mask_sums=cat("group_mask_sums"),
        rewards=cat("rewards"), advantages=meta.advantages, statuses=cat("statuses"),
        removed=cat("removed"), sample_indices=cat("sample_indices"),
        weight_version_min=cat("weight_version_min"),
        weight_version_max=cat("weight_version_max"),
        rollout_routed_experts=cols["rollout_routed_experts"],
        **{name: cols[name] for name in RESPONSE_FLOAT_COLUMNS})


def _take_rows(cols: dict, rows: np.ndarray) -> dict:
    """Samples ``rows`` of concatenated batch columns (ragged ones by their offsets)."""
    tok = row_positions(offsets_from_lengths(cols["lengths"]), rows)
    resp = row_positions(offsets_from_lengths(cols["response_lengths"]), rows)
    flat = {"tokens": tok, "rollout_routed_experts": tok, "loss_masks": resp,
            **dict.fromkeys(RESPONSE_FLOAT_COLUMNS, resp)}
    return {k: None if v is None else v[flat.get(k, rows)] for k, v in cols.items()}
