"""The trainer's own settings (optimizer, LR schedule, loss knobs) and its per-step result.

The data a trainer rank runs is not here: it is the core's ``RankBatch`` of
``TrainMicroBatch`` records (``vime_pure.rank_batch``).

Example: ``TrainerConfig(optim=OptimConfig(lr=1e-4, lr_warmup_groups=256),
loss=LossConfig(eps_clip=0.2))``.
"""

import attrs

from vime_pure.errors import VimeError, field_error
from vime_pure.policy_config import LossConfig
from vime_shell.megatron.model_options import ModelOptions


@attrs.frozen(kw_only=True)
class OptimConfig:
    """Adam and LR schedule. LR warmup/decay lengths count **groups** (the unit of
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

    def __attrs_post_init__(self) -> None:
        if not self.lr > 0:
            raise field_error(VimeError, "lr", self.lr, "must be positive", "use e.g. 1e-6")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise field_error(VimeError, "overlap_param_gather", True,
                              "needs the distributed optimizer",
                              "set use_distributed_optimizer=True or drop overlap_param_gather")


@attrs.frozen(kw_only=True)
class TrainerConfig:
    """Everything the trainer needs besides the model directory and the layout."""

    optim: OptimConfig = attrs.field(factory=OptimConfig)
    loss: LossConfig = attrs.field(factory=LossConfig)
    model: ModelOptions = attrs.field(factory=ModelOptions)  # recompute, MoE router
    recompute_loss_function: bool = False  # --recompute-loss-function (objective.py)
    seed: int = 1234


@attrs.frozen(kw_only=True)
class StepResult:
    """Reduced metrics of one step (identical on every rank) and what this rank ran."""

    metrics: dict[str, float]
    num_groups: int
    num_microbatches: int
    lr: float
    grad_norm: float
    skipped: bool = False  # the gradient norm was not finite and the update was skipped

