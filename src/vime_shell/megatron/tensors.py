"""A core ``TrainMicroBatch`` record as the tensors of one Megatron forward: conversion only.

Every number (tokens, positions, labels, which logits score which response tokens, masks,
advantages, denominators, CP chunks) is decided by ``vime_pure.data.microbatch.rank_batch``;
this module adds only what depends on the platform:

- the attention layout of the packed row. On CUDA with TransformerEngine (``"thd"``):
  ``[1, T]`` tensors and Megatron ``PackedSeqParams`` whose ``cu_seqlens`` are the record's
  ``seq_lengths``. On CPU, whichever of two exact layouts costs fewer FLOPs (:func:`cpu_layout`):
  ``"mask"``, ``[1, T]`` tensors with a block-diagonal causal mask ``[1, 1, T, T]`` (True =
  masked out), or ``"padded"``, one row per sample ``[n, L_max]`` with a causal mask, each
  sample's tokens at its row's start. Local attention computes every score of its square, so
  the packed row pays ``T**2`` where the rows pay ``n * L_max**2``: for the demo's one-micro-
  batch steps (128 samples of ~5 tokens) that is 640**2 against 128 * 6**2 scores. Both give
  each sample the same attention (RoPE is relative, so where a sample starts does not matter);
- ``logit_index`` and ``labels`` in the flat ``[rows * columns]`` order of the model's output,
  so the objective indexes both layouts alike; ``routed_experts`` (routing replay) in the
  sequence-major order Megatron's routers see (:mod:`vime_shell.megatron.routing_replay`);
- device placement.

Example: a record of samples of 2 and 3 tokens gives ``tokens [1, 5]`` and a mask whose row 4
attends to positions 2-4 only ("mask"), or ``tokens [2, 3]`` whose first row ends in a pad
("padded"): packed position 2, the second sample's first token, is flat position 3 there.
"""

from collections.abc import Sequence
from typing import Literal, get_args

import attrs
import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from vime_pure.data.microbatch import TrainMicroBatch
from vime_pure.errors import VimeError, field_error
from vime_pure.scheduling.flops import FlopsModel
from vime_shell.megatron.routing_replay import routes_in_model_order

Layout = Literal["mask", "padded", "thd"]
LAYOUTS: tuple[str, ...] = get_args(Layout)


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
    teacher_log_probs: torch.Tensor | None = None
    opd_reverse_kl: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None  # [tokens, e] int16, the router's token order
    is_weights: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """The record's real tokens (pads of the "padded" layout excluded)."""
        return int(self.record.tokens.shape[0])

    @property
    def seq_length(self) -> int:
        """Columns of the model input (what Megatron's schedule calls the sequence length)."""
        return int(self.tokens.shape[1])


def to_tensors(record: TrainMicroBatch, layout: Layout,
               device: torch.device | str = "cpu") -> MicroBatchTensors:
    """The record's tensors on ``device`` in ``layout`` (module docstring; on CPU the trainer
    picks ``"mask"`` or ``"padded"`` per record with :func:`cpu_layout`)."""
    if layout not in LAYOUTS:
        raise field_error(VimeError, "layout", layout, "is not an attention layout",
                          f"use one of {LAYOUTS}: 'thd' needs CUDA and TransformerEngine")
    if record.cp_size > 1 and layout != "thd":
        raise field_error(VimeError, "cp_size", record.cp_size, "needs THD packing",
                          "run context parallelism on CUDA with TransformerEngine")

    def tensor(values: np.ndarray) -> torch.Tensor:
        """On ``device``; the records' int32 ids and indices widen to int64 here, per
        micro-batch, as embedding lookups and gathers take them."""
        out = torch.from_numpy(values)
        return (out if out.is_floating_point() else out.long()).to(device)

    def optional(values: np.ndarray | None) -> torch.Tensor | None:
        return None if values is None else tensor(values)

    seq = record.seq_lengths.tolist()
    tokens, positions, labels = record.tokens, record.positions, record.labels
    logit_index, mask, flat = record.logit_index, None, None
    if layout == "padded":
        width = max(seq)
        flat = np.repeat(np.arange(len(seq), dtype=np.int64), seq) * width + positions
        tokens, labels = _scatter(tokens, flat, len(seq), width), _scatter(labels, flat,
                                                                           len(seq), width)
        positions = np.broadcast_to(np.arange(width, dtype=np.int64), (len(seq), width))
        logit_index = flat[logit_index]
        mask = block_causal_mask([width])
    elif layout == "mask":
        mask = block_causal_mask(seq)
    return MicroBatchTensors(
        record=record, tokens=tensor(np.atleast_2d(tokens)),
        position_ids=tensor(np.ascontiguousarray(np.atleast_2d(positions))),
        labels=tensor(np.atleast_2d(labels)),
        attention_mask=None if mask is None else mask.to(device),
        packed_seq_params=thd_params(seq, device) if layout == "thd" else None,
        logit_index=tensor(logit_index), token_sample=tensor(record.token_sample),
        loss_mask=tensor(record.loss_mask), advantages=tensor(record.advantages),
        denominators=tensor(record.denominators),
        rollout_log_probs=optional(record.rollout_log_probs),
        old_log_probs=optional(record.old_log_probs),
        ref_log_probs=optional(record.ref_log_probs),
        teacher_log_probs=optional(record.teacher_log_probs),
        opd_reverse_kl=optional(record.opd_reverse_kl),
        is_weights=optional(record.is_weights),
        routed_experts=optional(None if record.routed_experts is None else routes_in_model_order(
            record.routed_experts, seq, flat)))


def cpu_layout(seq_lengths: Sequence[int], flops: FlopsModel) -> Layout:
    """``"padded"`` when ``n`` rows of ``L_max`` cost fewer forward FLOPs than one packed row
    of ``T``, else ``"mask"``; both compute full squares of attention scores (no kernel skips
    masked ones), hence ``2 * quadratic`` (the model's ``quadratic`` counts a causal half).

    Example (the embedded model, ``linear`` 6.6e5, ``quadratic`` 512): 128 samples of 5 tokens
    (T = 640) cost 8.4e8 packed and 4.2e8 padded; samples of 600 and 2 tokens stay packed.
    """
    total, rows, width = sum(seq_lengths), len(seq_lengths), max(seq_lengths)
    square = 2 * flops.quadratic
    packed = flops.linear * total + square * total * total
    padded = rows * (flops.linear * width + square * width * width)
    return "padded" if padded < packed else "mask"


def _scatter(values: np.ndarray, flat: np.ndarray, rows: int, width: int) -> np.ndarray:
    """``values`` (packed order) at ``flat`` of a zero ``[rows, width]`` array."""
    out = np.zeros(rows * width, dtype=values.dtype)
    out[flat] = values
    return out.reshape(rows, width)


def block_causal_mask(lengths: Sequence[int], device: torch.device | str = "cpu"
                      ) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where attention is *blocked*: across samples or to the future."""
    total = int(sum(lengths))
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.as_tensor(list(lengths), device=device))
    same = doc[:, None] == doc[None, :]
    return ~(same & torch.ones(total, total, dtype=torch.bool, device=device).tril())[None, None]


def thd_params(lengths: Sequence[int], device: torch.device | str = "cpu") -> PackedSeqParams:
    """Megatron ``PackedSeqParams`` (THD) for samples of ``lengths`` packed back to back."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int32), 0)
    cu = cu.to(device)
    longest = int(max(lengths))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)

