"""vime_pure: the functional core of vime.

Pure, side-effect-free functions and frozen records, in rooms:

- ``config``: ``ParallelLayout``, ``BatchingPolicy``, ``check_feasible``, ``policy_from_flags``
  and the choice lists; ``errors``: every core error;
- ``scheduling/``: ``build_schedule`` and the ``Schedule`` it returns (planner, packing and
  balancing kernels, FLOPs model, reports, synthetic workloads);
- ``data/``: the rollout data model: ``Sample``, the validated ``RolloutBatch``, advantages, and
  ``rank_batch``, the micro-batch records a trainer rank consumes;
- ``denominators`` (loss modes, step-level denominators, Megatron's scale),
  ``policy_config`` (clip, KL, entropy, TIS and rejection knobs), ``metrics`` (``(sum, count)``
  reductions), ``staleness`` (weight versions -> staleness and the off-policy metrics), ``cp``
  (zigzag context-parallel offsets), ``grouping``;
- ``torch_ops/``: the parts that compute on torch tensors (per-micro-batch loss reduction,
  policy-loss pieces, decoupled-PPO off-policy correction, CP slicing of tensors). Nothing else imports torch, so
  ``import vime_pure`` and ``from vime_pure import *`` stay torch-free.

Example::

    from vime_pure import BatchingPolicy, ParallelLayout, build_schedule
    sched = build_schedule([900, 300, 700, 200], ["a", "a", "b", "c"],
                           ParallelLayout(dp=2), BatchingPolicy(global_batch_size=3,
                                                                max_tokens_per_gpu=1000))
    sched.steps[0].num_microbatches  # 2 micro-batches per rank
"""

from vime_pure.config import (BALANCES, PACKINGS, BatchingPolicy, ParallelLayout, check_feasible,
                              policy_from_flags)
from vime_pure.cp import ZigzagOffsets, zigzag_offsets
from vime_pure.data.batch import RolloutBatch, schedule_for
from vime_pure.data.microbatch import (RankBatch, StepBatch, TrainMicroBatch, rank_batch,
                                       with_log_probs)
from vime_pure.data.rewards import (RewardNormalization, grpo_advantages, gspo_advantages,
                                    normalize_rewards, reinforce_pp_baseline_advantages)
from vime_pure.data.rollout_output import (FlatRollout, fallback_ids, flatten_rollout_output,
                                           normalized_loss_mask)
from vime_pure.data.sample import ON_POLICY_VERSION, Sample, Status
from vime_pure.data.vocab import TokenIdError, check_token_ids
from vime_pure.denominators import (LOSS_MODES, LossMode, group_mask_sums, megatron_loss_scale,
                                    sample_denominators, step_denominators, step_divisor)
from vime_pure.errors import (CPConfigError, DumpFormatError, FlopsModelError, LossConfigError,
                              MetricError, RewardError, RolloutBatchError,
                              RolloutValidationError, ScheduleError, ScheduleInvariantError,
                              VimeError)
from vime_pure.metrics import (Metric, merge_metrics, metric_values, reduce_metrics,
                               reduce_train_step)
from vime_pure.policy_config import KL_KINDS, RS_LEVELS, LossConfig, RejectionConfig
from vime_pure.scheduling.flops import FlopsModel
from vime_pure.scheduling.planner import build_schedule
from vime_pure.scheduling.schedule import Schedule, StepPlan
from vime_pure.staleness import (batch_staleness, fresh_samples, group_staleness,
                                 sample_staleness, staleness_metrics)

__all__ = [
    "BALANCES", "KL_KINDS", "LOSS_MODES", "ON_POLICY_VERSION", "PACKINGS", "RS_LEVELS",
    "BatchingPolicy", "CPConfigError", "DumpFormatError", "FlatRollout", "FlopsModel",
    "FlopsModelError", "LossConfig", "LossConfigError", "LossMode", "Metric", "MetricError", "ParallelLayout",
    "RankBatch", "RejectionConfig", "RewardError", "RewardNormalization", "RolloutBatch", "RolloutBatchError",
    "RolloutValidationError", "Sample", "Schedule", "ScheduleError", "ScheduleInvariantError",
    "Status", "StepBatch", "StepPlan", "TokenIdError", "TrainMicroBatch", "VimeError",
    "ZigzagOffsets", "batch_staleness", "build_schedule", "check_feasible", "check_token_ids",
    "fallback_ids", "flatten_rollout_output", "fresh_samples", "group_staleness",
    "group_mask_sums", "grpo_advantages", "gspo_advantages", "megatron_loss_scale",
    "merge_metrics", "metric_values", "normalize_rewards", "normalized_loss_mask",
    "policy_from_flags", "rank_batch", "reduce_metrics", "reduce_train_step",
    "reinforce_pp_baseline_advantages", "sample_denominators", "sample_staleness",
    "schedule_for", "staleness_metrics",
    "step_denominators", "step_divisor", "with_log_probs", "zigzag_offsets",
]
