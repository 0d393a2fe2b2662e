"""``assert_rolloutbatch_invariants`` / ``assert_microbatch_invariants``: independent re-checks.

They recompute every invariant from public fields with plain Python (not through the core's
construction-time checks, its numpy kernels or ``vime_pure.denominators``), so a bug there
cannot hide a bug in the conversion or in the trainer's micro-batch records.
"""

import numpy as np

from vime_pure import LossMode, RankBatch, RolloutBatch, Schedule, Status, group_mask_sums

# The optional float32 columns of one value per response token (the samples' fields of the
# same names): log-probs, and top-k distillation's reverse-KL estimates (any finite real).
RESPONSE_FLOATS = ("rollout_log_probs", "teacher_log_probs", "opd_reverse_kl")


def _rows(flat, offsets, i):
    return flat[offsets[i]:offsets[i + 1]].tolist()


def assert_rolloutbatch_invariants(b: RolloutBatch, samples=None, group_ids=None) -> None:
    """Check ``b``; with ``samples`` (flattened order) and resolved ``group_ids``, also check
    that every row reproduces its sample."""
    n = b.num_samples
    assert b.tokens.dtype == np.int32 and b.loss_masks.dtype == np.uint8
    assert b.token_offsets.tolist() == [0, *np.cumsum(b.lengths).tolist()]
    assert b.response_offsets.tolist() == [0, *np.cumsum(b.response_lengths).tolist()]
    masks = [_rows(b.loss_masks, b.response_offsets, i) for i in range(n)]
    assert all(set(m) <= {0, 1} for m in masks)
    first: dict[int, int] = {}
    for i, g in enumerate(b.group_ids.tolist()):
        first.setdefault(g, i)
        j = first[g]
        assert b.prompt_groups[i] == b.prompt_groups[j]
        assert b.rewards[i] == b.rewards[j] and b.advantages[i] == b.advantages[j]
    assert list(first) == list(range(len(first))) == list(range(b.num_groups))
    ids = b.original_group_ids()
    np.testing.assert_array_equal(
        b.group_mask_sums, group_mask_sums(ids, [np.asarray(m, dtype=np.float64) for m in masks]))
    for i in range(n):
        if b.removed[i]:
            assert sum(masks[i]) == 0
        assert 0 <= b.response_lengths[i] <= b.lengths[i] and b.lengths[i] >= 1
    for i in range(n):
        lo, hi = int(b.weight_version_min[i]), int(b.weight_version_max[i])
        assert (lo, hi) == (-1, -1) or 0 <= lo <= hi
    for arr in b.columns().values():
        assert arr is None or not arr.flags.writeable
    for name in RESPONSE_FLOATS:  # one finite float32 per response token, or None
        col = getattr(b, name)
        assert col is None or (col.dtype == np.float32 and col.shape == (len(b.loss_masks),)
                               and np.isfinite(col).all()), name
    if samples is None:
        return
    assert n == len(samples)
    for i, s in enumerate(samples):
        assert _rows(b.tokens, b.token_offsets, i) == list(s.tokens)
        assert b.response_lengths[i] == s.response_length
        want = ([0] * s.response_length if s.remove_sample else
                [1] * s.response_length if s.loss_mask is None else list(s.loss_mask))
        assert masks[i] == want
        assert b.statuses[i] == list(Status).index(Status(s.status))
        assert b.sample_indices[i] == (-1 if s.index is None else s.index)
        assert bool(b.removed[i]) == s.remove_sample
        versions = list(s.weight_versions)
        assert (b.weight_version_min[i], b.weight_version_max[i]) == (
            (versions[0], versions[-1]) if versions else (-1, -1))
        for name in RESPONSE_FLOATS:
            if getattr(s, name) is not None:
                np.testing.assert_array_equal(_rows(getattr(b, name), b.response_offsets, i),
                                              np.asarray(getattr(s, name), dtype=np.float32))
    if group_ids is not None:
        assert ids == list(group_ids)


def reference_denominators(b: RolloutBatch, sched: Schedule, mode: LossMode,
                           norm: float | None) -> dict[int, float]:
    """``D`` of every scheduled sample under ``mode``, from the loss formulas, in plain Python."""
    masks = {i: sum(_rows(b.loss_masks, b.response_offsets, i)) for i in range(b.num_samples)}
    out: dict[int, float] = {}
    for step in sched.steps:
        ids = [i for rank in step.microbatches for mb in rank for i in mb]
        step_total = sum(masks[i] for i in ids)
        for i in ids:
            group = [j for j in ids if b.group_ids[j] == b.group_ids[i]]
            out[i] = {LossMode.GROUP_TOKEN_MEAN: sum(masks[j] for j in group),
                      LossMode.SAMPLE_TOKEN_MEAN: masks[i],
                      LossMode.TOKEN_MEAN: step_total,
                      LossMode.SAMPLE_TOKEN_SUM_NORM: norm}[mode]
    return out


