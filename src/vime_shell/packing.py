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
  ``ref_log_probs``, ``denominators`` (the token's group mask total, step-level data), and
  ``sample`` (position of its sample inside the micro-batch).

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
    indices: tuple[int, ...]
    response_lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def to(self, device: torch.device | str) -> "PackedRow":
        def move(t):
            return t.to(device) if isinstance(t, torch.Tensor) else t
        return attrs.evolve(self, **{f.name: move(getattr(self, f.name))
                                     for f in attrs.fields(PackedRow)
                                     if isinstance(getattr(self, f.name), torch.Tensor)})


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


def pack(rows: TrainRows, indices: Sequence[int], packing: str = "mask") -> PackedRow:
    """Pack samples ``indices`` (positions into ``rows``) into one row; see the module docstring."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0 or idx.min() < 0 or idx.max() >= rows.num_samples:
        raise field_error(PackingError, "indices", list(indices),
                          f"must be a non-empty list of positions in 0..{rows.num_samples - 1}",
                          "pass micro-batch indices from the rank's shard")
    if packing not in ("mask", "thd"):
        raise field_error(PackingError, "packing", packing, "is not a packing mode",
                          "use 'mask' (CPU) or 'thd' (CUDA with TransformerEngine)")
    lens, resp = rows.lengths[idx], rows.response_lengths[idx]
    tokens = _gather(rows.tokens, rows.token_offsets, idx)
    starts = _offsets(lens)[:-1]
    positions = np.concatenate([np.arange(n) for n in lens])
    labels = np.zeros_like(tokens)
    labels[:-1] = tokens[1:]
    # Response token j of sample k sits at starts[k] + lens[k] - resp[k] + j and is predicted by
    # the output one position earlier.
    logit_index = np.concatenate([s + n - r - 1 + np.arange(r) for s, n, r in zip(starts, lens, resp)])
    ro = rows.response_offsets

    def tensor(a, dtype):
        return None if a is None else torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)

    return PackedRow(
        tokens=tensor(tokens, torch.long)[None], position_ids=tensor(positions, torch.long)[None],
        labels=tensor(labels, torch.long)[None],
        attention_mask=block_causal_mask(lens.tolist()) if packing == "mask" else None,
        packed_seq_params=thd_params(lens.tolist()) if packing == "thd" else None,
        logit_index=tensor(logit_index, torch.long),
        loss_mask=tensor(_gather(rows.loss_mask, ro, idx), torch.float32),
        advantages=tensor(_gather(rows.advantages, ro, idx), torch.float32),
        old_log_probs=tensor(_gather(rows.old_log_probs, ro, idx), torch.float32),
        ref_log_probs=tensor(_gather(rows.ref_log_probs, ro, idx), torch.float32),
        denominators=tensor(np.repeat(rows.denominators[idx], resp), torch.float32),
        sample=tensor(np.repeat(np.arange(len(idx)), resp), torch.long),
        indices=tuple(int(i) for i in idx), response_lengths=tuple(int(r) for r in resp),
    )
