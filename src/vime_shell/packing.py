"""One packed row per micro-batch: the trainer's only view of the data.

Purpose: turn a micro-batch (sample indices chosen by the rollout-side ``Schedule``) into the
tensors one Megatron forward needs, concatenating the samples into a single row.

- ``tokens`` / ``position_ids`` ``[1, T]``; position ids restart at 0 for every sample;
- ``labels`` ``[1, T]``: the next token (0 where none), so the model returns per-token
  ``-log p(next)``;
- on CPU (``packing="mask"``) a block-diagonal causal ``attention_mask`` ``[1, 1, T, T]``
  (True = masked out); on CUDA with TE (``packing="thd"``) ``PackedSeqParams`` with
  ``cu_seqlens`` instead;
- per **response token** ``r`` (prompt tokens never enter the loss): ``logit_index`` (row
  position whose output predicts it), ``loss_mask``, ``advantages``, ``old_log_probs``,
  ``ref_log_probs``, ``denominators`` (the token's group mask total, step-level data),
  ``sample`` (position of its sample inside the micro-batch) and ``response_slot`` (its place
  among the micro-batch's response tokens: all of them, except under context parallelism);
- with context parallelism (THD only) each sample is padded to a multiple of ``2*cp`` and the
  row holds this CP rank's zigzag chunks (chunks ``r`` and ``2cp-1-r`` of every sample).

Invariants (tested in ``tests/shell/test_packing.py``): every sample's response tokens appear
once, in order; the per-token log-probs of a packed row equal those of each sample run alone
(the mask blocks attention across samples and RoPE only sees relative positions).

Example: samples with tokens ``[5, 6, 7]`` (response 2) and ``[8, 9]`` (response 1) pack into
``tokens [[5, 6, 7, 8, 9]]``, ``position_ids [[0, 1, 2, 0, 1]]`` and
``logit_index [0, 1, 3]`` (tokens 6, 7 and 9 are predicted from positions 0, 1 and 3).
"""

from collections.abc import Sequence

import attrs
import numpy as np
import torch
from jaxtyping import Float, Int

from vime_pure.errors import VimeError, field_error


class PackingError(VimeError):
    """Rows that cannot be packed (inconsistent columns, bad indices), with the fix."""


