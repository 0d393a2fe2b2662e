"""A core ``TrainMicroBatch`` record as the tensors of one Megatron forward: conversion only.

Every number (tokens, positions, labels, which logits score which response tokens, masks,
advantages, denominators, CP chunks) is decided by ``vime_pure.data.microbatch.rank_batch``;
this module adds only what depends on the platform:

- ``[1, T]`` token, position and label tensors (``torch.from_numpy``: no copy on CPU);
- the attention layout of the packed row: on CPU (``packing="mask"``) a block-diagonal causal
  mask ``[1, 1, T, T]`` (True = masked out), on CUDA with TransformerEngine (``packing="thd"``)
  Megatron ``PackedSeqParams`` whose ``cu_seqlens`` are the record's ``seq_lengths``;
- device placement.

Example: a record of samples of 3 and 2 tokens gives ``tokens [1, 5]`` and a mask whose
row 4 attends to positions 3 and 4 only.
"""

from collections.abc import Sequence
from typing import Literal

import attrs
import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from vime_pure.data.microbatch import TrainMicroBatch
from vime_pure.errors import VimeError, field_error

Packing = Literal["mask", "thd"]


@attrs.frozen(kw_only=True, eq=False)
class MicroBatchTensors:
    """Tensors of one record (names as in :class:`TrainMicroBatch`); ``record`` is the source."""

    record: TrainMicroBatch
    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None
    packed_seq_params: PackedSeqParams | None
    logit_index: torch.Tensor
    token_sample: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    denominators: torch.Tensor
    rollout_log_probs: torch.Tensor | None
    old_log_probs: torch.Tensor | None
    ref_log_probs: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])


def to_tensors(record: TrainMicroBatch, packing: Packing,
               device: torch.device | str = "cpu") -> MicroBatchTensors:
    """The record's tensors on ``device`` with the platform's attention layout."""
    if packing not in ("mask", "thd"):
        raise field_error(VimeError, "packing", packing, "is not a packed-row layout",
                          "use 'mask' (CPU, local attention) or 'thd' (CUDA, TransformerEngine)")
    if record.cp_size > 1 and packing != "thd":
        raise field_error(VimeError, "cp_size", record.cp_size, "needs THD packing",
                          "run context parallelism on CUDA with TransformerEngine")

    def tensor(values: np.ndarray | None) -> torch.Tensor | None:
        return None if values is None else torch.from_numpy(values).to(device)

    seq = record.seq_lengths.tolist()
    return MicroBatchTensors(
        record=record, tokens=tensor(record.tokens)[None],
        position_ids=tensor(record.positions)[None], labels=tensor(record.labels)[None],
        attention_mask=block_causal_mask(seq).to(device) if packing == "mask" else None,
        packed_seq_params=thd_params(seq, device) if packing == "thd" else None,
        logit_index=tensor(record.logit_index), token_sample=tensor(record.token_sample),
        loss_mask=tensor(record.loss_mask), advantages=tensor(record.advantages),
        denominators=tensor(record.denominators),
        rollout_log_probs=tensor(record.rollout_log_probs),
        old_log_probs=tensor(record.old_log_probs), ref_log_probs=tensor(record.ref_log_probs))


def block_causal_mask(lengths: Sequence[int]) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where attention is *blocked*: across samples or to the future."""
    total = int(sum(lengths))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(list(lengths)))
    same = doc[:, None] == doc[None, :]
    return ~(same & torch.ones(total, total, dtype=torch.bool).tril())[None, None]


def thd_params(lengths: Sequence[int], device: torch.device | str = "cpu") -> PackedSeqParams:
    """Megatron ``PackedSeqParams`` (THD) for samples of ``lengths`` packed back to back."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int32), 0)
    cu = cu.to(device)
    longest = int(max(lengths))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)

