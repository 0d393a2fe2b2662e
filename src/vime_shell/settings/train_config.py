"""``TrainConfig``: every setting of ``vime train``, validated at launch, with slime flag names,
composed of one small keyword-only record per component.

The records (``vime_shell.settings``; section in brackets, as in ``--help`` and config
files):

* ``EngineArgs`` [model], ``DataArgs`` [data], ``RolloutArgs``, ``AsyncArgs`` and
  ``HealthArgs`` [rollout],
  ``RewardArgs`` [reward], ``EvalArgs`` [eval];
* ``BatchingArgs`` [batching] (the core's ``BatchingPolicy``), ``LossArgs`` [loss] (the core's
  ``LossConfig`` / ``RejectionConfig``), ``OptimizerArgs`` [optimizer] (``OptimConfig``),
  ``ParallelArgs`` [parallelism], ``MemoryArgs`` [memory] and ``MoEArgs`` [moe]
  (``ModelOptions``), ``LoraArgs`` [lora] (``LoraOptions``), ``CheckpointArgs`` [checkpoint],
  ``LoggingArgs`` [logging];
* Megatron's and slime's pass-through flags: ``ModelArchArgs`` and ``MoEArchArgs``
  [architecture],
  ``MegatronSwitchArgs`` [megatron, slime], ``PlacementArgs`` [placement]
  (``vime_shell.settings.megatron_args``).

**Where a new knob goes:** one field in the record of the component that uses it (its default,
``--help`` line and section come from the field), plus its rule in that record's ``_check``
when the rule reads only that record's fields; a rule that reads two records' fields goes in
``TrainConfig._check_across`` below, the one place for those. The flag (``--dash-name``), the
config-file key (flat, or under its section) and the type and choice checks follow from the
field (``vime_shell.settings.flags``). ``cfg.<name>`` reads any setting, whichever record owns
it; ``cfg.record(EvalArgs)`` is one component's record on its own.

Sources, later wins: the defaults (the embedded CPU demo), a ``--config`` file (YAML, JSON or
TOML; keys spelled ``global_batch_size`` or ``global-batch-size``, flat or by section), then
command-line flags (``--global-batch-size 64``; bools as ``--balance-data`` /
``--no-balance-data``; optional values accept ``none``).

Invariants the tests assert: a ``TrainConfig`` that exists is valid (types, ranges, names,
and that a rollout's groups fill whole optimizer steps unless ``allow_partial_train_step``);
every bad value raises :class:`ConfigError` naming the field, the value and the fix, checked
once, by the record that owns it; an unknown key or flag is an error with the closest valid
name, never ignored; ``to_dict`` round-trips.

Defaults are the measured demo (reverse2 from scratch on 2 CPU cores, the embedded 334k-param
Qwen2): 16 prompts x 8 samples, temperature 1, answers capped at the task's length, lr 3e-4,
one optimizer step per rollout (``global_batch_size`` = 128 groups). With the HF engine, the
built-in single-turn rollout and a plain-torch GRPO step standing in for the trainer, the mean
reward went from 0.00 to >= 0.8 (10-rollout average) after 133-152 rollouts (6 runs).
"""

import difflib
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from vime_pure.config import BatchingPolicy
from vime_pure.errors import VimeError, field_error
from vime_pure.lr_schedule import LrGroups, lr_groups, steps_per_rollout
from vime_pure.policy_config import LossConfig
from vime_shell.megatron.config import OptimConfig
from vime_shell.megatron.model_options import ModelOptions
from vime_shell.rollout.functions import SFT_ROLLOUT_FUNCTION
from vime_shell.rollout.tasks import get_task
from vime_shell.settings.asynchrony import AsyncArgs
from vime_shell.settings.batching import DEFAULT_GLOBAL_BATCH_SIZE, BatchingArgs
from vime_shell.settings.checkpoint import CheckpointArgs
from vime_shell.settings.common import ConfigError, check_record_fields, element_type, field_type
from vime_shell.settings.data import DataArgs
from vime_shell.settings.engine import EngineArgs
from vime_shell.settings.evaluation import EvalArgs
from vime_shell.settings.health import HealthArgs
from vime_shell.settings.lora import LoraArgs
from vime_shell.settings.loss import LossArgs
from vime_shell.settings.megatron_args import (MegatronSwitchArgs, ModelArchArgs, ModelArgsError,
                                               PlacementArgs)
