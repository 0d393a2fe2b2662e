"""Trainer memory (section ``memory``: activation recompute, optimizer and trainer offload) and
MoE (section ``moe``; unset: what the checkpoint's config.json says). Their rules live in
``ModelOptions`` (``vime_shell.megatron.model_options``), which ``TrainConfig.model_options``
builds from both records.

Example: ``MemoryArgs(overlap_cpu_optimizer_d2h_h2d=True)`` raises
``overlap_cpu_optimizer_d2h_h2d=True: needs --optimizer-cpu-offload ...``.
"""

import attrs

from vime_pure.errors import field_error
from vime_shell.megatron.model_options import (MOE_DISPATCHERS, MOE_LOAD_BALANCING,
                                               MOE_ROUTER_DTYPES, RECOMPUTE_GRANULARITIES,
                                               RECOMPUTE_METHODS, RECOMPUTE_MODULES)
from vime_shell.settings.common import ConfigError, Record, setting, setting_list


def _mem(default, help, choices=None):
    return setting(default, help, "memory", choices)


def _moe(default, help, choices=None):
    return setting(default, help, "moe", choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class MemoryArgs(Record):
    """Activation recompute and offload."""

    recompute_granularity: str | None = _mem(None, "activation recompute: full layers or "
                                             "selective modules", RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = _mem(None, "full recompute: uniform chunks or the first "
                                        "layers of each stage (block)", RECOMPUTE_METHODS)
    recompute_num_layers: int | None = _mem(None, "full recompute: layers per chunk (uniform) "
                                            "or per stage (block)")
    recompute_modules: tuple[str, ...] | None = setting_list(
        f"selective recompute: some of {', '.join(RECOMPUTE_MODULES)} (Megatron's default "
        "core_attn)", "memory")
    recompute_loss_function: bool = _mem(False, "recompute the loss's fp32 log-softmax in the "
                                         "backward instead of keeping it")
    optimizer_cpu_offload: bool = _mem(False, "Adam state and step on the CPU (CUDA only)")
    overlap_cpu_optimizer_d2h_h2d: bool = _mem(False, "overlap the offloaded optimizer's "
                                               "copies (with --optimizer-cpu-offload)")
    use_precision_aware_optimizer: bool = _mem(False, "TransformerEngine's FusedAdam (with TE; "
                                               "without it torch's Adam, fp32 state, as at "
                                               "Megatron's default state dtypes); turns on "
                                               "the distributed optimizer")
    offload_train: bool = _mem(False, "weights, gradients and optimizer state leave the "
                               "accelerator while the engines generate")

    def offload_options(self) -> dict[str, bool]:
        """The ``OptimConfig`` fields this record owns."""
        return {"optimizer_cpu_offload": self.optimizer_cpu_offload,
                "overlap_cpu_optimizer_d2h_h2d": self.overlap_cpu_optimizer_d2h_h2d,
                "use_precision_aware_optimizer": self.use_precision_aware_optimizer}

    def _check(self) -> None:
        if self.overlap_cpu_optimizer_d2h_h2d and not self.optimizer_cpu_offload:
            raise field_error(ConfigError, "overlap_cpu_optimizer_d2h_h2d", True,
                              "needs --optimizer-cpu-offload", "pass both, or drop it")


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class MoEArgs(Record):
    """The MoE router and dispatcher."""

    moe_router_topk: int | None = _moe(None, "experts per token; default the checkpoint's")
    moe_aux_loss_coeff: float | None = _moe(None, "load-balancing loss weight")
    moe_z_loss_coeff: float | None = _moe(None, "router z-loss weight")
    moe_router_load_balancing_type: str | None = _moe(None, "load-balancing loss; default none "
                                                      "(RL)", MOE_LOAD_BALANCING)
    moe_token_dispatcher_type: str | None = _moe(None, "token dispatcher; default alltoall "
                                                 "(flex: DeepEP, CUDA only; Megatron's default "
                                                 "allgather runs as alltoall)", MOE_DISPATCHERS)
    moe_router_dtype: str | None = _moe(None, "router precision", MOE_ROUTER_DTYPES)
    moe_grouped_gemm: bool | None = _moe(None, "grouped expert GEMM (CUDA only; default on "
                                         "with TransformerEngine)")
    moe_permute_fusion: bool | None = _moe(None, "fused token permutation (CUDA + TE only)")
    use_rollout_routing_replay: bool = _moe(False, "replay the experts the engine routed each "
                                            "token to in the trainer's routers (R3; the HF "
                                            "engine, or vLLM on CUDA)")
