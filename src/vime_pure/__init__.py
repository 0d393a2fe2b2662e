"""vime_pure: the functional core of vime.

Pure, side-effect-free functions and frozen records. The scheduler imports neither torch nor
Megatron, so analysis scripts import it in milliseconds; torch-based parts (loss accounting)
load lazily on first use of their names.

Example::

    from vime_pure import BatchingPolicy, ParallelLayout, build_schedule
    sched = build_schedule([900, 300, 700, 200], ["a", "a", "b", "c"],
                           ParallelLayout(dp=2), BatchingPolicy(global_batch_size=3,
                                                                max_tokens_per_gpu=1000))
    sched.steps[0].num_microbatches  # 2 micro-batches per rank
"""

import importlib
from typing import Any

from vime_pure.batch import RolloutBatch, schedule_for
from vime_pure.config import BatchingPolicy, ParallelLayout, check_feasible
from vime_pure.errors import (DumpFormatError, RewardError, RolloutBatchError,
                              RolloutValidationError, ScheduleError, VimeError)
from vime_pure.invariants import ScheduleInvariantError
from vime_pure.denominators import (LossConfigError, LossMode, group_mask_sums,
                                    sample_denominators, step_divisor)
from vime_pure.metrics import (Metric, MetricError, merge_metrics, metric_values,
                               reduce_metrics, reduce_train_step)
from vime_pure.rewards import (RewardNormalization, grpo_advantages, gspo_advantages,
                               normalize_rewards, reinforce_pp_baseline_advantages)
from vime_pure.rollout import (FlatRollout, fallback_ids, flatten_rollout_output,
                               normalized_loss_mask)
from vime_pure.sample import Sample, Status
from vime_pure.schedule import Schedule, StepPlan, build_schedule
from vime_pure.shard import PackedMicroBatch, RankShard, shard

# Names whose modules import torch (or are heavier); loaded on first attribute access so that
# ``import vime_pure`` stays torch-free and fast. Maps public name -> defining module.
_LAZY: dict[str, str] = {
    "FlopsModel": "vime_pure.flops",
    **dict.fromkeys(["microbatch_loss", "megatron_loss_scale", "rejection_mask",
                     "sample_index_from_lengths"], "vime_pure.loss"),
    **dict.fromkeys(["CPConfigError", "ZigzagOffsets", "zigzag_offsets", "slice_response",
                     "slice_sequence", "slice_packed_response"], "vime_pure.cp"),
    **dict.fromkeys(["PolicyTerms", "ppo_clip_loss", "kl_penalty", "entropy_from_logits",
                     "token_log_probs", "tis_weights", "policy_loss"], "vime_pure.policy_loss"),
}

__all__ = [
    "BatchingPolicy",
    "DumpFormatError",
    "FlatRollout",
    "LossConfigError",
    "LossMode",
    "Metric",
    "MetricError",
    "PackedMicroBatch",
    "ParallelLayout",
    "RankShard",
    "RewardError",
    "RewardNormalization",
    "RolloutBatch",
    "RolloutBatchError",
    "RolloutValidationError",
    "Sample",
    "Schedule",
    "ScheduleError",
    "ScheduleInvariantError",
    "Status",
    "StepPlan",
    "VimeError",
    "build_schedule",
    "check_feasible",
    "fallback_ids",
    "flatten_rollout_output",
    "group_mask_sums",
    "grpo_advantages",
    "gspo_advantages",
    "merge_metrics",
    "metric_values",
    "normalize_rewards",
    "normalized_loss_mask",
    "reduce_metrics",
    "reduce_train_step",
    "reinforce_pp_baseline_advantages",
    "sample_denominators",
    "schedule_for",
    "shard",
    "step_divisor",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vime_pure' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
