"""Seeded synthetic rollout workloads for the CLI, the benchmark and the tests.

Lengths are long-tailed like real RL rollouts (all draws from ``numpy.random.default_rng(seed)``):

- prompt length: lognormal, median 500, sigma 0.4, clipped to [32, 4096];
- response length: ``exp(N(ln 2000, 0.6) per prompt + N(0, 0.8) per sample)``, clipped to
  [16, 32768];
- fan-out: ``grpo8`` / ``grpo16`` give each prompt 8 / 16 rollout groups of one sample each;
  ``agentic8`` gives each prompt 8 groups whose rollout emits 1/2/3/4 samples with probability
  0.4/0.3/0.2/0.1; samples after the first carry a compacted context of lognormal length
  (median 2000, sigma 0.5, clipped to [32, 8192]) in place of the prompt.

A sample's length is prompt (or compacted context) + response. Example:
``synthetic_workload(num_groups=16, fanout="grpo8", seed=0)`` gives 16 samples in 2 prompts.
"""

from typing import Any

import attrs
import numpy as np
from jaxtyping import Int64

from vime_pure.config import as_int
from vime_pure.errors import ScheduleError, field_error

FANOUTS: dict[str, int] = {"grpo8": 8, "grpo16": 16, "agentic8": 8}
MAX_GROUPS = 2**24
AGENTIC_SAMPLES = np.array([1, 2, 3, 4])
AGENTIC_PROBS = np.array([0.4, 0.3, 0.2, 0.1])


@attrs.frozen(eq=False)
class Workload:
    """Per-sample ``lengths`` and ``group_ids`` (rollout groups), plus each sample's prompt."""

    lengths: Int64[np.ndarray, " n"]
    group_ids: Int64[np.ndarray, " n"]
    prompt_ids: Int64[np.ndarray, " n"]

    @property
    def num_samples(self) -> int:
        return int(self.lengths.size)


def _lognormal(rng: np.random.Generator, median: int, sigma: float, size: int,
               lo: int, hi: int) -> np.ndarray:
    return np.clip(np.exp(rng.normal(np.log(median), sigma, size)), lo, hi).astype(np.int64)


def synthetic_workload(*, num_groups: Any, fanout: Any = "agentic8", seed: Any = 0) -> Workload:
    """Draw ``num_groups`` rollout groups (rounded up to whole prompts, then truncated)."""
    if not isinstance(fanout, str) or fanout not in FANOUTS:
        raise field_error(ScheduleError, "fanout", fanout, "is unknown",
                          f"use one of {sorted(FANOUTS)}")
    num_groups = as_int("num_groups", num_groups, 1, ScheduleError, "pass e.g. num_groups=256")
    if num_groups > MAX_GROUPS:  # a typo such as 10**12 would exhaust memory, not fail
        raise field_error(ScheduleError, "num_groups", num_groups, f"exceeds {MAX_GROUPS}",
                          "pass a workload size that fits in memory, e.g. 65536")
    rng = np.random.default_rng(as_int("seed", seed, 0, ScheduleError, "pass e.g. seed=0"))
    per_prompt = FANOUTS[fanout]
    num_prompts = -(-num_groups // per_prompt)
    group_prompt = np.repeat(np.arange(num_prompts), per_prompt)[:num_groups]
    if fanout == "agentic8":
        fan = rng.choice(AGENTIC_SAMPLES, size=num_groups, p=AGENTIC_PROBS)
    else:
        fan = np.ones(num_groups, dtype=np.int64)
    group_of_sample = np.repeat(np.arange(num_groups), fan)
    first = np.ones(group_of_sample.size, dtype=bool)
    first[1:] = group_of_sample[1:] != group_of_sample[:-1]
    prompt_of_sample = group_prompt[group_of_sample]

    prompt_len = _lognormal(rng, 500, 0.4, num_prompts, 32, 4096)
    context = np.where(first, prompt_len[prompt_of_sample],
                       _lognormal(rng, 2000, 0.5, group_of_sample.size, 32, 8192))
    per_prompt_mu = rng.normal(np.log(2000), 0.6, num_prompts)[prompt_of_sample]
    response = np.clip(np.exp(per_prompt_mu + rng.normal(0, 0.8, group_of_sample.size)),
                       16, 32768).astype(np.int64)
    return Workload(lengths=(context + response).astype(np.int64),
                    group_ids=group_of_sample.astype(np.int64),
                    prompt_ids=prompt_of_sample.astype(np.int64))
