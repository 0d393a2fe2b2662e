"""Token ids against the model's vocabulary, checked before a batch reaches the trainer.

An id at or above the embedding's row count (``vocab_size`` in the model's ``config.json``,
the reserved padding rows included) or below 0 makes the embedding lookup fail deep inside
the forward pass (an ``IndexError``, or on CUDA a device-side assert that kills the process).
Whatever produced it (an engine, a rollout function, a reward that rewrote ``tokens``, a
dump), :func:`check_token_ids` names the sample and position instead.

Example: the embedded model has 20 embedding rows (19 tokenizer tokens and a reserved pad
row): ids 0..19 pass; a sample holding 25 raises ``TokenIdError: sample 3 (output index 3,
group 'g1'): tokens[7]=25 is outside the vocabulary [0, 20) ...``.
"""

from typing import Any

import numpy as np

from vime_pure.config import as_int
from vime_pure.data.batch import RolloutBatch
from vime_pure.errors import RolloutValidationError, type_tag


class TokenIdError(RolloutValidationError):
    """A token id outside the model's vocabulary (names the sample and the position)."""


def check_token_ids(batch: Any, vocab_size: Any, *, source: str = "the rollout") -> None:
    """Raise :class:`TokenIdError` for the first token id outside ``[0, vocab_size)``.

    ``source`` says where the batch came from (``"rollout 3"``, ``"dump rollout_3.npz"``).
    One vectorised comparison over the flat token column: free next to a forward pass.
    """
    if not isinstance(batch, RolloutBatch):
        raise TokenIdError(f"batch={type_tag(batch)!r}: is not a RolloutBatch. Fix: pass "
                           "RolloutBatch.from_samples(...).")
    vocab = as_int("vocab_size", vocab_size, 1, TokenIdError,
                   "pass the model's embedding rows (config.json vocab_size)")
    bad = (batch.tokens < 0) | (batch.tokens >= vocab)
    if not bad.any():
        return
    flat = int(np.argmax(bad))
    i = int(np.searchsorted(batch.token_offsets, flat, side="right") - 1)
    pos = flat - int(batch.token_offsets[i])
    part = "prompt" if pos < batch.lengths[i] - batch.response_lengths[i] else "response"
    group = batch.group_id_values[batch.group_ids[i]]
    count = int(bad.sum())
    raise TokenIdError(
        f"{source}: sample {i} (sample index {int(batch.sample_indices[i])}, group {group!r}): "
        f"tokens[{pos}]={int(batch.tokens[flat])} ({part} token) is outside the vocabulary "
        f"[0, {vocab}) of the model ({count} such token(s) in the batch). Fix: tokenize with "
        "the model's own tokenizer, and check what the engine, rollout function, reward or "
        "dump wrote into Sample.tokens.")
