"""Rank 0's planning of one rollout, as a plain function the exchange calls with the merged
metadata (:func:`plan_rollout`, on the fixed inputs of :class:`PlanInputs`).

    merged BatchMeta ─▶ checks (log-probs recorded; staleness within K) ─▶ plan_shares
    (advantages, Schedule: the core's) ─▶ fresh samples ─▶ (SharePlan, extra) ─▶ every rank

``extra`` holds what every rank's record needs (the generation statistics, the batch fields)
and the planned metadata, which the step keeps on rank 0 (a dump's index) and ships to every
rank only where a hook may gather the batch. Nothing here reads the mode: a bound ``K``
arrives as a number, or None when batches are never stale by construction.

Example: ``plan_rollout(inputs, None)`` (every prompt filtered) returns
``(None, {"stats": ...})``, and every rank skips the rollout.
"""

import logging
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from vime_pure.async_pool import enforce_staleness_bound
from vime_pure.data.rewards import RewardNormalization
from vime_pure.data.shares import BatchMeta, SharePlan, plan_shares
from vime_pure.metrics import metric_values
from vime_pure.staleness import fresh_samples, staleness_metrics
from vime_shell.sources.base import Produced
from vime_shell.sources.rollouts import empty_rollout_message
from vime_shell.train.records import batch_fields
from vime_shell.train.weight_check import LogprobCheckError

log = logging.getLogger("vime.train")


@attrs.frozen(kw_only=True)
class PlanInputs:
    """Everything rank 0's planning of rollout ``rollout_id`` reads besides the merged
    metadata: ``produced`` (rank 0's own part and statistics), the trainer's
    ``weight_version``, whether the source ``generates``, whether the ``logprob_check`` runs,
    the staleness bound ``max_staleness`` (None: unbounded by construction), the reward
    ``normalization``, the scheduler's ``layout`` and ``policy``, ``flops`` per sample, the
    rollout function's path (for a message)."""

    rollout_id: int
    produced: Produced
    weight_version: int
    generates: bool
    logprob_check: bool
    max_staleness: int | None
    normalization: RewardNormalization
    layout: Any
    policy: Any
    flops: Callable[[np.ndarray], Any]
    rollout_function: str


def plan_rollout(inputs: PlanInputs, merged: BatchMeta | None
                 ) -> tuple[SharePlan | None, dict]:
    """Rank 0: the checks, advantages and ``Schedule`` of the merged metadata, the freshness
    of every sample and the record's batch fields; ``(None, {"stats": ...})`` when nothing is
    left to train (every prompt filtered: the rollout is skipped)."""
    rid, produced = inputs.rollout_id, inputs.produced
    generation = produced.stats
    stats = {} if generation is None else generation.as_record()
    if merged is None:
        if generation is not None:
            log.warning(empty_rollout_message(rid, generation))
            stats["filtered_reward_mean"] = generation.filtered_reward_mean
        return None, {"stats": stats}
    if inputs.generates:  # a replayed dump's versions count another run's syncs
        stats.update(metric_values(staleness_metrics(merged, inputs.weight_version)))
        _check_generated(inputs, merged)
    # The run's own FLOPs model (from the model's config), not the fixed 8B proxy ratio.
    meta, plan = plan_shares(merged, inputs.layout, inputs.policy,
                             inputs.flops(merged.lengths.astype(np.int64)),
                             normalization=inputs.normalization)
    if inputs.generates:
        plan = attrs.evolve(plan, fresh=fresh_samples(meta, inputs.weight_version))
    return plan, {"stats": stats, "fields": batch_fields(meta, plan.schedule),
                  "meta": meta}


def _check_generated(inputs: PlanInputs, merged: BatchMeta) -> None:
    """A generated batch: its engine log-probs are recorded (when the check runs) and no
    sample is staler than ``K`` (never train past the bound)."""
    if not merged.has_log_probs and inputs.logprob_check:
        raise LogprobCheckError(
            f"rollout {inputs.rollout_id}: the rollout function ({inputs.rollout_function}) "
            "returned samples without rollout_log_probs, so the weight-sync check "
            "(engine vs trainer log-probs) cannot run. Fix: record the engine's "
            "log-probs in Sample.rollout_log_probs, or pass --no-logprob-check.")
    if inputs.max_staleness is not None:
        enforce_staleness_bound(merged.weight_version_min, inputs.weight_version,
                                inputs.max_staleness)
