"""Adam or Muon and the LR schedule (section ``optimizer``), and the run's seed. The ranges live in
``OptimConfig`` (``vime_shell.megatron.config``); this record spells them as slime's flags.

Warmup and decay lengths are optimizer steps in the flags (as in slime) and groups in the
trainer: ``TrainConfig.optim_config`` multiplies them by the groups per step, which depend on
the rollout. Example: ``OptimizerArgs(lr=2)`` raises ``--lr=2: must be in (0, 1] ...``.
"""

from typing import Any

import attrs

from vime_pure.config import OPTIMIZERS
from vime_pure.errors import field_error
from vime_shell.megatron.config import (MUON_MATMUL_PRECISIONS, MUON_SCALE_MODES,
                                        MUON_TP_MODES, MuonSettings, OptimConfig,
                                        OptimConfigError)
from vime_shell.settings.common import ConfigError, Record, at_least, in_range, setting
from vime_shell.settings.data import check_seed

SECTION = "optimizer"
LR_DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine", "inverse-square-root")


def _f(default, help, choices=None):
    return setting(default, help, SECTION, choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class OptimizerArgs(Record):
    """The flags of ``OptimConfig`` (offload switches: the ``memory`` section)."""

    optimizer: str = _f("adam", "adam: Adam(W) for every weight; muon: Megatron-LM's Muon for "
                        "the hidden 2-D weights and Adam(W) for the embedding, output layer, "
                        "norms and biases (vime's own build of Megatron's rule, on CPU too; "
                        "not with the distributed optimizer, as in megatron-core 0.16)",
                        OPTIMIZERS)
    lr: float = _f(3e-4, "learning rate (Adam's, and Muon's step on the scaled "
                   "orthogonalised update)")
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
    muon_momentum: float = _f(0.9, "Muon's momentum: M = m M + (1 - m) G (Megatron-LM's flag "
                              "default; its OptimizerConfig's is 0.95)")
    muon_no_split_qkv: bool = _f(False, "orthogonalise the fused QKV weight whole, instead of "
                                 "its Q, K and V rows (over all head groups) each on its own")
    muon_use_nesterov: bool = _f(False, "Muon's Nesterov momentum: G + m (M - G) is "
                                 "orthogonalised instead of M (--muon-nesterov: Megatron-LM "
                                 "main's spelling)")
    muon_scale_mode: str = _f("spectral", "Muon's update scale by the matrix shape: "
                              "spectral sqrt(max(rows, cols)), unit_rms_norm "
                              "sqrt(rows / cols), shape_scaling sqrt(max(1, rows / cols))",
                              MUON_SCALE_MODES)
    muon_fp32_matmul_prec: str = _f("medium", "Newton-Schulz precision: medium iterates in "
                                    "bf16 (as Megatron does), high in fp32 (TF32 on CUDA); "
                                    "Megatron's low is refused (torch has no such setting)",
                                    MUON_MATMUL_PRECISIONS)
    muon_num_ns_steps: int = _f(5, "Newton-Schulz iterations (Megatron's quintic "
                                "coefficients, cycled)")
    muon_tp_mode: str = _f("duplicated", "a TP-split matrix: duplicated gathers it and "
                           "orthogonalises it whole (the update does not depend on TP); "
                           "blockwise orthogonalises each shard alone. vime's default is "
                           "Megatron-LM main's (megatron-core 0.16's was blockwise); "
                           "distributed is refused (duplicated computes its update)",
                           MUON_TP_MODES)
    muon_extra_scale_factor: float = _f(1.0, "a factor on every Muon update (0.2 with "
                                        "spectral matches AdamW's update RMS)")
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
                skip_nonfinite_grad_steps=self.skip_nonfinite_grad_steps,
                optimizer=self.optimizer, muon=self.muon_settings(), **offload)
        except OptimConfigError as exc:
            field, _, rest = str(exc).partition("=")
            raise ConfigError(f"--{field.replace('_', '-')}={rest}") from None

    def muon_settings(self) -> MuonSettings:
        """The ``--muon-*`` flags as the trainer's ``MuonSettings``."""
        return MuonSettings(
            momentum=self.muon_momentum, split_qkv=not self.muon_no_split_qkv,
            nesterov=self.muon_use_nesterov, scale_mode=self.muon_scale_mode,
            fp32_matmul_prec=self.muon_fp32_matmul_prec, num_ns_steps=self.muon_num_ns_steps,
            tp_mode=self.muon_tp_mode, extra_scale_factor=self.muon_extra_scale_factor)

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
