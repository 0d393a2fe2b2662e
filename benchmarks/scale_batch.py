"""The synthetic columnar batches of the scale benchmarks (``benchmarks/scale.py`` and
``benchmarks/scale_shares.py`` both build them; a module of their own, so neither imports the
other back): zero tokens, masks and log-probs at the workload's lengths.
"""

import numpy as np

from vime_pure import RolloutBatch

PROMPT_TOKENS = 500  # the workload's median prompt; the rest of a sample is its response


def response_lengths(lengths: np.ndarray) -> np.ndarray:
    return np.clip(lengths - PROMPT_TOKENS, 1, lengths).astype(np.int64)


def columns_bytes(lengths: np.ndarray) -> int:
    """``RolloutBatch`` nbytes for these lengths: per sample 10 int64/float64 columns (the
    two weight-version bounds included) and two offsets, 2 one-byte flags; per token an int32 id; per response token a mask byte and a
    float32 log-prob. Checked against a real batch by the smoke test."""
    n = len(lengths)
    return int(n * (10 * 8 + 2) + 2 * (n + 1) * 8 + 4 * int(lengths.sum())
               + 5 * int(response_lengths(lengths).sum()))


def columnar_batch(lengths: np.ndarray, group_ids: np.ndarray,
                   prompt_ids: np.ndarray) -> RolloutBatch:
    """A valid ``RolloutBatch`` of these lengths with zero tokens, masks and log-probs."""
    n = len(lengths)
    response = response_lengths(lengths)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    r_offsets = np.zeros(n + 1, np.int64)
    np.cumsum(response, out=r_offsets[1:])
    _, groups = np.unique(group_ids, return_inverse=True)  # dense, first occurrence = order
    _, prompts = np.unique(prompt_ids, return_inverse=True)
    zeros = np.zeros(n)
    return RolloutBatch(
        tokens=np.zeros(int(offsets[-1]), np.int32), token_offsets=offsets,
        lengths=lengths.astype(np.int64), response_lengths=response,
        loss_masks=np.zeros(int(r_offsets[-1]), np.uint8), response_offsets=r_offsets,
        rollout_log_probs=np.zeros(int(r_offsets[-1]), np.float32),
        group_ids=groups.astype(np.int64), group_id_values=tuple(range(int(groups.max()) + 1)),
        prompt_groups=prompts.astype(np.int64),
        prompt_group_values=tuple(range(int(prompts.max()) + 1)), group_mask_sums=zeros,
        rewards=zeros, advantages=zeros, statuses=np.zeros(n, np.uint8),
        removed=np.zeros(n, bool), sample_indices=np.arange(n, dtype=np.int64))
