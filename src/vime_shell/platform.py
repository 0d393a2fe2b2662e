"""The platform the trainer runs on, chosen by capability, and the parallel layout it can run.

Purpose: one place decides everything that differs between GPU and CPU, so the trainer code is
the same on both.

- CUDA: NCCL, TransformerEngine layer spec when TE is importable, THD packing
  (``PackedSeqParams``), bf16 parameters, context parallelism available.
- CPU: gloo, the local (torch) layer spec, fp32, every fusion off, packed rows as a
  block-diagonal causal mask with position ids restarting per sample, the
  :mod:`vime_shell.cuda_compat` layer installed, context parallelism unavailable (Megatron's
  local attention has no CP and no THD).

``resolve_layout`` turns Megatron/slime-style sizes (TP, PP, CP, layers per virtual stage) and
the world size into a :class:`TrainLayout` and rejects, with :class:`UnsupportedLayoutError`,
what the platform or the model cannot run.

Example: world size 4, ``tp=1, pp=2``, 4 layers, ``num_layers_per_virtual_stage=1`` gives
``dp=2, vpp=2, microbatch_group=2``; ``cp=2`` on CPU raises ``UnsupportedLayoutError``.
"""

import importlib.util
import os
from typing import Literal

import attrs
import torch

from vime_pure.config import ParallelLayout
from vime_pure.errors import VimeError


class UnsupportedLayoutError(VimeError):
    """A parallel layout this platform or model cannot run; the message says what to change."""


@attrs.frozen(kw_only=True)
class Platform:
    """What this machine can do. Build it with :func:`detect_platform`, not by hand."""

    kind: Literal["cuda", "cpu"]
    backend: Literal["nccl", "gloo"]
    dtype: torch.dtype
    transformer_engine: bool
    packing: Literal["thd", "mask"]

    @property
    def supports_context_parallel(self) -> bool:
        return self.transformer_engine

    def transformer_overrides(self) -> dict[str, object]:
        """TransformerConfig fields this platform forces (local spec: no fusions, no SP)."""
        common: dict[str, object] = dict(
            hidden_dropout=0.0, attention_dropout=0.0, variable_seq_lengths=True,
            params_dtype=self.dtype, pipeline_dtype=self.dtype,
            bf16=self.dtype is torch.bfloat16, fp16=False,
        )
        if self.transformer_engine:
            return common
        # Megatron's local (torch) spec: no TE/Apex kernels, so no fusions and no SP with torch
        # norms; on CPU also CPU initialisation.
        return dict(
            common, sequence_parallel=False, bias_dropout_fusion=False,
            masked_softmax_fusion=False, gradient_accumulation_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
            use_cpu_initialization=self.kind == "cpu",
        )


def detect_platform(install_compat: bool = True) -> Platform:
    """CUDA when available, else CPU, installing the CPU compatibility layer unless
    ``install_compat=False`` (launch checks that must not import Megatron yet)."""
    if torch.cuda.is_available():
        has_te = importlib.util.find_spec("transformer_engine") is not None
        return Platform(kind="cuda", backend="nccl", dtype=torch.bfloat16,
                        transformer_engine=has_te, packing="thd" if has_te else "mask")
    if install_compat:
        from vime_shell import cuda_compat

        cuda_compat.install()
    return Platform(kind="cpu", backend="gloo", dtype=torch.float32,
                    transformer_engine=False, packing="mask")


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
    *, world_size: int, num_layers: int, platform: Platform, tp: int = 1, pp: int = 1,
    cp: int = 1, num_layers_per_virtual_stage: int | None = None,
) -> TrainLayout:
    """Check the requested sizes against the world size, the model and the platform."""
    tp = _require_positive("tensor_model_parallel_size", tp, "--tensor-model-parallel-size")
    pp = _require_positive("pipeline_model_parallel_size", pp, "--pipeline-model-parallel-size")
    cp = _require_positive("context_parallel_size", cp, "--context-parallel-size")
    if cp > 1 and not platform.supports_context_parallel:
        raise UnsupportedLayoutError(
            f"context_parallel_size={cp}: context parallelism needs TransformerEngine attention, "
            f"which this {platform.kind} platform does not have. Fix: run with "
            "--context-parallel-size 1 here, or on a CUDA machine with transformer_engine.")
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


def initialize_parallel(layout: TrainLayout, platform: Platform, seed: int = 1234) -> None:
    """Create the process group (if needed), Megatron's parallel state and its rng trackers."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if platform.kind == "cuda":  # before NCCL initialises, so each rank binds its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            # A plain `python ...` run (no torchrun): a private single-process group.
            dist.init_process_group(backend=platform.backend, store=dist.HashStore(),
                                    rank=0, world_size=1)
        else:
            dist.init_process_group(backend=platform.backend)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
