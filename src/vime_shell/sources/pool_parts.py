"""Trainer rank 0's side of the fully-async pools on several engine ranks: one reply per
pool joined into the rollout's one batch (or, with the parts kept on the engine ranks, into
each group's place in it), record and resume point.

Each pool (:class:`vime_shell.sources.pool.GroupPool`, one per engine rank) answers the
trainer's ``("batch", k, restore, low)`` with its part: ``("part", k, groups, counts, resume
point)``, each group as ``((block, index), output, version)``. The pools share one queue of
draws, so how many groups each part holds varies from batch to batch (the claimed slots of
batch ``k`` add up to ``B``); the ``(block, index)`` of each group is all the trainer needs to
assemble the batch. The parts are joined in draw order
(:func:`vime_pure.pool_ranks.merge_order`) and the batch is built here from the samples, as
one pool builds it (``RolloutBatch.from_samples``), so a batch does not depend on how many
engine ranks generated it (built here, not per part: ``--normalize-advantages`` whitens over
the whole batch's groups); the counts are added up (``sum_counts``) onto those the run resumed
from (``PoolCounts.resumed``: cumulative across resumes, kept in the checkpoint's data state
as ``pool_counts``), the weight version is the oldest group's, and the resume points merge
into one exact point (``merge_resume_states``; its block is the ``low`` of the next request).

Example: ``B = 4`` over 2 engine ranks: parts with groups ``(3, 0), (3, 1), (3, 3)`` and
``(3, 2)`` give one batch of 4 groups, ``(3, 0)`` to ``(3, 3)``; ``pool_part_engine_rank_0 =
3``, ``pool_part_engine_rank_1 = 1``.
"""

from typing import Any

from vime_pure.async_pool import PoolCounts
from vime_pure.pool_ranks import merge_order, merge_resume_states, sum_counts
from vime_shell.rollout.per_sample import newest_version, offpolicy_prefix
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.rollouts import (batch_of, output_source, prompt_samples,
                                         sample_annotations)


def join_pool_parts(cfg: TrainConfig, parts: list[tuple[Any, ...]],
                    resumed: PoolCounts = PoolCounts()) -> tuple[Any, ...]:
    """The ``("batch", k, batch, record, source, annotations)`` reply of one pool, from the
    ``parts`` of every pool (engine rank order); ``resumed``: the counts the run continues
    from (its checkpoint's, ``PoolCounts.resumed``)."""
    groups, order, record, source = _joined(cfg, parts, resumed)
    outputs = [groups[i][1] for i in order]
    batch = batch_of(outputs, cfg.reward_normalization(), parts[0][1], output_source(cfg))
    return ("batch", parts[0][1], batch, record, source, sample_annotations(outputs))


def place_pool_parts(cfg: TrainConfig, parts: list[tuple[Any, ...]],
                     resumed: PoolCounts = PoolCounts()) -> tuple[Any, ...]:
    """With the parts kept on the engine ranks (each pool's groups sent as keys and versions
    only): ``("held", k, None, record, source, (), places)``, where ``places[j]`` is the
    place in the batch (draw order) of each group pool ``j`` holds, in its part's order: the
    first prompt of the group's chunk, what the exchange merges by."""
    groups, order, record, source = _joined(cfg, parts, resumed)
    place = {i: p for p, i in enumerate(order)}
    places, first = [], 0
    for part in parts:
        places.append([place[first + g] for g in range(len(part[2]))])
        first += len(part[2])
    return ("held", parts[0][1], None, record, source, (), places)


def _joined(cfg: TrainConfig, parts: list[tuple[Any, ...]], resumed: PoolCounts
            ) -> tuple[list, tuple[int, ...], dict, dict]:
    """Every pool's groups (engine rank order), their draw order, the rollout's record and
    the merged resume point."""
    groups = [g for part in parts for g in part[2]]
    order = merge_order([g[0] for g in groups])
    c = sum_counts([resumed, *(PoolCounts(
        started=p[3]["pool_started"], trained=p[3]["pool_trained"],
        recycled=p[3]["pool_recycled"], filtered=p[3]["pool_filtered"]) for p in parts)])
    record = {"prompts_generated": len(groups), "prompts_kept": len(groups),
              "weight_version": min(groups[i][2] for i in order), **c.as_record(),
              **{f"pool_part_engine_rank_{j}": len(p[2]) for j, p in enumerate(parts)}}
    if "pool_cut_requests" in parts[0][3]:  # --partial-rollout: the syncs cut requests
        record |= _partial_record(parts)
    if "pool_paused_requests" in parts[0][3]:  # --pause-generation-mode met requests
        record["paused_requests"] = sum(p[3]["pool_paused_requests"] for p in parts)
    if "pool_token_staleness" in parts[0][3]:  # in-flight updates: staleness per token
        record |= _token_record(parts)
    state = merge_resume_states([p[4] for p in parts], cfg.rollout_batch_size)
    source = {"offset": state.pop("offset"), "draws": state.pop("draws"), "pool": state,
              "pool_counts": c.to_state()}
    return groups, order, record, source


def partial_sums(outputs: list[Any]) -> dict[str, int]:
    """A pool's part under ``--partial-rollout``: its samples continued over a sync, its
    response tokens, and those generated under weights older than their group's newest
    segment (what ``--mask-offpolicy-in-partial-rollout`` masks)."""
    samples = [prompt_samples(out) for out in outputs]
    return {"pool_resumed_samples": sum(len(set(s.weight_versions)) > 1
                                        for group in samples for s in group),
            "pool_tokens": sum(s.response_length for group in samples for s in group),
            "pool_offpolicy_tokens": sum(offpolicy_prefix(s, newest_version(group))
                                         for group in samples for s in group)}


def _partial_record(parts: list[tuple[Any, ...]]) -> dict[str, float]:
    """``--partial-rollout`` in the pools: requests the syncs cut and fan-out samples started
    again (over the run, all pools), and of this batch the samples continued over a sync and
    the share of response tokens generated under older weights (``partial_sums``)."""
    def total(key: str) -> int:
        return sum(p[3][key] for p in parts)

    return {"partial/cut_requests": total("pool_cut_requests"),
            "partial/restarted_samples": total("pool_restarted_samples"),
            "partial/resumed_samples": total("pool_resumed_samples"),
            "partial/offpolicy_token_frac": total("pool_offpolicy_tokens")
            / max(total("pool_tokens"), 1)}


def _token_record(parts: list[tuple[Any, ...]]) -> dict[str, float]:
    """In-flight weight updates (``--pause-generation-mode`` in_place, retract): the batch's
    trained tokens per staleness (``token_staleness/<s>``, fractions), its largest, and the
    tokens the bound masked in this batch (all pools). ``paused_requests`` beside it: the
    requests a sync met over the run (retracted or aborted; 0 in place)."""
    counts: dict[int, int] = {}
    for p in parts:
        for s, n in p[3]["pool_token_staleness"].items():
            counts[int(s)] = counts.get(int(s), 0) + int(n)
    total = max(sum(counts.values()), 1)
    return {**{f"token_staleness/{s}": n / total for s, n in sorted(counts.items())},
            "token_staleness_max": max(counts, default=0),
            "stale_tokens_masked": sum(p[3]["pool_stale_tokens_masked"] for p in parts)}
