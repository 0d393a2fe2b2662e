"""The platform the trainer runs on, chosen by capability.

Purpose: one place decides everything that differs between GPU and CPU, so the trainer code is
the same on both.

- CUDA: NCCL, TransformerEngine layer spec when TE is importable, THD packing
  (``PackedSeqParams``), bf16 parameters, context parallelism available.
- CPU: gloo, the local (torch) layer spec, fp32, every fusion off, packed rows as a
  block-diagonal causal mask with position ids restarting per sample, the
  :mod:`vime_shell.megatron.cuda_compat` layer installed, context parallelism unavailable
  (Megatron's local attention has no CP and no THD).

The layout itself is resolved, torch-free, in :mod:`vime_shell.megatron.layout`;
:func:`initialize_parallel` creates the process group and Megatron's parallel state for it.

Example: on a machine without CUDA, ``detect_platform()`` installs the CPU layer and returns
``Platform(kind="cpu", backend="gloo", dtype=torch.float32, transformer_engine=False,
packing="mask")``.
"""

import importlib.util
import os
from typing import Literal

import attrs
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from vime_shell.megatron import cuda_compat
from vime_shell.megatron.collectives import skip_single_rank_collectives
from vime_shell.megatron.layout import TrainLayout


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

    def local_spec(self) -> "Platform":
        """This machine as Megatron's local (torch) layer spec sees it: no TransformerEngine,
        so no fused kernels, no sequence or context parallelism, and packed rows with a block
        mask instead of THD (what a LoRA run builds, ``vime_shell.megatron.lora``)."""
        return attrs.evolve(self, transformer_engine=False, packing="mask")

    def transformer_overrides(self, sequence_parallel: bool = False) -> dict[str, object]:
        """TransformerConfig fields this platform forces (local spec: no fusions, no SP);
        ``sequence_parallel`` is what ``layout.sequence_parallel_on`` decided."""
        common: dict[str, object] = dict(
            hidden_dropout=0.0, attention_dropout=0.0, variable_seq_lengths=True,
            params_dtype=self.dtype, pipeline_dtype=self.dtype,
            bf16=self.dtype is torch.bfloat16, fp16=False,
        )
        if self.transformer_engine:
            return dict(common, sequence_parallel=sequence_parallel)
        # Megatron's local (torch) spec: no TE/Apex kernels, so no fusions and no SP with torch
        # norms; on CPU also CPU initialisation.
        return dict(
            common, sequence_parallel=False, bias_dropout_fusion=False,
            masked_softmax_fusion=False, gradient_accumulation_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
            use_cpu_initialization=self.kind == "cpu",
            # MoE on the local spec: SequentialMLP experts (grouped GEMM needs a CUDA kernel),
            # no shared-expert stream overlap, no TE permute / router fusions.
            moe_grouped_gemm=False, moe_shared_expert_overlap=False, moe_permute_fusion=False,
            moe_router_fusion=False,
        )


def detect_platform(install_compat: bool = True) -> Platform:
    """CUDA when available, else CPU, installing the CPU compatibility layer unless
    ``install_compat=False`` (launch checks that must not import Megatron yet)."""
    if torch.cuda.is_available():
        has_te = importlib.util.find_spec("transformer_engine") is not None
        return Platform(kind="cuda", backend="nccl", dtype=torch.bfloat16,
                        transformer_engine=has_te, packing="thd" if has_te else "mask")
    if install_compat:
        cuda_compat.install()
    return Platform(kind="cpu", backend="gloo", dtype=torch.float32,
                    transformer_engine=False, packing="mask")


def ensure_process_group(platform: Platform) -> None:
    """The world's process group (torchrun's, or a private one for a plain ``python`` run),
    each CUDA rank bound to its GPU first. Megatron's parallel state is not touched."""
    if platform.kind == "cuda":  # before NCCL initialises, so each rank binds its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            # A plain `python ...` run (no torchrun): a private single-process group.
            dist.init_process_group(backend=platform.backend, store=dist.HashStore(),
                                    rank=0, world_size=1)
        else:
            dist.init_process_group(backend=platform.backend)


def initialize_parallel(layout: TrainLayout, platform: Platform, seed: int = 1234) -> None:
    """Create the process group (if needed), Megatron's parallel state and its rng trackers."""

    ensure_process_group(platform)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    skip_single_rank_collectives()
