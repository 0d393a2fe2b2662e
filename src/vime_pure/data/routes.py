"""Routed experts for rollout routing replay (R3): which experts the engine's router chose.

An MoE engine routes every token it feeds through the model to ``topk`` experts in every MoE
layer. A sample's ``rollout_routed_experts`` holds those choices as integers shaped
``[rows, layers, topk]`` with ``rows == len(tokens)``, or ``len(tokens) - 1``: an engine never
feeds its last sampled token back, so it has no route (vLLM's and SGLang's arrays are this
long). The trainer's forward over that last token scores nothing (no response token is
predicted from it), so any valid route is exact there: the batch repeats the row before.

The batch stores one int16 matrix ``[t, layers * topk]`` aligned with ``tokens`` (row ``j`` is
token ``j``'s routes, layer-major); micro-batch rows gather it with the same indices as their
tokens, CP chunks and padding included (``vime_pure.data.microbatch``), so a route always travels with
its token. int16 holds expert ids below 32768 (DeepSeek-V3 has 256).

Example: a 3-token sample with ``[[[0, 1]], [[2, 3]]]`` (2 rows, 1 layer, top-2) becomes rows
``[[0, 1], [2, 3], [2, 3]]`` of the batch matrix.
"""

from collections.abc import Callable, Sequence

import numpy as np
from jaxtyping import Int16, Int64

from vime_pure.data.rollout_output import all_or_none
from vime_pure.errors import RolloutValidationError

ROUTE_DTYPE = np.dtype(np.int16)
MAX_EXPERTS = int(np.iinfo(np.int16).max) + 1


def flat_routes(parts: Sequence[object], lengths: Int64[np.ndarray, " n"],
                path: Callable[[int], str]) -> Int16[np.ndarray, "t e"] | None:
    """The batch matrix of every sample's routes (module docstring); None when no sample has
    them. Every sample has them or none; each has one route per token (or per token but the
    last), the same ``layers`` and ``topk``, and ``topk`` distinct ids in ``[0, 32768)`` per
    layer; anything else is a ``RolloutValidationError`` naming the sample's path."""
    if not all_or_none(list(parts), "rollout_routed_experts", path, "return routed experts for "
                       "every sample or for none (replay cannot mix routed and free tokens)"):
        return None
    blocks, shape = [], None
    for i, (part, n) in enumerate(zip(parts, lengths.tolist())):
        routes = _as_routes(part, path(i))
        if shape is None:
            shape = routes.shape[1:]
        if routes.shape[1:] != shape:
            raise RolloutValidationError(
                f"{path(i)}: rollout_routed_experts has {routes.shape[1]} layers x top-"
                f"{routes.shape[2]} but {path(0)} has {shape[0]} x {shape[1]}. Fix: record "
                "every sample with the same model.")
        if routes.shape[0] == n - 1 and n > 1:
            routes = np.concatenate([routes, routes[-1:]])  # the unrouted last token
        elif routes.shape[0] != n:
            raise RolloutValidationError(
                f"{path(i)}: rollout_routed_experts has {routes.shape[0]} rows for {n} tokens. "
                "Fix: give one route per token (or per token but the last), prompt included.")
        blocks.append(routes.reshape(n, -1))
    return np.concatenate(blocks).astype(ROUTE_DTYPE, copy=False)


def _as_routes(part: object, where: str) -> np.ndarray:
    """One sample's routes as an int64 ``[rows, layers, topk]`` array, checked."""
    try:
        routes = np.asarray(part)
    except (TypeError, ValueError):
        routes = np.zeros(0)
    if routes.ndim != 3 or routes.dtype.kind not in "iu" or 0 in routes.shape[1:]:
        raise RolloutValidationError(
            f"{where}: rollout_routed_experts is {routes.dtype}{list(routes.shape)}, not an "
            "integer array [tokens, layers, topk]. Fix: pass the engine's routed experts "
            "(vLLM's CompletionOutput.routed_experts) unchanged.")
    routes = routes.astype(np.int64, copy=False)
    if routes.size and (routes.min() < 0 or routes.max() >= MAX_EXPERTS):
        raise RolloutValidationError(
            f"{where}: rollout_routed_experts holds expert id "
            f"{int(routes.min() if routes.min() < 0 else routes.max())}, outside "
            f"[0, {MAX_EXPERTS}). Fix: pass expert indices, not scores.")
    if routes.shape[2] > 1 and (np.diff(np.sort(routes, axis=2), axis=2) == 0).any():
        raise RolloutValidationError(
            f"{where}: rollout_routed_experts routes a token to one expert twice in a layer. "
            "Fix: pass the router's top-k indices (distinct per token and layer).")
    return routes

