"""A generation round's prompts handed out as chunks, and the chunks put back in prompt order.

With ``E`` engines, engines *claim* chunks of the round's ``P`` prompts from one shared counter
(the shell keeps it in the job's ``torch.distributed`` store) until the prompts run out: claim
``k`` is prompts ``[k*c, min((k+1)*c, P))`` (``chunk_range``) with ``c =
queue_chunk_size(P, E, per_engine=k)``. A fast engine claims more chunks, a slow one fewer, so the round ends
when the prompts end, not when the slowest engine's fixed block ends. A chunk holds whole
prompts: a prompt's ``n`` samples (its rollout groups, its prompt group) never straddle two
chunks, nor two engines.

What an engine generated depends only on the chunk's global prompt indices (request seeds and
group ids derive from them, ``RolloutContext.prompt_offset``), never on which engine claimed it
or when. Putting every chunk back at its first prompt's place (``prompt_order``) therefore
gives the batch of contiguous blocks, bit for bit, whatever the claim pattern.

Why ``c = ceil(P / (k E))`` with ``k = chunks_per_engine(...)``: every chunk is one batched
``generate`` call, and a call ends with a tail while its longest responses finish. Where a
call's time grows with its tokens (the HF engine on CPU: every step costs the whole padded
batch), more calls cost nothing and ``k = 4`` claims per engine bound the final imbalance to a
quarter of an even share. Where a call's time is its longest response (vLLM, any engine on a
GPU: the batch decodes in parallel), each extra call adds a tail: the model
``python -m benchmarks.work_queue`` gives 1.5-2.3x the makespan of contiguous blocks at
``k = 4`` for equal engines and long-tailed responses, so there ``k = 1``: one block-sized
claim per engine (the batch and the failure handling are the queue's; an engine that starts
late loses its block to a free one; a slow engine is not helped, which needs request-level
streaming, not built).

Example: ``queue_chunk_size(64, 4) == 4``; claims 0..15 are prompts 0-3, 4-7, ..., 60-63; claim
16 is ``range(64, 64)``, the end. Engine 0 holding claims 0 and 3 and engine 1 claim 1 and 2
merge as chunks at prompts 0, 4, 8, 12: the blocks' order.
"""

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
from jaxtyping import Int64

from vime_pure.errors import RolloutValidationError, field_error

T = TypeVar("T")
CHUNKS_PER_ENGINE = 4


def _count(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise field_error(RolloutValidationError, name, value, f"must be an integer >= {lo}",
                          "pass the round's prompt count, the engine count and a claim index")
    return int(value)


def chunks_per_engine(*, tail_bound: bool) -> int:
    """Claims per engine of a round: 1 where a ``generate`` call lasts as long as its longest
    response (vLLM, GPUs), else ``CHUNKS_PER_ENGINE`` (module docstring). Example:
    ``chunks_per_engine(tail_bound=False) == 4``."""
    return 1 if tail_bound else CHUNKS_PER_ENGINE


def queue_chunk_size(num_prompts: int, num_engines: int, *,
                     per_engine: int = CHUNKS_PER_ENGINE) -> int:
    """Prompts per claim: ``ceil(P / (per_engine * E))``, at least 1 (module docstring).
    Example: ``queue_chunk_size(10, 2) == 2``, ``queue_chunk_size(3, 8) == 1``,
    ``queue_chunk_size(10, 2, per_engine=1) == 5``."""
    p, e = _count("num_prompts", num_prompts, 0), _count("num_engines", num_engines, 1)
    k = _count("per_engine", per_engine, 1)
    return max(1, -(-p // (k * e)))


def chunk_range(claim: int, chunk: int, num_prompts: int) -> range:
    """The prompts of claim ``claim`` (0-based), empty once past the end. Example:
    ``chunk_range(2, 4, 10) == range(8, 10)``, ``chunk_range(3, 4, 10) == range(10, 10)``."""
    k, c = _count("claim", claim, 0), _count("chunk", chunk, 1)
    p = _count("num_prompts", num_prompts, 0)
    return range(min(k * c, p), min((k + 1) * c, p))


def prompt_order(starts: Int64[np.ndarray, " k"]) -> Int64[np.ndarray, " k"]:
    """The order that puts chunks starting at global prompts ``starts`` in prompt order; two
    chunks at one start are an error (a prompt claimed twice). Example: ``[4, 0, 8] -> [1, 0,
    2]``."""
    starts = np.asarray(starts, dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    dup = np.flatnonzero(np.diff(starts[order]) == 0)
    if dup.size:
        raise field_error(RolloutValidationError, "prompt chunk", int(starts[order][dup[0]]),
                          "is held by two parts (a prompt generated twice)",
                          "claim each chunk once (EngineGroup's work queue) and give every "
                          "part its own first prompt index")
    return order.astype(np.int64)


def in_prompt_order(chunks: Sequence[tuple[int, T]]) -> list[T]:
    """``(first prompt, output)`` chunks from any engines, as their outputs in prompt order.
    Example: ``[(4, b), (0, a)] -> [a, b]``."""
    order = prompt_order(np.array([s for s, _ in chunks], dtype=np.int64))
    return [chunks[i][1] for i in order.tolist()]
