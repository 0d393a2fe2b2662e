"""Zigzag context parallelism: which positions, logits and response tokens a CP rank holds.

Torch-free: the micro-batch builder (``vime_pure.data.microbatch``) cuts every CP rank's tokens
with these offsets, and ``vime_pure.torch_ops.cp`` slices tensors with the same ones.

A sample of ``total_length = L`` tokens (prompt ``P = L - R`` then response ``R``) is cut into
``2 * cp_size`` chunks of ``chunk = ceil(L / (2 * cp_size))`` positions (the last ones padded).
Rank ``r`` holds chunks ``r`` and ``2*cp_size - 1 - r``, which balances causal-attention work.
The logit at position ``p`` predicts token ``p + 1``, so response token ``P + j`` (response
index ``j``) is scored by the logit at ``P - 1 + j``: rank ``r`` owns the response indices whose
logit position falls in its chunks.

Invariants the tests assert: for every ``(L, R, cp_size)`` the ranks' chunks tile
``[0, 2*cp_size*chunk)``, their response index ranges tile ``[0, R)`` without overlap, token
ranges are logit ranges shifted by one, and slicing then concatenating over ranks is a
permutation of the sample's response tokens. Hence CP partial numerators over full
denominators sum to the full value.

Example: ``L = 16, R = 8, cp_size = 2`` (prompt 8, chunk 4): rank 0 holds positions [0,4) and
[12,16) and scores response indices [5,8); rank 1 holds [4,8) and [8,12) and scores [0,5).
"""

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from vime_pure.errors import CPConfigError, field_error

Range = tuple[int, int]


@attrs.frozen
class ZigzagOffsets:
    """Where one sample lives on one CP rank (half-open position ranges, two per field).

    ``chunks``: the rank's two chunks of sequence positions. ``logits``: the logit positions of
    the response inside them. ``tokens``: the response tokens those logits score (logits + 1).
    ``response``: the same ranges in response coordinates ``[0, R)``. Empty ranges are
    ``(0, 0)`` in ``logits``/``tokens`` and ``(j, j)`` in ``response``.
    """

    chunk_size: int
    chunks: tuple[Range, Range]
    logits: tuple[Range, Range]
    tokens: tuple[Range, Range]
    response: tuple[Range, Range]

    @property
    def num_response_tokens(self) -> int:
        """Response tokens this rank scores."""
        return sum(b - a for a, b in self.response)


def _integer(field: str, value: object, lo: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise field_error(CPConfigError, field, value, f"must be an integer >= {lo}", fix)


def check_cp_sample(total_length: Any, response_length: Any, cp_rank: Any, cp_size: Any) -> None:
    """Integers in range (typed loosely: ``zigzag_offsets`` is a user boundary)."""
    _integer("cp_size", cp_size, 1, "pass the context-parallel size, 1 when CP is off")
    _integer("cp_rank", cp_rank, 0, "pass this rank's index in the CP group")
    if cp_rank >= cp_size:
        raise field_error(CPConfigError, "cp_rank", cp_rank, f"is not below cp_size={cp_size}",
                          "pass a rank in [0, cp_size)")
    _integer("response_length", response_length, 0, "pass the response token count")
    _integer("total_length", total_length, 1, "pass prompt + response token count")
    if response_length >= total_length:
        raise field_error(CPConfigError, "response_length", response_length,
                          f"must be below total_length={total_length} (the first response "
                          "token is scored by the last prompt token's logit)",
                          "include at least one prompt token in total_length")


def zigzag_offsets(total_length: Any, response_length: Any, cp_rank: Any,
                   cp_size: Any) -> ZigzagOffsets:
    """Zigzag chunk, logit, token and response offsets of one sample on one CP rank.

    Example: ``L=16, R=8, cp_size=2`` (prompt 8, first response logit at 7, chunk 4):
    rank 0 holds chunks [0,4) and [12,16): logits (0,0) (empty) and [12,15), tokens [13,16),
    response (0,0) and [5,8); rank 1 holds [4,8) and [8,12): logits [7,8) and [8,12), tokens
    [8,9) and [9,13), response [0,1) and [1,5). Zigzag balances attention work, not response
    tokens: rank 0 scores 3 tokens, rank 1 scores 5.
    """
    check_cp_sample(total_length, response_length, cp_rank, cp_size)
    chunks = zigzag_chunks(total_length, cp_rank, cp_size)
    chunk = chunks[0][1] - chunks[0][0]
    start = total_length - response_length - 1  # logit of the first response token
    logits, tokens, response = [], [], []
    for lo, hi in chunks:
        a, b = max(lo, start), min(hi, total_length - 1)
        if a < b:
            logits.append((a, b))
            tokens.append((a + 1, b + 1))
            response.append((a - start, b - start))
        else:
            logits.append((0, 0))
            tokens.append((0, 0))
            # An empty range placed where it would sit keeps response ranges sorted per rank.
            j = min(max(lo - start, 0), response_length)
            response.append((j, j))
    return ZigzagOffsets(chunk_size=chunk, chunks=(chunks[0], chunks[1]),
                         logits=(logits[0], logits[1]), tokens=(tokens[0], tokens[1]),
                         response=(response[0], response[1]))


def zigzag_chunks(length: int, cp_rank: int, cp_size: int) -> tuple[Range, Range]:
    """The rank's two chunks of a sequence of ``length`` positions (padded to ``2*cp*chunk``).

    Example: ``length=10, cp_size=2``: chunk 3, rank 0 holds ``[0, 3)`` and ``[9, 12)``.
    """
    check_cp_sample(length + 1, 0, cp_rank, cp_size)
    chunk = -(-length // (2 * cp_size))
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return (first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk)


def zigzag_row_positions(lengths: Sequence[int], cp_rank: int, cp_size: int) -> np.ndarray:
    """Where a CP rank's positions sit in a packed row of samples of ``lengths`` (each cut on
    its own, :func:`zigzag_chunks`), in the order the rank holds them: its tokens' indices
    into the whole row (int64).

    Example: ``lengths [4, 8]``, ``cp_size=2``: rank 0 holds ``[0, 3, 4, 5, 10, 11]``, rank 1
    ``[1, 2, 6, 7, 8, 9]``.
    """
    starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64)
    return np.concatenate([np.arange(start + a, start + e, dtype=np.int64)
                           for start, n in zip(starts.tolist(), lengths)
                           for a, e in zigzag_chunks(int(n), cp_rank, cp_size)])
