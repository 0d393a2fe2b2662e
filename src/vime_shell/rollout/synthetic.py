"""Deterministic synthetic rollouts for the launch self-check and the shell tests.

Purpose: a real ``RolloutBatch`` built from ``Sample``s the way a rollout function returns them:
prompts with 2 rollout groups each, groups of 1-3 sibling samples sharing a ``group_id``
(compact, multi-turn style), random prompts and responses, loss masks with some tokens masked,
and rewards that ``RolloutBatch.from_samples`` turns into GRPO advantages per prompt. Same
seed, same batch.

Example: ``synthetic_batch(128, num_groups=8, seed=0)`` gives 8 groups (about 16 samples) over
4 prompts, of 3-14 tokens each with 1-8 response tokens per sample.
"""

import numpy as np

from vime_pure.config import BatchingPolicy
from vime_pure.data.batch import RolloutBatch, schedule_for
from vime_pure.data.sample import Sample


def synthetic_samples(vocab_size: int, *, num_groups: int, seed: int = 0,
                      max_siblings: int = 3) -> list[list[list[Sample]]]:
    """Compact rollout output ``[prompt][group][sibling]``; 2 groups per prompt."""
    rng = np.random.default_rng(seed)
    prompts: list[list[list[Sample]]] = []
    for g in range(num_groups):
        if g % 2 == 0:
            prompts.append([])
        reward = float(rng.integers(0, 2))
        group = []
        for _ in range(int(rng.integers(1, max_siblings + 1))):
            prompt, response = int(rng.integers(2, 7)), int(rng.integers(1, 9))
            group.append(Sample(
                tokens=rng.integers(0, vocab_size, prompt + response).tolist(),
                response_length=response,
                loss_mask=(rng.random(response) > 0.2).astype(int).tolist(),
                reward=reward, group_id=f"g{g}"))
        prompts[-1].append(group)
    return prompts


def synthetic_batch(vocab_size: int, *, num_groups: int, seed: int = 0) -> RolloutBatch:
    """The validated columnar batch of :func:`synthetic_samples` (advantages included)."""
    return RolloutBatch.from_samples(
        synthetic_samples(vocab_size, num_groups=num_groups, seed=seed))


def synthetic_schedule(batch: RolloutBatch, layout, *, global_batch_size: int,
                       max_tokens_per_gpu: int = 48, allow_partial_step: bool = True):
    """The rollout-side schedule of ``batch`` for a trainer ``layout`` (a ``TrainLayout``)."""
    policy = BatchingPolicy(global_batch_size=global_batch_size,
                            max_tokens_per_gpu=max_tokens_per_gpu,
                            allow_partial_step=allow_partial_step)
    return schedule_for(batch, layout.scheduler_layout(), policy)
