"""The parallel layout the trainer runs, resolved from Megatron/slime sizes (torch-free).

``resolve_layout`` turns ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--context-parallel-size``, ``--num-layers-per-virtual-pipeline-stage`` or
``--num-virtual-stages-per-pipeline-rank``, ``--expert-model-parallel-size``,
``--expert-tensor-parallel-size``, ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers`` and the world size into
a :class:`TrainLayout`, and rejects with :class:`UnsupportedLayoutError` what the machine or the
model cannot run, before torch or Megatron is imported (launch checks run in well under a
second).

Virtual stages with uneven first/last stages follow Megatron-LM: the count is given per
pipeline rank (``--num-virtual-stages-per-pipeline-rank``; layers per virtual stage would differ
between stages) and must divide every stage's layer count (Megatron's
``num_layers_in_first_pipeline_stage % virtual_pipeline_model_parallel_size``).

Example: world size 4, ``tp=1, pp=2``, 4 layers, ``num_layers_per_virtual_stage=1`` gives
``dp=2, vpp=2, microbatch_group=2``; ``cp=2`` without TransformerEngine raises. 6 layers at
``pp=2`` with ``first_stage_layers=4`` and ``num_virtual_stages=2`` gives chunks of 2 layers on
stage 0 and of 1 layer on stage 1.
"""

import importlib.util
import os

import attrs

from vime_pure.config import ParallelLayout
from vime_pure.errors import VimeError