from vime_shell.settings.memory import MemoryArgs, MoEArgs
from vime_shell.settings.moe_architecture import MoEArchArgs
from vime_shell.settings.optimizer import OptimizerArgs
from vime_shell.settings.parallelism import ParallelArgs
from vime_shell.settings.reward import ESTIMATOR_SURROGATE, RewardArgs
from vime_shell.settings.rollout import RolloutArgs
from vime_shell.settings.run_logging import LoggingArgs

__all__ = ["ConfigError", "TrainConfig", "SECTIONS", "RECORDS", "field_type"]

DEFAULT_NUM_ROLLOUT = 300
SECTIONS: tuple[str, ...] = ("model", "data", "rollout", "reward", "eval", "batching", "loss",
                             "optimizer", "parallelism", "memory", "moe", "lora", "checkpoint",
                             "logging",
                             "architecture", "megatron", "slime", "placement")
# The component records, each checked by its own ``_check`` (the Megatron ones: below).
RECORDS: tuple[Any, ...] = (EngineArgs, DataArgs, RolloutArgs, AsyncArgs, HealthArgs,  # classes
                            RewardArgs, EvalArgs, BatchingArgs, LossArgs, OptimizerArgs,
                            ParallelArgs, MemoryArgs, MoEArgs, LoraArgs, CheckpointArgs,
                            LoggingArgs, MoEArchArgs)
R = TypeVar("R", bound=attrs.AttrsInstance)

# _element_type: the name settings.flags and older callers import
_element_type = element_type