def _offsets(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


@attrs.frozen(kw_only=True, eq=False)
class TrainRows:
    """Columns of the samples one rank trains on, ragged arrays stored flat.

    ``tokens`` holds every sample's prompt + response, ``lengths[i]`` long; the per-token columns
    (``loss_mask``, ``advantages``, ``old_log_probs``, ``ref_log_probs``) hold the
    ``response_lengths[i]`` response tokens of each sample. ``denominators[i]`` is the loss-mask
    total of sample ``i``'s whole group (``vime_pure.group_mask_sums``), fixed per step.
    ``group[i]`` is its dense group number (used for counts only).
    """

    tokens: Int[np.ndarray, " t"]
    lengths: Int[np.ndarray, " n"]
    response_lengths: Int[np.ndarray, " n"]
    loss_mask: Float[np.ndarray, " r"]
    advantages: Float[np.ndarray, " r"]
    denominators: Float[np.ndarray, " n"]
    group: Int[np.ndarray, " n"]
    old_log_probs: Float[np.ndarray, " r"] | None = None
    ref_log_probs: Float[np.ndarray, " r"] | None = None

    def __attrs_post_init__(self) -> None:
        n = len(self.lengths)
        if int(self.lengths.sum()) != len(self.tokens):
            raise field_error(PackingError, "lengths", f"sum {int(self.lengths.sum())}",
                              f"does not match {len(self.tokens)} tokens",
                              "pass one length per sample covering tokens exactly")
        if np.any(self.response_lengths < 1) or np.any(self.response_lengths >= self.lengths):
            raise field_error(PackingError, "response_lengths", self.response_lengths.tolist(),
                              "must be >= 1 and shorter than the sample (a prompt token is "
                              "needed to predict the first response token)",
                              "check prompt/response lengths")
        r = int(self.response_lengths.sum())
        for name in ("loss_mask", "advantages", "old_log_probs", "ref_log_probs"):
            col = getattr(self, name)
            if col is not None and len(col) != r:
                raise field_error(PackingError, name, f"length {len(col)}",
                                  f"must hold one value per response token ({r})",
                                  "pass response-aligned per-token columns")
        for name in ("denominators", "group", "response_lengths"):
            if len(getattr(self, name)) != n:
                raise field_error(PackingError, name, f"length {len(getattr(self, name))}",
                                  f"must hold one value per sample ({n})", "pass per-sample columns")

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @classmethod
    def from_shard(cls, shard, *, old_log_probs: np.ndarray | None = None,
                   ref_log_probs: np.ndarray | None = None,
                   denominators: np.ndarray | None = None) -> "TrainRows":
        """Rows of a ``vime_pure.shard.RankShard`` (its samples in execution order).

        Per-sample advantages are broadcast to the sample's response tokens; ``denominators``
        default to the shard's ``group_mask_sums`` (the ``group_token_mean`` mode); pass the
        step-level ``D`` of another loss mode to override. Log-prob columns are flat over
        response tokens (e.g. from :meth:`MegatronTrainer.compute_log_probs`, concatenated).
        """
        return cls(tokens=np.asarray(shard.tokens, dtype=np.int64),
                   lengths=np.asarray(shard.lengths, dtype=np.int64),
                   response_lengths=np.asarray(shard.response_lengths, dtype=np.int64),
                   loss_mask=np.asarray(shard.loss_masks, dtype=np.float64),
                   advantages=np.repeat(np.asarray(shard.advantages, dtype=np.float64),
                                        shard.response_lengths),
                   denominators=np.asarray(shard.group_mask_sums if denominators is None
                                           else denominators, dtype=np.float64),
                   group=np.asarray(shard.group_ids, dtype=np.int64),
                   old_log_probs=old_log_probs, ref_log_probs=ref_log_probs)

    def select(self, indices: Sequence[int]) -> "TrainRows":
        """The rows ``indices`` in that order (e.g. a rank's ``schedule.partitions[rank]``)."""
        idx = np.asarray(indices, dtype=np.int64)
        to, ro = self.token_offsets, self.response_offsets
        return TrainRows(
            tokens=_gather(self.tokens, to, idx), lengths=self.lengths[idx],
            response_lengths=self.response_lengths[idx],
            loss_mask=_gather(self.loss_mask, ro, idx), advantages=_gather(self.advantages, ro, idx),
            denominators=self.denominators[idx], group=self.group[idx],
            old_log_probs=_gather(self.old_log_probs, ro, idx),
            ref_log_probs=_gather(self.ref_log_probs, ro, idx))

    @property
    def token_offsets(self) -> np.ndarray:
        return _offsets(self.lengths)

    @property
    def response_offsets(self) -> np.ndarray:
        return _offsets(self.response_lengths)


@attrs.frozen(kw_only=True, eq=False)
class PackedRow:
    """Tensors of one packed micro-batch (see the module docstring)."""

    tokens: Int[torch.Tensor, "1 T"]
    position_ids: Int[torch.Tensor, "1 T"]
    labels: Int[torch.Tensor, "1 T"]
    attention_mask: torch.Tensor | None
    packed_seq_params: object | None
    logit_index: Int[torch.Tensor, " R"]
    loss_mask: Float[torch.Tensor, " R"]
    advantages: Float[torch.Tensor, " R"]
    old_log_probs: Float[torch.Tensor, " R"] | None
    ref_log_probs: Float[torch.Tensor, " R"] | None
    denominators: Float[torch.Tensor, " R"]
    sample: Int[torch.Tensor, " R"]
    response_slot: Int[torch.Tensor, " R"]
    indices: tuple[int, ...]
    response_lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def num_response_tokens(self) -> int:
        """Response tokens of the whole micro-batch (over all CP ranks)."""
        return sum(self.response_lengths)

    def to(self, device: torch.device | str | int) -> "PackedRow":
        """The row with every tensor (THD ``cu_seqlens`` included) on ``device``."""
        import dataclasses

        moved = {f.name: getattr(self, f.name).to(device) for f in attrs.fields(PackedRow)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        if self.packed_seq_params is not None:
            p = self.packed_seq_params
            moved["packed_seq_params"] = dataclasses.replace(
                p, cu_seqlens_q=p.cu_seqlens_q.to(device), cu_seqlens_kv=p.cu_seqlens_kv.to(device))
        return attrs.evolve(self, **moved)


def block_causal_mask(lengths: Sequence[int]) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where attention is *blocked*: across samples or to the future."""
    total = int(sum(lengths))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(list(lengths)))
    same = doc[:, None] == doc[None, :]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return ~(same & causal)[None, None]


def thd_params(lengths: Sequence[int], device: torch.device | str = "cpu"):
    """Megatron ``PackedSeqParams`` (THD) for samples of ``lengths`` packed back to back."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.as_tensor(_offsets(np.asarray(lengths)), dtype=torch.int32, device=device)
    longest = int(max(lengths))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _gather(column: np.ndarray | None, offsets: np.ndarray, idx: np.ndarray) -> np.ndarray | None:
    if column is None:
        return None
    if len(idx) == 0:
        return column[:0].copy()
    return np.concatenate([column[offsets[i]:offsets[i + 1]] for i in idx])


def zigzag_positions(lengths: Sequence[int], cp_size: int, cp_rank: int) -> np.ndarray:
    """Row positions CP rank ``cp_rank`` holds: of every sample (length a multiple of
    ``2*cp_size``), chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of ``2*cp_size`` equal chunks.

    Example: lengths ``[8]``, cp 2, rank 0 -> ``[0, 1, 6, 7]``; rank 1 -> ``[2, 3, 4, 5]``.
    """
    out, start = [], 0
    for n in lengths:
        c = n // (2 * cp_size)
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.append(np.arange(start + k * c, start + (k + 1) * c))
        start += n
    return np.concatenate(out).astype(np.int64)


def pack(rows: TrainRows, indices: Sequence[int], packing: str = "mask", cp_size: int = 1,
         cp_rank: int = 0) -> PackedRow:
    """Pack samples ``indices`` (positions into ``rows``) into one row; see the module docstring.

    With ``cp_size > 1`` (THD only) every sample is padded to a multiple of ``2*cp_size`` and
    the row keeps only this CP rank's zigzag chunks; the per-token columns keep the response
    tokens predicted on this rank, ``response_slot`` says where each sits in the full row's
    response tokens. Denominators stay the whole group's, so CP partial sums add up exactly.
    """
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0 or idx.min() < 0 or idx.max() >= rows.num_samples:
        raise field_error(PackingError, "indices", list(indices),
                          f"must be a non-empty list of positions in 0..{rows.num_samples - 1}",
                          "pass micro-batch indices from the rank's shard")
    if packing not in ("mask", "thd"):
        raise field_error(PackingError, "packing", packing, "is not a packing mode",
                          "use 'mask' (CPU) or 'thd' (CUDA with TransformerEngine)")
    if cp_size > 1 and packing != "thd":
        raise field_error(PackingError, "cp_size", cp_size, "needs THD packing",
                          "use packing='thd' on CUDA with TransformerEngine, or cp_size=1")
    lens, resp = rows.lengths[idx], rows.response_lengths[idx]
    padded = lens if cp_size == 1 else -(-lens // (2 * cp_size)) * (2 * cp_size)
    starts = _offsets(padded)[:-1]
    tokens = np.zeros(int(padded.sum()), dtype=np.int64)
    for k, i in enumerate(idx):  # padding (cp > 1 only) sits after each sample's real tokens
        tokens[starts[k]:starts[k] + lens[k]] = rows.tokens[rows.token_offsets[i]:rows.token_offsets[i + 1]]
    positions = np.concatenate([np.arange(n) for n in padded])
    labels = np.zeros_like(tokens)
    labels[:-1] = tokens[1:]
    # Response token j of sample k sits at starts[k] + lens[k] - resp[k] + j and is predicted by
    # the output one position earlier.
    logit_index = np.concatenate([s + n - r - 1 + np.arange(r) for s, n, r in zip(starts, lens, resp)])
    slot = np.arange(len(logit_index))
    if cp_size > 1:
        local = zigzag_positions(padded.tolist(), cp_size, cp_rank)
        to_local = np.full(len(tokens), -1, dtype=np.int64)
        to_local[local] = np.arange(len(local))
        keep = to_local[logit_index] >= 0
        tokens, positions, labels = tokens[local], positions[local], labels[local]
        logit_index, slot = to_local[logit_index[keep]], slot[keep]
    else:
        keep = np.ones(len(logit_index), dtype=bool)
    ro = rows.response_offsets

    def column(a):
        return None if a is None else tensor(a[keep], torch.float32)

    def tensor(a, dtype):
        return None if a is None else torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)

    return PackedRow(
        tokens=tensor(tokens, torch.long)[None], position_ids=tensor(positions, torch.long)[None],
        labels=tensor(labels, torch.long)[None],
        attention_mask=block_causal_mask(lens.tolist()) if packing == "mask" else None,
        packed_seq_params=thd_params(padded.tolist()) if packing == "thd" else None,
        logit_index=tensor(logit_index, torch.long),
        loss_mask=column(_gather(rows.loss_mask, ro, idx)),
        advantages=column(_gather(rows.advantages, ro, idx)),
        old_log_probs=column(_gather(rows.old_log_probs, ro, idx)),
        ref_log_probs=column(_gather(rows.ref_log_probs, ro, idx)),
        denominators=column(np.repeat(rows.denominators[idx], resp)),
        sample=tensor(np.repeat(np.arange(len(idx)), resp)[keep], torch.long),
        response_slot=tensor(slot, torch.long),
        indices=tuple(int(i) for i in idx), response_lengths=tuple(int(r) for r in resp),
    )
