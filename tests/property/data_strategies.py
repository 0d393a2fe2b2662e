"""Hypothesis strategies for rollout outputs: samples, nestings of lists/tuples, id schemes."""

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from vime_pure import (BatchingPolicy, ParallelLayout, RolloutBatch, Sample, ScheduleError, Status,
                       schedule_for)

finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def samples(draw, group_id=None, reward=None, with_log_probs: bool | None = None) -> Sample:
    """A valid sample; ``group_id`` / ``reward`` fixed when given, else drawn. Tokens and
    log-probs (the engine's and a teacher's) and reverse-KL estimates (all or none) come from
    one drawn seed (cheap to generate; their values are not under test)."""
    prompt = draw(st.integers(1, 6))
    resp = draw(st.integers(0, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    lp = with_log_probs if with_log_probs is not None else draw(st.booleans())
    explicit_mask = draw(st.booleans())
    return Sample(
        tokens=rng.integers(0, 50_000, prompt + resp).tolist(), response_length=resp,
        loss_mask=rng.integers(0, 2, resp).tolist() if explicit_mask else None,
        reward=reward if reward is not None else draw(finite),
        status=draw(st.sampled_from(list(Status))),
        group_id=group_id,
        index=draw(st.none() | st.integers(0, 10**6)),
        rollout_log_probs=(-rng.random(resp, dtype=np.float32) * 5).tolist() if lp else None,
        # the teacher server's (--opd-type sglang) travel with the engine's
        teacher_log_probs=(-rng.random(resp, dtype=np.float32) * 7).tolist() if lp else None,
        # and top-k distillation's reverse-KL estimates (any finite real, negative too)
        opd_reverse_kl=(rng.standard_normal(resp, dtype=np.float32) * 3).tolist() if lp
        else None,
        remove_sample=draw(st.booleans()),
        weight_versions=draw(weight_versions()),
    )


@st.composite
def weight_versions(draw, max_version: int = 6) -> list[int]:
    """A sample's segment versions: empty (on policy) or a non-decreasing list of ints."""
    steps = draw(st.lists(st.integers(0, 2), max_size=3))
    start = draw(st.integers(0, max_version))
    return [start + sum(steps[:k]) for k in range(len(steps))]


def _container(draw, items: list):
    return tuple(items) if draw(st.booleans()) else list(items)


@st.composite
def rollout_outputs(draw, depth: int | None = None, max_prompts: int = 4, light: bool = False):
    """A well-formed rollout output of the given depth (0-3) with valid ids.

    depth 0: prompt_group set on every sample. depth 1: prompt x sample, ids None or explicit
    per sample. depth >= 2: leaves are rollout groups; multi-sample leaves share a unique id.
    ``light``: fixed tokens (nesting-only tests draw far less).
    """
    depth = draw(st.integers(0, 3)) if depth is None else depth
    with_lp = draw(st.booleans())
    counter = iter(range(10**6))
    label = draw(st.sampled_from(["int", "str"]))

    def fresh_id():
        k = next(counter) * 3 + 1
        return k if label == "int" else f"rollout-{k}"

    def leaf():
        n = draw(st.integers(1, 3))
        gid = fresh_id() if n > 1 or draw(st.booleans()) else None
        reward = draw(finite)
        if light:
            return _container(draw, [Sample(tokens=[1, 2], response_length=1, group_id=gid,
                                            reward=reward) for _ in range(n)])
        return _container(draw, [draw(samples(group_id=gid, reward=reward,
                                              with_log_probs=with_lp)) for _ in range(n)])

    def level(d: int):
        if d == depth:
            return leaf()
        return _container(draw, [level(d + 1) for _ in range(draw(st.integers(1, 2)))])

    if depth == 0:
        out = []
        for p in range(draw(st.integers(1, max_prompts))):
            for _ in range(draw(st.integers(1, 3))):
                out.append(draw(samples(with_log_probs=with_lp)))
                out[-1].prompt_group = f"prompt-{p}"
        return _container(draw, out)
    if depth == 1:  # per prompt: rollout groups of 1-3 siblings, interleaved
        prompts = []
        for _ in range(draw(st.integers(1, max_prompts))):
            members = [s for _ in range(draw(st.integers(1, 3))) for s in leaf()]
            prompts.append(_container(draw, draw(st.permutations(members))))
        return _container(draw, prompts)
    return _container(draw, [level(1) for _ in range(draw(st.integers(1, max_prompts)))])


@st.composite
def schedule_configs(draw, num_groups: int):
    """A dynamic-packing layout and policy that can schedule ``num_groups`` groups."""
    dp = draw(st.integers(1, min(3, num_groups)))
    gbs = draw(st.integers(dp, num_groups))
    cap = draw(st.integers(4, 30))
    return ParallelLayout(dp=dp), BatchingPolicy(global_batch_size=gbs, max_tokens_per_gpu=cap,
                                                 allow_partial_step=draw(st.booleans()))


@st.composite
def scheduled_batches(draw, depth: int | None = 2):
    """``(batch, schedule)``: a drawn rollout output as a ``RolloutBatch`` and a schedule of it
    under a drawn layout and policy (draws the scheduler rejects are discarded)."""
    batch = RolloutBatch.from_samples(draw(rollout_outputs(depth=depth)))
    layout, policy = draw(schedule_configs(batch.num_groups))
    try:
        return batch, schedule_for(batch, layout, policy)
    except ScheduleError:
        assume(False)