@attrs.frozen(kw_only=True)
class TrainConfig(EngineArgs, DataArgs, RolloutArgs, AsyncArgs, HealthArgs, RewardArgs, EvalArgs,
                  BatchingArgs, LossArgs, OptimizerArgs, ParallelArgs, MemoryArgs, MoEArgs,
                  LoraArgs, CheckpointArgs, LoggingArgs, ModelArchArgs, MoEArchArgs,
                  MegatronSwitchArgs, PlacementArgs):
    """All ``vime train`` settings, named as slime's flags. Example:
    ``TrainConfig(prompt_data="train.jsonl", apply_chat_template=True, rm_type="math")``.
    The fields live in the component records (module docstring); this class adds only the
    rules and values that span records."""

    def __attrs_post_init__(self) -> None:
        check_record_fields(self)  # types and choice lists, every field once
        for record in RECORDS:
            record._check(self)
        try:
            self.check_switches()
        except ModelArgsError as exc:
            raise ConfigError(str(exc)) from None
        self._check_across()

    @property
    def teacher_at_rm_url(self) -> bool:
        """slime's form of ``--opd-type sglang``: no ``--opd-teacher-urls``, so ``--rm-url``
        is the teacher's."""
        return self.opd_server and not self.opd_teacher_urls

    @property
    def reward_url(self) -> str | None:
        """``--rm-url`` as the reward server's; None where it is the teacher's."""
        return None if self.teacher_at_rm_url else self.rm_url

    def _check_across(self) -> None:
        """The rules that read two records' fields (the one place for them)."""
        sft = not self.generates
        if self.prompt_data is not None and self.rollout_max_response_len is None and not sft:
            raise field_error(ConfigError, "rollout_max_response_len", None,
                              "has no default with --prompt-data (the built-in tasks set it)",
                              "pass --rollout-max-response-len, e.g. 1024")
        replay = self.load_rollout_data is not None and \
            self.load_rollout_data_mode == "train-only"
        if self.debug_train_only and not (replay or sft):  # slime's SFT scripts pass it
            raise field_error(ConfigError, "--debug-train-only", True,
                              "trains without an engine: on dumped rollouts, or on "
                              f"conversations ({SFT_ROLLOUT_FUNCTION})",
                              "pass --load-debug-rollout-data PATH (train-only mode), or "
                              f"--rollout-function-path {SFT_ROLLOUT_FUNCTION}")
        if self.custom_reward_post_process_path is not None and not self.opd_server:
            raise field_error(ConfigError, "--custom-reward-post-process-path",
                              self.custom_reward_post_process_path,
                              "is on-policy distillation's from a teacher server",
                              "add --use-opd --opd-type sglang, or drop it")
        if self.teacher_at_rm_url and self.rm_url is None:
            raise field_error(ConfigError, "--rm-url", None, "is required with --opd-type "
                              "sglang (the teacher server)",
                              "pass --rm-url http://host:port/generate, or --opd-teacher-urls")
        if self.teacher_at_rm_url and self.rm_type == "remote_rm":
            raise field_error(ConfigError, "--rm-type", "remote_rm",
                              "has no reward server: --rm-url is the teacher's (--opd-type "
                              "sglang)", "name the teachers with --opd-teacher-urls, and "
                              "keep --rm-url for the reward server")
        if sft and self.loss_type != "sft_loss":
            raise field_error(ConfigError, "--loss-type", self.loss_type,
                              f"trains the policy gradient, and {SFT_ROLLOUT_FUNCTION} gives "
                              "conversations with reward 0 (no advantage to follow)",
                              "pass --loss-type sft_loss")
        if self.rollout_function_path.endswith("compact_rollout") and self.group_rm:
            raise field_error(ConfigError, "group_rm", True,
                              "does not apply to compact_rollout (its reward is per turn)",
                              "use a per-sample --custom-rm-path")
        if self.partial_rollout and not self.fully_async and (
                self.over_sampling_batch_size or 0) <= self.rollout_batch_size:
            raise field_error(ConfigError, "partial_rollout", True,
                              "cuts nothing unless more groups are in flight than a rollout "
                              f"trains (--rollout-batch-size {self.rollout_batch_size})",
                              "pass --over-sampling-batch-size, e.g. "
                              f"{self.rollout_batch_size * 3 // 2} (with --fully-async the "
                              "pool cuts at every weight sync and needs none)")
        if self.enable_mtp_training and not self.mtp_num_layers:
            raise field_error(ConfigError, "--mtp-num-layers", self.mtp_num_layers,
                              "is required with --enable-mtp-training (slime's rule)",
                              "pass the checkpoint's count, e.g. --mtp-num-layers 1")
        if self.optimizer == "muon" and self.lora_rank:
            raise field_error(ConfigError, "--optimizer", "muon",
                              f"does not train LoRA adapters (--lora-rank {self.lora_rank}): "
                              "Muon orthogonalises whole weight matrices, and a rank-r "
                              "adapter's update is not one", "use --optimizer adam with LoRA, "
                              "or drop --lora-rank")
        self.model_options()  # recompute / MoE consistency (ModelOptions' own checks)
        self._check_steps()

    def _check_steps(self) -> None:
        groups = self.groups_per_rollout
        steps = self.num_steps_per_rollout
        if self.use_dynamic_global_batch_size and steps not in (None, 1):
            raise field_error(ConfigError, "--num-steps-per-rollout", steps,
                              "contradicts --use-dynamic-global-batch-size, which trains one "
                              "optimizer step per rollout",
                              "drop one of the two flags")
        if steps is not None and groups % steps:
            raise field_error(ConfigError, "num_steps_per_rollout", steps,
                              f"does not divide the {groups} groups of a rollout",
                              f"use a divisor of {groups}")
        if steps is not None and self.global_batch_size not in (None, groups // steps):
            raise ConfigError(
                f"--num-steps-per-rollout {steps} gives {groups // steps} groups per step "
                f"({groups} groups per rollout / {steps}), but --global-batch-size is "
                f"{self.global_batch_size}. Fix: drop one of the two flags (slime requires "
                "them to agree).")
        if groups % self.effective_global_batch_size and not self.partial_steps:
            raise field_error(
                ConfigError, "global_batch_size", self.effective_global_batch_size,
                f"does not divide the {groups} groups of a rollout (rollout_batch_size="
                f"{self.rollout_batch_size} x n_samples_per_prompt={self.n_samples_per_prompt})",
                f"use a divisor of {groups} (e.g. {groups}), or --allow-partial-train-step")

    # values that read two records
    @property
    def effective_global_batch_size(self) -> int:
        """Groups per optimizer step: ``--global-batch-size``, or the rollout's groups divided
        by ``--num-steps-per-rollout`` (slime's rule); all of them under miles'
        ``--use-dynamic-global-batch-size``."""
        if self.use_dynamic_global_batch_size:
            return self.groups_per_rollout
        if self.num_steps_per_rollout is not None:
            return self.groups_per_rollout // self.num_steps_per_rollout
        return (DEFAULT_GLOBAL_BATCH_SIZE if self.global_batch_size is None
                else self.global_batch_size)

    @property
    def max_response_len(self) -> int:
        """New tokens per response: ``--rollout-max-response-len``, else the built-in task's
        answer length (``--prompt-data`` requires the flag: a dataset has no task to ask), or
        1 under the SFT rollout function, which generates nothing.
        Example: reverse2 without the flag -> 2."""
        if self.rollout_max_response_len is None and self.prompt_data is not None:
            return 1  # sft_rollout (the only dataset run allowed without the flag)
        return self.rollout_max_response_len or get_task(self.task).answer_length

    def resolved_num_rollout(self, dataset_rows: int | None) -> int:
        """Rollouts the run makes: ``--num-rollout``, else the rollouts ``--num-epoch``
        passes over ``dataset_rows`` prompts need, else the default (slime's precedence).

        Example: ``--num-epoch 3`` over 8 rows at ``--rollout-batch-size 4`` gives 6; with
        ``--num-rollout 2`` as well, 2.
        """
        if self.num_rollout is not None:
            return self.num_rollout
        if self.num_epoch is not None and dataset_rows is not None:
            # dynamic sampling may draw more prompts per rollout: a lower bound on the passes
            return -(-self.num_epoch * dataset_rows // self.rollout_batch_size)
        return DEFAULT_NUM_ROLLOUT

    @property
    def partial_steps(self) -> bool:
        """``--allow-partial-train-step``, implied by dynamic sampling: a rollout may keep
        fewer prompts than ``--rollout-batch-size``, and its groups must still train (unless
        ``--dynamic-sampling-fill-filtered`` keeps every batch full); and by miles'
        ``--use-dynamic-global-batch-size``, whose one step per rollout is as long as the
        rollout."""
        return (self.allow_partial_train_step or self.use_dynamic_global_batch_size
                or self.partial_by_dynamic_sampling)

    @property
    def partial_by_dynamic_sampling(self) -> bool:
        """Dynamic sampling may keep fewer prompts than a rollout draws (unless
        ``--dynamic-sampling-fill-filtered`` fills its batch)."""
        return (self.dynamic_sampling_filter_path is not None
                and not self.dynamic_sampling_fill_filtered)

    def warmup_iters(self, num_rollout: int | None = None) -> int:
        """``--lr-warmup-iters``, or slime's ``--lr-warmup-fraction`` of the run's optimizer
        steps over ``num_rollout`` rollouts (the plan's: under ``--num-epoch`` the dataset
        sets it; default the config's), a partial step counted as one
        (``--allow-partial-train-step``): 0.1 of 300 rollouts x 1 step is 30 steps; 0.5 of 2
        rollouts of 5 groups at ``--global-batch-size 4`` (steps of 4 and 1) is 2 steps."""
        if self.lr_warmup_fraction is None:
            return self.lr_warmup_iters
        rollouts = self.resolved_num_rollout(None) if num_rollout is None else num_rollout
        steps = rollouts * steps_per_rollout(
            self.groups_per_rollout, self.effective_global_batch_size, self.partial_steps)
        return round(self.lr_warmup_fraction * steps)

    def loss_config(self) -> LossConfig:
        """The objective's knobs as the core's ``LossConfig`` (the surrogate from
        ``--advantage-estimator``). Example: ``--eps-clip 0`` -> ``--eps-clip=0: must lie in
        (0, 1]. Fix: use e.g. 0.2 (1: no lower clip).``"""
        return self.loss_config_for(surrogate=ESTIMATOR_SURROGATE[self.advantage_estimator],
                                    reward_kl=self.reward_kl)

    @property
    def generates(self) -> bool:
        """Whether the rollout function generates: not the SFT rollout, which reads whole
        conversations (its run builds no engine and syncs no weights)."""
        return self.rollout_function_path != SFT_ROLLOUT_FUNCTION

    @property
    def effective_logprob_check(self) -> bool:
        """``--logprob-check``, off when nothing generates: no engine log-prob exists to
        compare with the trainer's."""
        return self.logprob_check and self.generates

    @property
    def reward_kl(self) -> bool:
        """``--kl-coef`` shapes the advantages: REINFORCE++-baseline only (grpo and gspo
        ignore it, as in slime)."""
        return self.kl_coef > 0 and self.advantage_estimator == "reinforce_plus_plus_baseline"

    @property
    def needs_reference(self) -> bool:
        """The frozen reference model is loaded: ``--use-kl-loss``, or ``--kl-coef``'s
        reward KL."""
        return self.use_kl_loss or self.reward_kl

    def lr_schedule(self, num_rollout: int | None = None) -> LrGroups:
        """The run's LR lengths in groups (the core's ``lr_groups``: ``N`` steps are the groups
        of the run's first ``N`` steps, each at its real size; without ``--lr-decay-iters`` the
        decay is the whole run); ``num_rollout``: the plan's (default: the config's)."""
        rollouts = self.resolved_num_rollout(None) if num_rollout is None else num_rollout
        return lr_groups(groups_per_rollout=self.groups_per_rollout,
                         global_batch_size=self.effective_global_batch_size,
                         allow_partial=self.partial_steps, num_rollout=rollouts,
                         warmup_iters=self.warmup_iters(rollouts),
                         decay_iters=self.lr_decay_iters)

    def optim_config(self, num_rollout: int | None = None) -> OptimConfig:
        """Adam and the LR schedule (``OptimConfig``). Warmup and decay lengths are optimizer
        steps in the flags (as in slime) and groups in the trainer (its schedule advances by
        each step's real group count): :meth:`lr_schedule` converts them. Example:
        ``--lr-warmup-iters 10`` with 128 groups per step warms up over 1280 groups."""
        lr = self.lr_schedule(num_rollout)
        return self.optim_config_for(warmup_groups=lr.warmup_groups,
                                     decay_groups=lr.decay_groups, **self.offload_options())

    def model_options(self) -> ModelOptions:
        """The trainer's recompute and MoE settings (``vime_shell.megatron.model_options``)."""
        try:
            return ModelOptions(
                recompute_granularity=self.recompute_granularity,
                recompute_method=self.recompute_method,
                recompute_num_layers=self.recompute_num_layers,
                recompute_modules=self.recompute_modules, moe_router_topk=self.moe_router_topk,
                moe_aux_loss_coeff=self.moe_aux_loss_coeff,
                moe_z_loss_coeff=self.moe_z_loss_coeff,
                moe_router_load_balancing_type=self.moe_router_load_balancing_type,
                moe_token_dispatcher_type=self.moe_token_dispatcher_type,
                moe_router_dtype=self.moe_router_dtype, moe_grouped_gemm=self.moe_grouped_gemm,
                moe_permute_fusion=self.moe_permute_fusion,
                moe_enable_routing_replay=self.use_rollout_routing_replay,
                mtp_loss_scaling_factor=self.mtp_loss_scaling_factor
                if self.enable_mtp_training else None)
        except VimeError as exc:
            raise ConfigError(str(exc)) from exc

    def batching_policy(self) -> BatchingPolicy:
        """The scheduler's policy for the resolved step size and partial-step rule."""
        return self.policy(global_batch_size=self.effective_global_batch_size,
                           allow_partial_train_step=self.partial_steps)

    # views
    def record(self, cls: type[R]) -> R:
        """One component's record on its own, e.g. ``cfg.record(EvalArgs)`` for the evaluator
        (a copy of this config's values; it checks itself again, and passes)."""
        return cls(**{f.name: getattr(self, f.name) for f in attrs.fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def section(self, name: str) -> dict[str, Any]:
        """One section's settings (a view: the flat fields stay the one copy). Example:
        ``TrainConfig().section("loss")["eps_clip"] == 0.2``."""
        if name not in SECTIONS:
            raise field_error(ConfigError, "section", name, "is not a section",
                              f"use one of {list(SECTIONS)}")
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self))
                if f.metadata["section"] == name}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "config") -> "TrainConfig":
        """Build from a mapping with ``snake_case`` or ``dash-case`` keys; unknown keys fail."""
        fields = attrs.fields_dict(cls)
        out: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key).replace("-", "_")
            if name not in fields:
                close = difflib.get_close_matches(name, sorted(fields), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {sorted(fields)}"
                raise field_error(ConfigError, f"{source} key", key, "is not a setting", hint)
            out[name] = _from_text(fields[name], value)
        return cls(**out)


def _from_text(f: attrs.Attribute, value: Any) -> Any:
    """A float setting written as text becomes the number: PyYAML (YAML 1.1) reads ``lr: 3e-4``
    as the string ``"3e-4"`` (it wants ``3.0e-4``). Other text is left for the type check."""
    if isinstance(value, str) and f.type in (float, float | None):
        try:
            return float(value)
        except ValueError:
            return value
    return value
