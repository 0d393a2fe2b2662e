"""Per-token weight versions: which weights sampled each response token, when a weight sync
lands inside a request (``--pause-generation-mode in_place`` or ``retract``), and the
staleness bound acting per token.

A sample's ``token_versions`` (``vime_pure.data.sample``) holds one int per response token: the
weight version that sampled it, or ``NO_VERSION`` (-1) for a response token no sampling
produced (a tool's output, a bridge the template writes). Generated tokens' versions never
decrease along the response (weights only move forward). What a version means per policy:

- ``in_place``: the token was sampled by version ``v``'s weights, attending to a cache that
  older weights may have built (the tokens before it keep their KV);
- ``retract``: sampled by ``v``'s weights on a cache ``v`` recomputed (the context is new, the
  earlier tokens themselves stay the versions that sampled them);
- ``abort``: a request never spans a sync (it ends and its group is generated again).

Token staleness is ``trainer version - v``. The bound ``K`` (``--max-weight-staleness``) acts per
token: :func:`mask_stale_tokens` sets the loss mask to 0 on generated tokens staler than ``K``,
so the group's denominators, computed from the masks by the core
(``vime_pure.denominators``), stay exact; a group with no token left to train is recycled by
its pool, as a stale group always was.

Invariants the tests assert (``tests/property/test_token_versions.py``): masking never sets a
mask to 1, keeps exactly the generated tokens within the bound (context tokens untouched), is
idempotent and monotone in ``K``; :func:`version_runs` expands back to the versions; a sample
spanning ``k`` syncs, masked and split into any micro-batches, gives the loss of its tokens in
one micro-batch.

Example: versions ``[3, 3, -1, 4, 5]``, mask ``[1, 1, 0, 1, 1]``, trainer 6, ``K = 2``: staleness
``[3, 3, -, 2, 1]``, mask ``[0, 0, 0, 1, 1]``; ``version_runs`` gives ``[3, 4, 5]`` starting at
``[0, 3, 4]``.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import Int64

from vime_pure.errors import RolloutValidationError

Ints = Sequence[int] | np.ndarray  # a sample's per-token list, as a rollout function keeps it
NO_VERSION = -1  # a response token no sampling produced
# What a weight sync does to the requests in flight (--pause-generation-mode, miles' names and
# meanings; the module docstring says what a token's version means under each)
PAUSE_MODES = ("in_place", "retract", "abort")


def checked_versions(token_versions: Any, response_length: int, where: str
                     ) -> Int64[np.ndarray, " r"]:
    """``token_versions`` as an int64 array, or a :class:`RolloutValidationError` naming
    ``where``: one entry per response token, each ``NO_VERSION`` or a version >= 0, the
    generated tokens' versions non-decreasing."""
    try:
        values = np.asarray(token_versions, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        values = None
    if values is None or values.ndim != 1 or len(values) != response_length:
        raise RolloutValidationError(
            f"{where}: token_versions={token_versions!r:.60} is not one int per response token "
            f"({response_length}). Fix: record the engine's weight version of each sampled "
            f"token and {NO_VERSION} for tokens no sampling produced, or leave it None")
    generated = values[values != NO_VERSION]
    if (values < NO_VERSION).any() or (np.diff(generated) < 0).any():
        raise RolloutValidationError(
            f"{where}: token_versions={values[:8].tolist()} holds a value below {NO_VERSION} "
            "or decreases. Fix: versions only move forward along a response")
    return values


def version_runs(token_versions: Ints) -> tuple[list[int], list[int]]:
    """The generated tokens' versions as runs: ``(versions, first response position of each)``,
    what ``Sample.weight_versions`` keeps (one entry per run). Example: ``[3, 3, -1, 4]`` gives
    ``([3, 4], [0, 3])``."""
    versions: list[int] = []
    starts: list[int] = []
    for i, v in enumerate(token_versions):
        v = int(v)
        if v != NO_VERSION and (not versions or v != versions[-1]):
            versions.append(v)
            starts.append(i)
    return versions, starts


def tokens_before(token_versions: Ints, version: int) -> int:
    """How many leading response tokens come before the first token sampled by ``version`` or
    newer (all of them when none was): what ``--mask-offpolicy-in-partial-rollout`` masks.
    Example: ``[3, 3, -1, 4]`` at version 4: 3."""
    for i, v in enumerate(token_versions):
        if int(v) >= version:
            return i
    return len(token_versions)


def mask_stale_tokens(loss_mask: Ints, token_versions: Ints, trainer_version: int,
                      max_staleness: int | None) -> tuple[list[int], int]:
    """``(the loss mask with every generated token staler than max_staleness set to 0, how
    many trained tokens that removed)``; None: no bound. Context tokens are left as they are."""
    mask = [int(m) for m in loss_mask]
    if max_staleness is None:
        return mask, 0
    removed = 0
    for i, v in enumerate(token_versions):
        if int(v) != NO_VERSION and trainer_version - int(v) > max_staleness and mask[i]:
            mask[i] = 0
            removed += 1
    return mask, removed


def token_staleness_counts(token_versions: Ints, loss_mask: Ints, trainer_version: int
                           ) -> dict[int, int]:
    """Trained generated tokens per staleness (``trainer_version - v``). Example: versions
    ``[3, 3, 4]``, mask ``[1, 0, 1]``, trainer 5: ``{2: 1, 1: 1}``."""
    counts: dict[int, int] = {}
    for v, m in zip(token_versions, loss_mask):
        if int(v) != NO_VERSION and m:
            s = trainer_version - int(v)
            counts[s] = counts.get(s, 0) + 1
    return counts
