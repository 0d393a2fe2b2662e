"""Deterministic synthetic rollouts for the launch self-check and the shell tests.

Purpose: groups of 1-3 sibling samples with random prompts, responses, loss masks (some
tokens masked, some groups fully masked when asked) and group advantages, plus the step-level
group denominators from ``vime_pure.group_mask_sums``. Same seed, same rows.

Example: ``synthetic_rows(128, num_groups=8, seed=0)`` gives 8 groups (about 16 samples) of
3-14 tokens each, with response tokens 1..8 per sample.
"""

import numpy as np

from vime_pure import BatchingPolicy, build_schedule, group_mask_sums
from vime_shell.packing import TrainRows


def synthetic_rows(vocab_size: int, *, num_groups: int, seed: int = 0,
                   max_siblings: int = 3, with_old_log_probs: bool = False) -> TrainRows:
    """Rows of ``num_groups`` groups; advantages are per group (broadcast to siblings' tokens)."""
    rng = np.random.default_rng(seed)
    tokens, lengths, resp, masks, advs, groups, old = [], [], [], [], [], [], []
    for g in range(num_groups):
        adv = float(rng.normal())
        for _ in range(int(rng.integers(1, max_siblings + 1))):
            prompt, response = int(rng.integers(2, 7)), int(rng.integers(1, 9))
            tokens.append(rng.integers(0, vocab_size, prompt + response))
            lengths.append(prompt + response)
            resp.append(response)
            mask = (rng.random(response) > 0.2).astype(np.float64)
            masks.append(mask)
            advs.append(np.full(response, adv))
            old.append(-np.abs(rng.normal(2.0, 0.5, response)))
            groups.append(g)
    return TrainRows(
        tokens=np.concatenate(tokens).astype(np.int64), lengths=np.asarray(lengths, np.int64),
        response_lengths=np.asarray(resp, np.int64), loss_mask=np.concatenate(masks),
        advantages=np.concatenate(advs), denominators=group_mask_sums(groups, masks),
        group=np.asarray(groups, np.int64),
        old_log_probs=np.concatenate(old) if with_old_log_probs else None)


def synthetic_schedule(rows: TrainRows, layout, *, global_batch_size: int,
                       max_tokens_per_gpu: int = 48, allow_partial_step: bool = True):
    """The rollout-side schedule of ``rows`` for a trainer ``layout`` (a ``TrainLayout``)."""
    policy = BatchingPolicy(global_batch_size=global_batch_size,
                            max_tokens_per_gpu=max_tokens_per_gpu,
                            allow_partial_step=allow_partial_step)
    return build_schedule(rows.lengths.tolist(), rows.group.tolist(),
                          layout.scheduler_layout(), policy)