def _full_row(b: RolloutBatch, samples: list[int], cp: int):
    """The unsliced packed row: tokens, positions, labels (next token of the same sample, 0
    after its last one), each sample padded to a multiple of 2*cp when cp > 1."""
    tokens, positions, labels, starts = [], [], [], []
    for g in samples:
        own = _rows(b.tokens, b.token_offsets, g)
        padded = len(own) if cp == 1 else -(-len(own) // (2 * cp)) * 2 * cp
        starts.append(len(tokens))
        tokens += own + [0] * (padded - len(own))
        positions += list(range(padded))
        labels += own[1:] + [0] * (padded - len(own) + 1)
    return tokens, positions, labels, starts


def assert_microbatch_invariants(ranks: dict[tuple[int, int], RankBatch], b: RolloutBatch,
                                 sched: Schedule, mode: LossMode, norm: float | None) -> None:
    """The records of every (dp, cp) rank against the batch and the schedule: each rank runs
    its scheduled micro-batches in order; across a micro-batch's CP ranks every response token
    is scored exactly once, by the logit just before it; rows, masks, advantages, engine
    log-probs and step-level denominators are what the batch and the loss formulas say."""
    dens = reference_denominators(b, sched, mode, norm)
    cp = max(c for _, c in ranks) + 1
    for d in range(sched.layout.dp):
        for s, step in enumerate(sched.steps):
            for j, mb in enumerate(step.microbatches[d]):
                records = [ranks[(d, c)].steps[s].microbatches[j] for c in range(cp)]
                _check_microbatch(records, list(mb), b, dens, step, s, mode)


def _check_microbatch(records, samples, b: RolloutBatch, dens, step, s: int,
                      mode: LossMode) -> None:
    cp = len(records)
    tokens, positions, labels, starts = _full_row(b, samples, cp)
    scored: list[int] = []
    for c, rec in enumerate(records):
        assert (rec.step, rec.loss_mode, rec.cp_rank, rec.cp_size) == (s, mode, c, cp)
        assert (rec.num_groups, rec.num_samples) == (step.num_groups, step.num_samples)
        assert rec.num_microbatches == step.num_microbatches
        assert rec.sample_indices.tolist() == samples
        lens = [int(b.lengths[g]) for g in samples]
        assert rec.seq_lengths.tolist() == [n if cp == 1 else -(-n // (2 * cp)) * 2 * cp
                                            for n in lens]
        local = [] if cp > 1 else list(range(len(tokens)))
        for start, n in zip(starts, rec.seq_lengths.tolist() if cp > 1 else []):
            chunk = n // (2 * cp)
            for k in (c, 2 * cp - 1 - c):
                local += list(range(start + k * chunk, start + (k + 1) * chunk))
        assert rec.tokens.tolist() == [tokens[p] for p in local]
        assert rec.positions.tolist() == [positions[p] for p in local]
        assert rec.labels.tolist() == [labels[p] for p in local]
        for t, (logit, flat, k) in enumerate(zip(rec.logit_index.tolist(),
                                                 rec.response_index.tolist(),
                                                 rec.token_sample.tolist())):
            g = samples[k]
            j = flat - int(b.response_offsets[g])
            assert 0 <= j < b.response_lengths[g]
            prompt = int(b.lengths[g] - b.response_lengths[g])
            assert local[logit] == starts[k] + prompt - 1 + j  # the logit just before the token
            assert rec.labels[logit] == b.tokens[b.token_offsets[g] + prompt + j]
            assert rec.loss_mask[t] == b.loss_masks[flat]
            assert rec.advantages[t] == np.float32(b.advantages[g])
            for name in RESPONSE_FLOATS:
                if getattr(b, name) is not None:
                    assert getattr(rec, name)[t] == getattr(b, name)[flat]
            scored.append(flat)
        assert rec.denominators.tolist() == [dens[g] for g in samples]
    expected = [int(b.response_offsets[g]) + j for g in samples
                for j in range(int(b.response_lengths[g]))]
    assert sorted(scored) == sorted(expected)  # every response token once over the CP ranks


def assert_staleness_invariants(b: RolloutBatch, trainer_version: int, staleness) -> None:
    """``staleness`` (one entry per sample) is the group staleness of ``b`` at
    ``trainer_version``, recomputed here with plain loops: the trainer version minus the
    oldest version among the siblings, on-policy samples (-1) counting as the trainer's."""
    ids = b.group_ids.tolist()
    oldest = [trainer_version if v == -1 else v for v in b.weight_version_min.tolist()]
    assert len(staleness) == b.num_samples
    for i, g in enumerate(ids):
        siblings = [oldest[j] for j in range(len(ids)) if ids[j] == g]
        assert staleness[i] == trainer_version - min(siblings) >= 0
