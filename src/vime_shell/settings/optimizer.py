"""Adam and the LR schedule (section ``optimizer``), and the run's seed. The ranges live in
``OptimConfig`` (``vime_shell.megatron.config``); this record spells them as slime's flags.

Warmup and decay lengths are optimizer steps in the flags (as in slime) and groups in the
trainer: ``TrainConfig.optim_config`` multiplies them by the groups per step, which depend on
the rollout. Example: ``OptimizerArgs(lr=2)`` raises ``--lr=2: must be in (0, 1] ...``.
"""

from typing import Any

import attrs

from vime_pure.errors import field_error
from vime_shell.megatron.config import OptimConfig, OptimConfigError
from vime_shell.settings.common import ConfigError, Record, at_least, in_range, setting
from vime_shell.settings.data import check_seed

SECTION = "optimizer"
LR_DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine", "inverse-square-root")


def _f(default, help, choices=None):
    return setting(default, help, SECTION, choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class OptimizerArgs(Record):
    """The flags of ``OptimConfig`` (offload switches: the ``memory`` section)."""

    lr: float = _f(3e-4, "Adam learning rate")
    min_lr: float = _f(0.0, "learning rate floor of the decay")
    lr_warmup_iters: int = _f(0, "warmup length in optimizer steps")
    lr_warmup_fraction: float | None = _f(None, "warmup as a share of the run's optimizer "
                                          "steps (--num-rollout x steps per rollout)")
    lr_decay_iters: int | None = _f(None, "decay length in optimizer steps")
    lr_decay_style: str = _f("constant", "LR decay shape", LR_DECAY_STYLES)
    weight_decay: float = _f(0.0, "AdamW weight decay")
    clip_grad: float = _f(1.0, "gradient-norm clip, 0 for off")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.999, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    use_distributed_optimizer: bool = _f(False, "shard optimizer state over DP ranks; on "
                                         "without it when --overlap-param-gather or "
                                         "--use-precision-aware-optimizer needs it (slime "
                                         "always turns it on; a vime checkpoint records it)")
    overlap_grad_reduce: bool = _f(False, "overlap the DP gradient reduce with backward")
    overlap_param_gather: bool = _f(False, "overlap the distributed optimizer's gather with "
                                    "forward")
    seed: int = _f(0, "seeds prompts, sampling and initialisation")
    skip_nonfinite_grad_steps: bool = _f(False, "skip an optimizer step whose gradient norm "
                                         "is NaN/inf and count it (skipped_steps) instead of "
                                         "stopping the run (vime only; Megatron skips only "
                                         "fp16 loss-scale overflows)")

    def optim_config_for(self, *, warmup_groups: int, decay_groups: int | None,
                         **offload: Any) -> OptimConfig:
        """``OptimConfig`` with the schedule in groups and the ``memory`` section's offload
        switches; its error is re-raised naming the flag."""
        needed = self.distributed_optimizer_needed_by(
            offload.get("use_precision_aware_optimizer", False))
        try:
            return OptimConfig(
                lr=self.lr, min_lr=self.min_lr, weight_decay=self.weight_decay,
                adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2, adam_eps=self.adam_eps,
                clip_grad=self.clip_grad, lr_warmup_groups=warmup_groups,
                lr_decay_groups=decay_groups, lr_decay_style=self.lr_decay_style,
                use_distributed_optimizer=self.use_distributed_optimizer or needed is not None,
                overlap_grad_reduce=self.overlap_grad_reduce,
                overlap_param_gather=self.overlap_param_gather,
                skip_nonfinite_grad_steps=self.skip_nonfinite_grad_steps, **offload)
        except OptimConfigError as exc:
            field, _, rest = str(exc).partition("=")
            raise ConfigError(f"--{field.replace('_', '-')}={rest}") from None

    def distributed_optimizer_needed_by(self, precision_aware: bool) -> str | None:
        """The flag that turns the distributed optimizer on when ``--use-distributed-optimizer``
        is not given (Megatron needs it under both; slime turns it on always), or None."""
        if self.use_distributed_optimizer:
            return None
        if precision_aware:
            return "--use-precision-aware-optimizer"
        return "--overlap-param-gather" if self.overlap_param_gather else None

    def _check(self) -> None:
        check_seed("seed", self.seed)
        at_least("lr_warmup_iters", self.lr_warmup_iters, 0)
        at_least("lr_decay_iters", self.lr_decay_iters, 1)
        self.optim_config_for(warmup_groups=self.lr_warmup_iters,
                              decay_groups=self.lr_decay_iters)
        if self.lr_warmup_fraction is not None:
            in_range("lr_warmup_fraction", self.lr_warmup_fraction, 0.0, 1.0, "use e.g. 0.03")
            if self.lr_warmup_iters:
                raise field_error(ConfigError, "--lr-warmup-fraction", self.lr_warmup_fraction,
                                  "needs --num-rollout (not --num-epoch) and no "
                                  "--lr-warmup-iters", "pass one warmup length")
