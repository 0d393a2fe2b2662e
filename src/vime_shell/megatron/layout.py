"""The parallel layout the trainer runs, resolved from Megatron/slime sizes (torch-free).

``resolve_layout`` turns ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--context-parallel-size``, ``--num-layers-per-virtual-pipeline-stage`` and the world size into
a :class:`TrainLayout`, and rejects with :class:`UnsupportedLayoutError` what the machine or the
model cannot run, before torch or Megatron is imported (launch checks run in well under a
second).

Example: world size 4, ``tp=1, pp=2``, 4 layers, ``num_layers_per_virtual_stage=1`` gives
``dp=2, vpp=2, microbatch_group=2``; ``cp=2`` without TransformerEngine raises.
"""

import importlib.util
import os

import attrs

from vime_pure.config import ParallelLayout
from vime_pure.errors import VimeError


class UnsupportedLayoutError(VimeError):
    """A parallel layout this platform or model cannot run; the message says what to change."""


@attrs.frozen(kw_only=True)
class TrainLayout:
    """A resolved Megatron layout: ``world_size == dp * tp * pp * cp``; ``vpp`` model chunks per
    pipeline rank; ``microbatch_group`` is Megatron's ``microbatch_group_size_per_vp_stage``."""

    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int = 1
    microbatch_group: int | None = None

    def scheduler_layout(self) -> ParallelLayout:
        """The layout the rollout-side scheduler plans for."""
        return ParallelLayout(dp=self.dp, cp=self.cp, pp=self.pp, vpp=self.vpp,
                              microbatch_group=self.microbatch_group)


def _require_positive(name: str, value: object, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedLayoutError(f"{name}={value!r}: must be a positive integer. "
                                     f"Fix: pass {flag} 1 or more.")
    return value


def resolve_layout(
    *, world_size: int, num_layers: int, supports_context_parallel: bool, tp: int = 1,
    pp: int = 1, cp: int = 1, num_layers_per_virtual_stage: int | None = None,
) -> TrainLayout:
    """Check the requested sizes against the world size, the model and the platform."""
    tp = _require_positive("tensor_model_parallel_size", tp, "--tensor-model-parallel-size")
    pp = _require_positive("pipeline_model_parallel_size", pp, "--pipeline-model-parallel-size")
    cp = _require_positive("context_parallel_size", cp, "--context-parallel-size")
    if cp > 1 and not supports_context_parallel:
        raise UnsupportedLayoutError(
            f"context_parallel_size={cp}: context parallelism needs TransformerEngine attention, "
            "which this machine does not have (no CUDA, or transformer_engine is not "
            "installed). Fix: run with --context-parallel-size 1 here, or on a CUDA machine "
            "with transformer_engine.")
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise UnsupportedLayoutError(
            f"world_size={world_size}: not divisible by tp*pp*cp={tp}*{pp}*{cp}={model_parallel}. "
            "Fix: launch a multiple of tp*pp*cp processes or change the parallel sizes.")
    if num_layers % pp:
        raise UnsupportedLayoutError(
            f"pipeline_model_parallel_size={pp}: the model's {num_layers} layers do not split "
            "evenly over the pipeline stages. Fix: use a pp that divides the layer count.")
    vpp, group = 1, None
    if num_layers_per_virtual_stage is not None:
        per = _require_positive("num_layers_per_virtual_pipeline_stage",
                                num_layers_per_virtual_stage,
                                "--num-layers-per-virtual-pipeline-stage")
        if pp < 2 or (num_layers // pp) % per:
            raise UnsupportedLayoutError(
                f"num_layers_per_virtual_pipeline_stage={per}: needs pp >= 2 and to divide the "
                f"{num_layers // pp} layers of each pipeline stage (pp={pp}). Fix: drop the flag "
                "or pick a divisor of the per-stage layer count.")
        vpp = num_layers // pp // per
        group = pp if vpp > 1 else None
    return TrainLayout(world_size=world_size, dp=world_size // model_parallel, tp=tp, pp=pp,
                       cp=cp, vpp=vpp, microbatch_group=group)


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as torchrun sets it; 1 for a plain ``python`` run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    """``RANK`` (the global rank) as torchrun sets it; 0 for a plain ``python`` run."""
    return int(os.environ.get("RANK", "0"))


def local_rank_from_env() -> int:
    """``LOCAL_RANK`` (the rank within its node) as torchrun sets it; 0 when unset."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def ranks_per_node_from_env() -> int | None:
    """``LOCAL_WORLD_SIZE`` as torchrun sets it (the ranks of one node); None when unknown."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else None


def context_parallel_available() -> bool:
    """True with CUDA and TransformerEngine (Megatron's CP needs TE attention).

    Imports torch, so launch checks call it only when ``--context-parallel-size`` is above 1.
    """
    import torch  # heavy; needed only for this capability question

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
