"""One rollout's metrics record (what ``metrics.jsonl`` holds per line), from reduced values.

Every input is already identical on all ranks (the batch and schedule are broadcast, step
metrics are all-reduced by the trainer), so every rank builds the same record. Rewards are
averaged per **rollout group** (siblings of a multi-turn execution count once); losses
(``loss``, ``pg_loss``, ``clipfrac``, ``entropy``, ``kl``, ``ratio``) are averaged over steps
weighted by their group counts ``G_s``, i.e. over all trained groups. ``grad_norm`` is the plain
mean of the rollout's optimizer steps' global gradient norms and ``grad_norm_max`` their largest
(each step is one observation: the norm is already global over its groups); a step skipped for
a non-finite norm (``--skip-nonfinite-grad-steps``, counted in ``skipped_steps``) has no norm
and is left out of both, which are None when no step updated. ``lr`` is the one value that is
not reduced: the LR after the rollout's last step (the one the next step uses).

Example: 128 groups of which 13 solved reverse2 give ``reward_mean 0.1016``; two steps of 64
groups with losses 0.2 and 0.4 give ``loss 0.3``; four steps with gradient norms 0, 0, 0.8 and
0 give ``grad_norm 0.2``, ``grad_norm_max 0.8`` (the last step alone would say 0).
"""

import numpy as np

from vime_pure.data.generation_stats import response_length_stats
from vime_pure.metrics import Metric, weighted_mean
from vime_pure.scheduling.report import step_stats


def _weighted(results, key: str) -> float | None:
    """Group-weighted mean over the steps that measured ``key``; None when none did (no step,
    or no scored token: ``null`` in metrics.jsonl, never a made-up 0)."""
    return weighted_mean([r.metrics[key] for r in results], [r.num_groups for r in results],
                         key)


def grad_norms(results) -> dict[str, float | None]:
    """``grad_norm`` (mean) and ``grad_norm_max`` over the steps that updated (a skipped step's
    norm is NaN/inf: not a measurement to average); None for both when none did."""
    norms = [r.grad_norm for r in results if not r.skipped]
    return {"grad_norm": Metric.of(norms).value, "grad_norm_max": Metric.of(norms, "max").value}


def batch_fields(batch, schedule) -> dict:
    """The record's values that read the batch: rewards per rollout group, counts, response
    lengths, trained tokens, DP imbalance. ``batch``: a ``RolloutBatch`` or the merged
    ``BatchMeta`` (rank 0 computes these once and broadcasts them with the plan)."""
    _, first, fan_out = np.unique(batch.group_ids, return_index=True, return_counts=True)
    rewards, advantages = batch.rewards[first], batch.advantages[first]
    trained = schedule.sample_ids
    stats = step_stats(schedule) if schedule.num_steps else ()
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "num_groups": int(batch.num_groups),
        "num_samples": int(batch.num_samples),
        # samples per rollout group: the fan-out of multi-sample executions (agents)
        "samples_per_group_mean": float(fan_out.mean()),
        "samples_per_group_max": int(fan_out.max()),
        "tool_calls_per_group_mean": tool_calls_per_group(batch),
        "nonzero_adv_frac": float(np.mean(np.abs(advantages) > 1e-8)),
        "response_len_mean": float(np.asarray(batch.response_lengths, dtype=np.int64).mean()),
        **response_length_stats(np.asarray(batch.response_lengths, dtype=np.int64),
                                batch.statuses),
        "dp_imbalance": max((s.token_imbalance for s in stats), default=1.0),
        "tokens": int(batch.lengths[trained].astype(np.int64).sum()) if trained.size else 0,
    }


def tool_calls_per_group(batch) -> float | None:
    """Tool calls per rollout group (per agent execution), from the parts' counts
    (``BatchMeta.part_tool_calls``); None where not known (no sample counts them, or a batch
    rebuilt from columns: a replay)."""
    calls = getattr(batch, "part_tool_calls", None)
    return None if calls is None else float(calls.sum()) / max(int(batch.num_groups), 1)


def rollout_record(rid: int, batch, schedule, results, *, gap: float | None,
                   gap_max: float | None, times: tuple[float, float, float],
                   fields: dict | None = None) -> dict:
    """The record of rollout ``rid``; ``gap``/``gap_max``: the log-prob gap, None where not
    measured (no fresh sample); ``times`` are (rollout, train, sync) seconds;
    ``fields``: ``batch_fields(batch, schedule)`` when already computed (then ``batch`` is
    not read: ranks without the batch pass None)."""
    f = batch_fields(batch, schedule) if fields is None else fields
    tokens = f["tokens"]
    total = float(sum(times))
    return {
        "rollout": rid,
        "reward_mean": f["reward_mean"],
        "reward_std": f["reward_std"],
        "loss": _weighted(results, "loss"),
        "pg_loss": _weighted(results, "pg_loss"),
        "clipfrac": _weighted(results, "clipfrac"),
        "entropy": _weighted(results, "entropy"),  # the trainer's, exact over the vocabulary
        "kl": _weighted(results, "kl"),  # against the reference model (0 without one)
        "ratio": _weighted(results, "ratio"),
        "logprob_gap": gap,
        "logprob_gap_max": gap_max,
        "num_groups": f["num_groups"],
        "num_samples": f["num_samples"],
        "num_steps": schedule.num_steps,
        "num_microbatches": int(schedule.step_microbatches.sum()),
        "dropped_groups": len(schedule.dropped_groups),
        **{k: v for k, v in f.items() if k not in _HEAD},
        "tokens": tokens,
        "tokens_per_s": tokens / total if total > 0 else 0.0,
        "lr": results[-1].lr if results else None,  # after the last step (see above)
        **grad_norms(results),
        "skipped_steps": sum(r.skipped for r in results),  # --skip-nonfinite-grad-steps
        "rollout_s": times[0], "train_s": times[1], "sync_s": times[2],
    }


_HEAD = ("reward_mean", "reward_std", "num_groups", "num_samples", "tokens")


def skipped_record(rid: int, stats: dict, *, lr: float | None, rollout_s: float,
                   evaluated: dict) -> dict:
    """The metrics line of a skipped rollout (``skipped: 1``, nothing trained): the
    generation's counts, the filtered prompts' mean reward as ``reward_mean``, no loss or gap
    (None: nothing was measured; ``lr`` None: no optimizer, ``--debug-rollout-only``)."""
    return {"rollout": rid, "skipped": 1, "reward_mean": stats.get("filtered_reward_mean"),
            "loss": None, "num_groups": 0, "num_samples": 0, "num_steps": 0,
            "num_microbatches": 0, "logprob_gap": None, "tokens": 0, "tokens_per_s": 0.0,
            "lr": lr, "rollout_s": rollout_s, "train_s": 0.0, "sync_s": 0.0,
            **stats, **evaluated}
