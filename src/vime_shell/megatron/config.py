"""The trainer's own settings (optimizer, LR schedule, loss knobs) and its per-step result.

The data a trainer rank runs is not here: it is the core's ``RankBatch`` of
``TrainMicroBatch`` records (``vime_pure.rank_batch``).

Example: ``TrainerConfig(optim=OptimConfig(lr=1e-4, lr_warmup_groups=256),
loss=LossConfig(eps_clip=0.2))``.
"""

import math

import attrs

from vime_pure.config import OPTIMIZERS
from vime_pure.errors import VimeError, field_error
from vime_pure.policy_config import LossConfig
from vime_shell.megatron.lora_options import LoraOptions
from vime_shell.megatron.model_options import ModelOptions


MUON_TP_MODES: tuple[str, ...] = ("duplicated", "blockwise")  # Megatron's distributed: not built
MUON_SCALE_MODES: tuple[str, ...] = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_MATMUL_PRECISIONS: tuple[str, ...] = ("medium", "high")  # medium: bf16 Newton-Schulz


@attrs.frozen(kw_only=True)
class MuonSettings:
    """Megatron-LM's ``--muon-*`` flags, as ``vime_shell.megatron.muon`` applies them."""

    momentum: float = 0.9
    split_qkv: bool = True
    nesterov: bool = False
    scale_mode: str = "spectral"
    fp32_matmul_prec: str = "medium"
    num_ns_steps: int = 5
    tp_mode: str = "duplicated"
    extra_scale_factor: float = 1.0

    def check(self) -> None:
        """Each knob in range (``OptimConfig`` runs it for ``optimizer="muon"``)."""
        _check_range("muon_momentum", self.momentum, 0.0, 1.0, "use e.g. 0.9 or 0.95",
                     hi_open=True)
        _check_range("muon_num_ns_steps", self.num_ns_steps, 1, 100, "use 5")
        _check_range("muon_extra_scale_factor", self.extra_scale_factor, 0.0, 1e6,
                     "use 1.0 (0.2 matches AdamW's update RMS)", lo_open=True)
        for name, value, choices in (("muon_tp_mode", self.tp_mode, MUON_TP_MODES),
                                     ("muon_scale_mode", self.scale_mode, MUON_SCALE_MODES),
                                     ("muon_fp32_matmul_prec", self.fp32_matmul_prec,
                                      MUON_MATMUL_PRECISIONS)):
            if value not in choices:
                raise field_error(OptimConfigError, name, value,
                                  f"is not one of {', '.join(choices)}", f"use {choices[0]}")


@attrs.frozen(kw_only=True)
class OptimConfig:
    """Adam (or Muon, ``optimizer="muon"``) and LR schedule. LR warmup/decay lengths count **groups** (the unit of
    ``increment=G_s``), e.g. ``lr_decay_groups=640`` decays over 20 steps of 32 groups."""

    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_groups: int = 0
    lr_decay_groups: int | None = None
    lr_decay_style: str = "constant"
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    optimizer_cpu_offload: bool = False  # Megatron's HybridDeviceOptimizer (CUDA only)
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_precision_aware_optimizer: bool = False  # TE FusedAdam (CUDA + TE only)
    skip_nonfinite_grad_steps: bool = False  # else a NaN/inf gradient norm stops the run
    optimizer: str = "adam"  # "muon": Muon on the hidden 2-D weights, Adam(W) on the rest
    muon: MuonSettings = attrs.field(factory=MuonSettings)

    def __attrs_post_init__(self) -> None:
        """The one check of each optimizer knob (``TrainConfig`` builds this record to run it)."""
        _check_range("lr", self.lr, 0.0, 1.0, "use e.g. 3e-4 (the 334k-param embedded model), "
                "1e-6 (7B)", lo_open=True)
        _check_range("min_lr", self.min_lr, 0.0, self.lr, f"use a value in [0, lr={self.lr}]")
        for name in ("weight_decay", "clip_grad"):
            _check_range(name, getattr(self, name), 0.0, 1e6, "use 0 to turn it off")
        for name in ("adam_beta1", "adam_beta2"):
            _check_range(name, getattr(self, name), 0.0, 1.0, "use e.g. 0.9 / 0.999", hi_open=True)
        _check_range("adam_eps", self.adam_eps, 1e-30, 1.0, "use 1e-8")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise field_error(OptimConfigError, "overlap_param_gather", True,
                              "needs the distributed optimizer",
                              "pass --use-distributed-optimizer")
        if self.optimizer not in OPTIMIZERS:
            raise field_error(OptimConfigError, "optimizer", self.optimizer,
                              f"is not one of {', '.join(OPTIMIZERS)}", "use adam or muon")
        if self.optimizer == "muon":
            self._check_muon()

    def _check_muon(self) -> None:
        """Muon's knobs, and the optimizer switches it does not run with (megatron-core
        0.16.1 refuses the distributed optimizer with Muon too; offload is Adam's)."""
        self.muon.check()
        if self.use_distributed_optimizer:
            raise field_error(OptimConfigError, "optimizer", "muon",
                              "runs without the distributed optimizer (Muon orthogonalises "
                              "whole matrices; the distributed optimizer shards them over DP)",
                              "drop --use-distributed-optimizer and what turns it on "
                              "(--overlap-param-gather, --use-precision-aware-optimizer, "
                              "--train-backend fsdp), or use --optimizer adam")
        if self.optimizer_cpu_offload:
            raise field_error(OptimConfigError, "optimizer", "muon",
                              "has no CPU-offloaded form (--optimizer-cpu-offload is "
                              "Megatron's hybrid Adam)",
                              "drop --optimizer-cpu-offload, or use --optimizer adam")


class OptimConfigError(VimeError):
    """An optimizer or LR-schedule setting out of range."""


def _check_range(name: str, value: float, lo: float, hi: float, fix: str, *,
            lo_open: bool = False, hi_open: bool = False) -> None:
    """``value`` in ``[lo, hi]``, each end open on request; NaN and inf fail."""
    inside = ((lo < value if lo_open else lo <= value)
              and (value < hi if hi_open else value <= hi))
    if not (math.isfinite(value) and inside):
        band = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise field_error(OptimConfigError, name, value, f"must be in {band}", fix)


@attrs.frozen(kw_only=True)
class TrainerConfig:
    """Everything the trainer needs besides the model directory and the layout."""

    optim: OptimConfig = attrs.field(factory=OptimConfig)
    loss: LossConfig = attrs.field(factory=LossConfig)
    model: ModelOptions = attrs.field(factory=ModelOptions)  # recompute, MoE router
    lora: LoraOptions | None = None  # --lora-rank > 0: frozen base, trained adapters
    recompute_loss_function: bool = False  # --recompute-loss-function (objective.py)
    sequence_parallel: bool = False  # --sequence-parallel, as requested (the trainer decides)
    seed: int = 1234


@attrs.frozen(kw_only=True)
class StepResult:
    """Reduced metrics of one step (identical on every rank) and what this rank ran."""

    metrics: dict[str, float | None]  # None: a mean over no token (reduce_train_step)
    num_groups: int
    num_microbatches: int
    lr: float
    grad_norm: float
    skipped: bool = False  # the gradient norm was not finite and the update was skipped