PP = "--pipeline-model-parallel-size"  # named in several messages


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
    ep: int = 1  # expert-parallel size: experts split over ep ranks of the dp*cp*tp ranks
    etp: int = 1  # expert tensor-parallel size (Megatron's default: tp)
    first_stage_layers: int | None = None  # uneven pipelines (None: layers split evenly)
    last_stage_layers: int | None = None

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers of each pipeline stage. Example: 7 layers, pp=3, first 1, last 2
        gives ``(1, 4, 2)``."""
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_stages = self.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        per = rest // middle_stages if middle_stages else 0
        stages = [per] * self.pp
        if first is not None:
            stages[0] = first
        if last is not None:
            stages[-1] = last
        return tuple(stages)

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
    pp: int = 1, cp: int = 1, num_layers_per_virtual_stage: int | None = None, ep: int = 1,
    etp: int | None = None, num_experts: int | None = None,
    first_stage_layers: int | None = None, last_stage_layers: int | None = None,
    num_virtual_stages: int | None = None,
) -> TrainLayout:
    """Check the requested sizes against the world size, the model and the platform.

    ``num_experts`` is the model's routed expert count (None: a dense model)."""
    tp = _require_positive("tensor_model_parallel_size", tp, "--tensor-model-parallel-size")
    pp = _require_positive("pipeline_model_parallel_size", pp, "--pipeline-model-parallel-size")
    cp = _require_positive("context_parallel_size", cp, "--context-parallel-size")
    ep = _require_positive("expert_model_parallel_size", ep, "--expert-model-parallel-size")
    etp = tp if etp is None else _require_positive(
        "expert_tensor_parallel_size", etp, "--expert-tensor-parallel-size")
    if cp > 1 and not supports_context_parallel:
        raise UnsupportedLayoutError(
            f"context_parallel_size={cp}: context parallelism needs TransformerEngine attention, "
            "which this machine does not have (no CUDA, or transformer_engine is not "
            "installed). Fix: run with --context-parallel-size 1 here, or on a CUDA machine "
            "with transformer_engine.")
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise UnsupportedLayoutError(
            f"the {world_size} launched ranks are not divisible by --tensor-model-parallel-size "
            f"x --pipeline-model-parallel-size x --context-parallel-size = {tp} x {pp} x {cp} = "
            f"{model_parallel}. Fix: launch a multiple of {model_parallel} processes, or change "
            "those sizes.")
    _check_experts(world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, num_experts=num_experts)
    if num_experts is None:  # a dense model: --expert-tensor-parallel-size 1 is a no-op
        etp = tp
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if uneven:
        _check_uneven(num_layers, pp, first_stage_layers, last_stage_layers,
                      num_layers_per_virtual_stage)
    elif num_layers % pp:
        raise UnsupportedLayoutError(
            f"pipeline_model_parallel_size={pp}: the model's {num_layers} layers do not split "
            "evenly over the pipeline stages. Fix: use a --pipeline-model-parallel-size that "
            "divides the layer count, or "
            "set --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers.")
    vpp, group = 1, None
    if num_virtual_stages is not None:
        vpp = _virtual_stages(num_virtual_stages, num_layers, pp, first_stage_layers,
                              last_stage_layers, num_layers_per_virtual_stage)
        group = pp if vpp > 1 else None
    elif num_layers_per_virtual_stage is not None:
        per = _require_positive("num_layers_per_virtual_pipeline_stage",
                                num_layers_per_virtual_stage,
                                "--num-layers-per-virtual-pipeline-stage")
        if pp < 2 or (num_layers // pp) % per:
            raise UnsupportedLayoutError(
                f"num_layers_per_virtual_pipeline_stage={per}: needs {PP} >= 2 and to divide "
                f"the {num_layers // pp} layers of each pipeline stage ({PP} {pp}). Fix: drop "
                "the flag "
                "or pick a divisor of the per-stage layer count.")
        vpp = num_layers // pp // per
        group = pp if vpp > 1 else None
    return TrainLayout(world_size=world_size, dp=world_size // model_parallel, tp=tp, pp=pp,
                       cp=cp, vpp=vpp, microbatch_group=group, ep=ep, etp=etp,
                       first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)


def _check_experts(world_size: int, *, tp: int, pp: int, cp: int, ep: int, etp: int,
                   num_experts: int | None) -> None:
    """Megatron's expert grid: ``etp * ep * pp`` divides the world, ``ep`` divides the experts.
    A dense model takes the no-op values only: EP 1, ETP 1 or the TP size."""
    if (ep > 1 or etp not in (1, tp)) and num_experts is None:
        flag = "--expert-model-parallel-size" if ep > 1 else "--expert-tensor-parallel-size"
        raise UnsupportedLayoutError(
            f"{flag}={ep if ep > 1 else etp}: the model has no experts (a dense model). "
            f"Fix: drop {flag}.")
    if num_experts is not None and num_experts % ep:
        raise UnsupportedLayoutError(
            f"expert_model_parallel_size={ep}: does not divide the model's {num_experts} "
            "experts. Fix: use an --expert-model-parallel-size that divides the expert count.")
    if world_size % (etp * ep * pp):
        raise UnsupportedLayoutError(
            f"expert_model_parallel_size={ep}: the {world_size} launched ranks are not "
            f"divisible by --expert-tensor-parallel-size x --expert-model-parallel-size x {PP} "
            f"= {etp} x {ep} x {pp}. Fix: pick --expert-model-parallel-size and "
            f"--expert-tensor-parallel-size whose product with {PP} divides the rank count.")


def _check_uneven(num_layers: int, pp: int, first: int | None, last: int | None,
                  per_virtual: int | None) -> None:
    """Uneven stages (Megatron's ``num_layers_in_first/last_pipeline_stage``): the stages
    between get the remaining layers evenly, and none is empty."""
    for flag, value in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        if value is not None:
            _require_positive(flag.lstrip("-").replace("-", "_"), value, flag)
    set_count = (first is not None) + (last is not None)
    if pp < 2 or pp < set_count:
        raise UnsupportedLayoutError(
            f"pipeline_model_parallel_size={pp}: uneven stages need 2 stages or more (one per "
            "set flag). Fix: raise --pipeline-model-parallel-size or drop "
            "--decoder-first/last-pipeline-num-layers.")
    if per_virtual is not None:
        raise UnsupportedLayoutError(
            "num_layers_per_virtual_pipeline_stage: with uneven first/last stages the layers "
            "per virtual stage differ between stages (Megatron-LM refuses it too). Fix: give "
            "the virtual stages per pipeline rank, --num-virtual-stages-per-pipeline-rank.")
    rest, middle = num_layers - (first or 0) - (last or 0), pp - set_count
    if rest < 0 or (middle and (rest < middle or rest % middle)) or (not middle and rest):
        raise UnsupportedLayoutError(
            f"decoder_first_pipeline_num_layers={first}, decoder_last_pipeline_num_layers="
            f"{last}: the other {middle} stage(s) cannot split the remaining {rest} of "
            f"{num_layers} layers evenly. Fix: choose first/last so that the rest divides "
            f"by {middle or 'zero stages: first + last must equal the layer count'}.")


def _virtual_stages(count: object, num_layers: int, pp: int, first: int | None,
                    last: int | None, per_virtual: int | None) -> int:
    """``--num-virtual-stages-per-pipeline-rank``: the model chunks of every pipeline rank."""
    count = _require_positive("num_virtual_stages_per_pipeline_rank", count,
                              "--num-virtual-stages-per-pipeline-rank")
    if per_virtual is not None:
        raise UnsupportedLayoutError(
            "num_virtual_stages_per_pipeline_rank: set together with "
            "--num-layers-per-virtual-pipeline-stage. Fix: pass one of the two.")
    stages = TrainLayout(world_size=pp, dp=1, pp=pp, first_stage_layers=first,
                         last_stage_layers=last).stage_layers(num_layers)
    if pp < 2 or any(n % count for n in stages):
        raise UnsupportedLayoutError(
            f"num_virtual_stages_per_pipeline_rank={count}: needs {PP} >= 2 and to divide every "
            f"pipeline stage's layer count (here {list(stages)}). Fix: pick a common divisor, "
            "or change --decoder-first/last-pipeline-num-layers.")
    return count


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


def cuda_available() -> bool:
    """True when torch sees a CUDA device. Imports torch, so launch checks call it only when a
    setting needs the answer (``--context-parallel-size`` above 1, a CUDA-only flag)."""
    import torch  # heavy; needed only for this capability question

    return torch.cuda.is_available()


def transformer_engine_available() -> bool:
    """True when ``transformer_engine`` is importable (found without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def sequence_parallel_on(requested: bool, *, tp: int, cp: int, transformer_engine: bool) -> bool:
    """Whether ``--sequence-parallel`` turns Megatron's sequence parallelism on: only with
    TP > 1 (Megatron turns it off at TP 1), TransformerEngine (the local spec's torch norms
    cannot run sequence-parallel) and CP 1 (the row padding it needs is not wired into the CP
    chunks yet). Example: ``sequence_parallel_on(True, tp=2, cp=1, transformer_engine=False)``
    is False."""
    return bool(requested) and tp > 1 and cp == 1 and transformer_engine


def check_mla_tensor_parallel(tp: int, *, mla: bool, sequence_parallel: bool) -> None:
    """Multi-latent attention under TP needs Megatron's sequence parallelism: megatron-core 0.16
    sums the RoPE key's gradient over the TP ranks only there (its sequence gather's backward);
    without it each rank keeps its own heads' share. Measured on a tiny DeepSeek-V3 at TP2 on
    the local spec: logits exact, weights 6.7e-4 off DP2 after 4 Adam steps."""
    if mla and tp > 1 and not sequence_parallel:
        raise UnsupportedLayoutError(
            f"tensor_model_parallel_size={tp}: multi-latent attention under TP without "
            "sequence parallelism trains on a partial RoPE-key gradient (megatron-core 0.16 "
            "sums it over TP only through sequence parallelism, which needs "
            "TransformerEngine). Fix: pass --sequence-parallel on a TransformerEngine GPU, "
            "or split the model with --expert-model-parallel-size / "
            "--pipeline-model-parallel-size instead")


def context_parallel_available() -> bool:
    """True with CUDA and TransformerEngine (Megatron's CP needs TE attention)."""
    return cuda_available() and transformer_engine_available()
