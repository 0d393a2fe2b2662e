"""Rollout routing replay (R3, ``--use-rollout-routing-replay``) in Megatron's MoE routers.

With ``moe_enable_routing_replay`` every ``TopKRouter`` holds a Megatron ``RouterReplay``;
vime swaps it for :class:`RolloutRouterReplay` and, before each model chunk's forward over a
micro-batch, hands every router of that chunk its layer's columns of the record's
``routed_experts`` (the engine's choices, gathered with the tokens by the core). The router
then takes those experts instead of its own top-k and weights them with its own scores
(``scores.gather``), so gradients still reach the router weights.

Recompute: a router forward that runs inside a backward pass (full or ``moe`` recompute) is
the recomputation of the oldest micro-batch not yet backpropagated through that router (1F1B
and the interleaved schedule run each chunk's backwards in forward order), so it replays
Megatron's ``replay_backward_list`` in order (``REPLAY_BACKWARD``); every other forward replays
the routes just set (``REPLAY_FORWARD``). The lists are cleared after every schedule run.

Token order: Megatron flattens ``[s, b]`` hidden states sequence-major, so a CPU "padded"
record (one row per sample) is transposed here, its padding taking the row's last token's
routes; under sequence parallelism each TP rank routes its own ``s / tp`` slice.

Example: a Qwen3-MoE of 48 MoE layers at top-8 takes records whose ``routed_experts`` have
384 columns; layer ``j``'s router gets columns ``8 * j .. 8 * j + 7``.
"""

from collections.abc import Sequence

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from vime_pure.data.microbatch import TrainMicroBatch
from vime_pure.errors import VimeError, field_error


class RolloutRouterReplay(RouterReplay):
    """Megatron's per-router replay, choosing its action per call (module docstring)."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        # -1 outside autograd's engine (torch has no public "in backward" query); Megatron's
        # recompute (full, or the 'moe' module) runs the router again inside a backward pass.
        recompute = torch._C._current_graph_task_id() != -1
        self.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD if recompute
                                      else RouterReplayAction.REPLAY_FORWARD)
        return super().get_replay_topk(scores, topk, num_groups, group_topk,
                                       default_compute_topk)


def moe_layer_columns(moe_layer_freq: int | Sequence[int], num_layers: int) -> dict[int, int]:
    """Route column block of each MoE layer: ``{0-based layer: its index among MoE layers}``.
    Example: ``moe_layer_freq=2`` over 4 layers gives ``{0: 0, 2: 1}``."""
    if isinstance(moe_layer_freq, int):
        pattern = [int(i % moe_layer_freq == 0) for i in range(num_layers)]
    else:
        pattern = list(moe_layer_freq)
    moe = [i for i, is_moe in enumerate(pattern) if is_moe]
    return {layer: j for j, layer in enumerate(moe)}


def routes_in_model_order(routes: np.ndarray | None, seq_lengths: Sequence[int],
                          flat: np.ndarray | None) -> np.ndarray | None:
    """A record's ``[T, e]`` routes in the order the router sees the tokens: unchanged for a
    packed row (``flat`` None); for the "padded" layout (``flat``: each token's place in the
    ``[rows, width]`` input) transposed to width-major, padding taking its row's last token's
    routes. Example: rows of 2 and 1 tokens with routes ``a, b, c`` give ``a, c, b, c``."""
    if routes is None or flat is None:
        return routes
    rows, width = len(seq_lengths), max(seq_lengths)
    last = np.cumsum(seq_lengths) - 1
    out = np.repeat(routes[last], width, axis=0)
    out[flat] = routes
    return out.reshape(rows, width, -1).transpose(1, 0, 2).reshape(rows * width, -1)


class RouteReplayer:
    """The routers of a trainer's model chunks and the routes they replay (module docstring).

    ``config`` is the trainer's ``TransformerConfig`` (MoE layer pattern, top-k, experts,
    sequence parallelism).
    """

    def __init__(self, config, tp_rank: int, tp_size: int):
        if getattr(config, "moe_router_fusion", False):  # ModelOptions turns it off
            raise field_error(VimeError, "moe_router_fusion", True, "bypasses RouterReplay "
                              "(TransformerEngine's fused top-k)", "leave it off with "
                              "--use-rollout-routing-replay")
        self.columns = moe_layer_columns(config.moe_layer_freq, config.num_layers)
        self.topk, self.num_experts = config.moe_router_topk, config.num_moe_experts
        self.width = len(self.columns) * self.topk
        self.sequence_parallel = bool(config.sequence_parallel) and tp_size > 1
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._routers: dict[int, list[tuple[RolloutRouterReplay, int]]] = {}

    def _of(self, chunk: torch.nn.Module) -> list[tuple[RolloutRouterReplay, int]]:
        """``(replay, column block)`` of every router in ``chunk`` (found once per chunk)."""
        key = id(chunk)
        if key not in self._routers:
            found = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter) and module.router_replay is not None:
                    old, module.router_replay = module.router_replay, RolloutRouterReplay()
                    # Megatron's class-wide registry would keep every router of every model
                    # built in this process alive; vime addresses routers per chunk instead.
                    registry = RouterReplay.global_router_replay_instances
                    registry[:] = [r for r in registry if r is not old
                                   and r is not module.router_replay]
                    found.append((module.router_replay, self.columns[module.layer_number - 1]))
            self._routers[key] = found
        return self._routers[key]

    def check(self, record: TrainMicroBatch) -> None:
        """A record the routers can replay: routes present, ``layers * topk`` wide, valid ids."""
        routes = record.routed_experts
        if routes is None:
            raise field_error(VimeError, "use_rollout_routing_replay", True,
                              "needs every sample's rollout_routed_experts, and this batch "
                              "has none", "generate with an engine that returns routed "
                              "experts (the HF engine, CUDA vLLM), or drop "
                              "--use-rollout-routing-replay")
        if routes.shape[1] != self.width or (routes.size and routes.max() >= self.num_experts):
            raise field_error(VimeError, "rollout_routed_experts", f"<{routes.shape[1]} columns, "
                              f"max id {int(routes.max())}>", f"do not fit this model's "
                              f"{len(self.columns)} MoE layers x top-{self.topk} over "
                              f"{self.num_experts} experts", "record the routes with the "
                              "model being trained")

    def before_forward(self, chunk: torch.nn.Module, routes: torch.Tensor) -> None:
        """Give each router of ``chunk`` its columns of ``routes`` ([tokens, e], model order)."""
        if self.sequence_parallel:
            part = routes.shape[0] // self.tp_size
            routes = routes[self.tp_rank * part:(self.tp_rank + 1) * part]
        for replay, block in self._of(chunk):
            # int16 on the device until here: a layer's columns become the int64 gather index
            replay.set_target_indices(
                routes[:, block * self.topk:(block + 1) * self.topk].long())

    def clear(self) -> None:
        """Drop every pending route (after each schedule run: forward-only passes and layers
        without recompute never pop theirs)."""
        for routers in self._routers.values():
            for replay, _ in routers:
                replay.clear_indices()
