"""Zigzag context parallelism on tensors: each CP rank's slice of a sample or a packed row.

The offsets come from :mod:`vime_pure.cp` (torch-free), the one place that decides which
positions and response tokens a CP rank holds; this module only applies them to tensors.

Example: ``slice_response(arange(8), total_length=16, cp_rank=0, cp_size=2)`` is ``[5, 6, 7]``.
"""

import torch
from jaxtyping import Int, Shaped
from torch import Tensor

from vime_pure.cp import zigzag_chunks, zigzag_offsets
from vime_pure.errors import CPConfigError, field_error
from vime_pure.torch_ops.boundary import tensor_boundary


@tensor_boundary(error=CPConfigError)
def slice_response(values: Shaped[Tensor, " r"], total_length: int, cp_rank: int,
                   cp_size: int) -> Shaped[Tensor, " k"]:
    """This rank's part of one sample's per-response-token tensor (values, masks, advantages).

    Example: ``values = arange(8)`` with ``L=16, cp_size=2``: rank 0 gets ``[5, 6, 7]``, rank 1
    ``[0, 1, 2, 3, 4]`` (see ``zigzag_offsets``); with ``cp_size=1``, ``values`` unchanged.
    """
    off = zigzag_offsets(total_length, values.shape[0], cp_rank, cp_size)
    return torch.cat([values[a:b] for a, b in off.response])


@tensor_boundary(error=CPConfigError)
def slice_sequence(values: Shaped[Tensor, " n"], cp_rank: int, cp_size: int,
                   pad_value: int | float = 0) -> Shaped[Tensor, " k"]:
    """This rank's two zigzag chunks of a whole-sequence tensor (tokens, positions), padded.

    Example: ``values = arange(10)``, ``cp_size=2``, rank 0: ``[0, 1, 2, 9, pad, pad]``
    (chunks [0,3) and [9,12) of the sequence padded to 12).
    """
    chunks = zigzag_chunks(values.shape[0], cp_rank, cp_size)
    chunk = chunks[0][1] - chunks[0][0]
    padded = torch.full((2 * cp_size * chunk,), pad_value, dtype=values.dtype)
    padded[: values.shape[0]] = values
    return torch.cat([padded[a:b] for a, b in chunks])


@tensor_boundary(error=CPConfigError)
def slice_packed_response(values: Shaped[Tensor, " t"], total_lengths: list[int],
                          response_lengths: list[int], cp_rank: int, cp_size: int
                          ) -> tuple[Shaped[Tensor, " k"], Int[Tensor, " s"]]:
    """Slice a packed row of per-response-token values (samples concatenated) for one CP rank.

    Each sample is zigzag-split on its own (THD packing). Returns the local values and the
    per-sample local lengths (feed them to ``sample_index_from_lengths``).
    Example: responses of lengths ``[8, 2]`` with ``total_lengths [16, 4]``, ``cp_size=2``:
    local lengths ``[3, 0]`` on rank 0 and ``[5, 2]`` on rank 1.
    """
    if len(total_lengths) != len(response_lengths) or sum(response_lengths) != values.shape[0]:
        raise field_error(CPConfigError, "response_lengths", response_lengths,
                          f"must have one entry per total_lengths ({len(total_lengths)}) and sum "
                          f"to the row's {values.shape[0]} tokens",
                          "pass the per-sample response lengths of the packed row")
    pieces, lengths, offset = [], [], 0
    for total, resp in zip(total_lengths, response_lengths):
        piece = slice_response(values[offset:offset + resp], total, cp_rank, cp_size)
        pieces.append(piece)
        lengths.append(piece.shape[0])
        offset += resp
    local = torch.cat(pieces) if pieces else values[:0]
    return local, torch.tensor(lengths, dtype=torch.int64)
