"""Group-aware reward normalisation: zero mean per prompt group, equal siblings, typed errors."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_pure import (RewardError, RewardNormalization, RolloutBatch, Sample, grpo_advantages,
                       gspo_advantages, normalize_rewards, reinforce_pp_baseline_advantages)

CONFIGS = [RewardNormalization(method=m, normalize_std=s)
           for m in ("grpo", "gspo", "reinforce_pp_baseline") for s in (True, False)]


@st.composite
def grouped_rewards(draw):
    """(rewards, group_ids, prompt_groups): uneven fan-out, siblings interleaved, one reward
    per rollout group."""
    rows = []
    for p in range(draw(st.integers(1, 5))):
        for g in range(draw(st.integers(1, 4))):
            r = draw(st.floats(-5, 5, allow_nan=False) | st.sampled_from([0.0, 1.0]))
            rows += [(r, f"p{p}-g{g}", p)] * draw(st.integers(1, 4))
    rows = draw(st.permutations(rows))
    return [r for r, _, _ in rows], [g for _, g, _ in rows], [p for _, _, p in rows]


@given(grouped_rewards(), st.sampled_from(CONFIGS))
def test_zero_mean_per_prompt_group_and_equal_siblings(data, cfg):
    """Advantages are computed once per rollout group (siblings share it) as its reward minus
    its prompt's mean over rollout groups, then divided by a per-prompt std or whitened over
    the batch (whose mean of prompt-centred values is 0), so they average to 0 per prompt."""
    rewards, groups, prompts = data
    adv = normalize_rewards(rewards, groups, prompts, cfg)
    per_group = {}
    for a, g, p in zip(adv, groups, prompts):
        assert per_group.setdefault(g, (a, p)) == (a, p)  # siblings equal
    for p in set(prompts):
        vals = [a for a, q in per_group.values() if q == p]
        assert abs(np.mean(vals)) <= 1e-9 * max(1.0, *np.abs(vals))


@given(grouped_rewards(), st.sampled_from(CONFIGS), st.data())
def test_advantages_do_not_depend_on_sibling_counts(data, cfg, draw):
    """Normalisation sees one reward per rollout group, so dropping siblings changes nothing."""
    rewards, groups, prompts = data
    adv = dict(zip(groups, normalize_rewards(rewards, groups, prompts, cfg)))
    # One sample per rollout group gives the same per-group advantages.
    firsts = {g: (r, p) for r, g, p in zip(rewards, groups, prompts)}
    gs = list(firsts)
    single = normalize_rewards([firsts[g][0] for g in gs], gs, [firsts[g][1] for g in gs], cfg)
    np.testing.assert_allclose(single, [adv[g] for g in gs], rtol=1e-12, atol=1e-12)


def test_uneven_fanout_counts_each_rollout_group_once():
    # Prompt 0: an agentic rollout with 3 samples (reward 1) and two single-sample rollouts (0).
    rewards = [1, 1, 1, 0, 0, 5]
    groups = ["a", "a", "a", "b", "c", "d"]
    prompts = [0, 0, 0, 0, 0, 1]
    adv = grpo_advantages(rewards, groups, prompts, normalize_std=False)
    np.testing.assert_allclose(adv, [2 / 3] * 3 + [-1 / 3, -1 / 3, 0.0])
    # Not the per-sample mean (0.6), and prompt 1 does not merge into prompt 0.


def test_grpo_with_std_matches_the_formula():
    adv = grpo_advantages([1.0, 0.0, 1.0, 1.0], [0, 1, 2, 3], [0, 0, 0, 0], eps=1e-6)
    r = np.array([1.0, 0.0, 1.0, 1.0])
    np.testing.assert_allclose(adv, (r - r.mean()) / (r.std(ddof=1) + 1e-6))
    np.testing.assert_array_equal(gspo_advantages([1.0, 0.0, 1.0, 1.0], [0, 1, 2, 3],
                                                  [0, 0, 0, 0]), adv)


def test_grpo_std_is_slimes_sample_std():
    # One solved of 8: slime's torch.std (Bessel) gives 2.475 / -0.354, not 2.646 / -0.378.
    adv = grpo_advantages([1.0] + [0.0] * 7, list(range(8)), [0] * 8)
    np.testing.assert_allclose(adv[:2], [2.4748737, -0.3535534], rtol=1e-5)  # eps 1e-6


def test_single_rollout_prompt_gets_zero_advantage():
    assert grpo_advantages([3.0, 3.0], ["x", "x"], [0, 0]).tolist() == [0.0, 0.0]


def test_reinforce_pp_baseline_whitens_over_rollout_groups():
    rewards, groups, prompts = [1.0, 0.0, 0.0, 2.0, 0.0], [0, 1, 2, 3, 4], [0, 0, 0, 1, 1]
    adv = reinforce_pp_baseline_advantages(rewards, groups, prompts, eps=1e-12)
    centred = np.array([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0])
    np.testing.assert_allclose(adv, centred / centred.std(), rtol=1e-9)
    raw = reinforce_pp_baseline_advantages(rewards, groups, prompts, normalize_std=False)
    np.testing.assert_allclose(raw, centred)


def test_sibling_reward_mismatch_is_an_error():
    with pytest.raises(RewardError, match=r"sample 0 and sample 2 are siblings .* 1.0 and 0.0"):
        grpo_advantages([1.0, 0.5, 0.0], ["a", "b", "a"], [0, 0, 0])


def test_rollout_group_spanning_prompts_is_an_error():
    with pytest.raises(RewardError, match="answers another prompt"):
        grpo_advantages([1.0, 1.0], ["a", "a"], [0, 1])


def test_non_finite_reward_is_an_error():
    with pytest.raises(RewardError, match="sample 1: reward=nan is not finite"):
        grpo_advantages([1.0, float("nan")], [0, 1], [0, 0])


def test_bad_config_is_rejected():
    with pytest.raises(RewardError, match="method='ppo'.*grpo"):
        RewardNormalization(method="ppo")
    with pytest.raises(RewardError, match="eps=0"):
        RewardNormalization(eps=0)


def _sample(reward, gid=None):
    return Sample(tokens=[1, 2, 3], response_length=2, reward=reward, group_id=gid)


def test_from_samples_reads_dict_rewards_by_key_and_names_paths():
    batch = RolloutBatch.from_samples([[_sample({"acc": 1.0, "fmt": 0.2}),
                                        _sample({"acc": 0.0, "fmt": 0.9})]], reward_key="acc")
    assert batch.rewards.tolist() == [1.0, 0.0]
    with pytest.raises(RewardError, match=r"output\[0\]\[1\]: reward has no key 'acc'"):
        RolloutBatch.from_samples([[_sample({"acc": 1.0}), _sample({"fmt": 1.0})]],
                                  reward_key="acc")
    with pytest.raises(RewardError, match=r"output\[0\]\[0\]: reward is a dict .* reward_key=None"):
        RolloutBatch.from_samples([[_sample({"acc": 1.0})]])
    with pytest.raises(RewardError, match=r"output\[0\]\[0\]: reward=None is not a number"):
        RolloutBatch.from_samples([[_sample(None)]])
    with pytest.raises(RewardError, match=r"output\[0\]\[0\]: reward=True is not a number"):
        RolloutBatch.from_samples([[_sample(True)]])
    with pytest.raises(RewardError, match=r"output\[1\]\[0\] and output\[1\]\[1\] are siblings"):
        RolloutBatch.from_samples([[_sample(1.0)], [_sample(1.0, "g"), _sample(0.0, "g")]])


def test_from_samples_uses_the_configured_method():
    out = [[_sample(1.0), _sample(0.0)], [_sample(2.0)]]
    dr = RolloutBatch.from_samples(out, normalization=RewardNormalization(normalize_std=False))
    assert dr.advantages.tolist() == [0.5, -0.5, 0.0]
