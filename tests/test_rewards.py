"""Rewards: built-in exact and math (math-verify) rewards, user rewards by path, group rewards,
and errors that name the prompt and sample."""

import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_pure import Sample
from vime_shell.rollout.plugins import PluginError
from vime_shell.rollout.rewards import (RM_TYPES, Rewarder, RewardFunctionError, exact_match,
                                        exact_match_reward)


def _sample(response: str, label: str | None = "8") -> Sample:
    return Sample(tokens=[1, 2], response_length=1,
                  metadata={"prompt": "3+5=", "response": response, "label": label})


@given(label=st.text("0123456789", min_size=1, max_size=2), response=st.text(max_size=3))
def test_exact_match_rewards_only_the_label(label, response):
    """Theorem: exact match is string equality."""
    assert exact_match(label, label) == 1.0
    assert exact_match(response, label) == float(response == label)
    assert exact_match_reward(_sample(response, label)) == float(response == label)


@pytest.mark.parametrize("response, expected", [
    (r"The sum is \boxed{8}.", 1.0), ("8", 1.0), ("x = 8", 1.0), (r"$\frac{16}{2}$", 1.0),
    (r"\boxed{9}", 0.0), ("nine", 0.0), ("", 0.0)])
def test_math_reward_on_boxed_plain_and_wrong_answers(response, expected):
    assert Rewarder.build(rm_type="math").score([_sample(response)]) == [expected]


def test_built_in_rewards_are_a_registry_and_name_their_needs():
    assert sorted(RM_TYPES) == ["dapo", "deepscaler", "exact", "f1", "gpqa", "math", "remote_rm"]
    assert Rewarder.build().name == "exact"
    with pytest.raises(RewardFunctionError, match=r"sample.metadata\['label'\]"):
        Rewarder.build(rm_type="exact").score([_sample("8", label=None)])
    with pytest.raises(RewardFunctionError, match="rm_type='gpt'"):
        Rewarder.build(rm_type="gpt")
    with pytest.raises(RewardFunctionError, match="group_rm"):
        Rewarder.build(group_rm=True)


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rm.py").write_text(textwrap.dedent("""
        def length_reward(sample):
            return float(len(sample.metadata["response"]))

        def rank_reward(samples):
            order = sorted(range(len(samples)), key=lambda k: samples[k].metadata["response"])
            return [float(order.index(k)) for k in range(len(samples))]

        def broken(sample):
            return {"oops": 1}

        def crashes(sample):
            raise RuntimeError("grader offline")

        def short_group(samples):
            return [1.0]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rm"
    sys.modules.pop("my_rm", None)


def test_custom_sample_and_group_rewards_by_import_path(user_rewards):
    assert Rewarder.build(custom_rm_path="my_rm:length_reward").score([_sample("123")]) == [3.0]
    assert Rewarder.build(custom_rm_path="my_rm.length_reward").score([_sample("1")]) == [1.0]
    group = Rewarder.build(custom_rm_path="my_rm:rank_reward", group_rm=True)
    assert group.score([_sample("b"), _sample("a"), _sample("c")]) == [1.0, 0.0, 2.0]
    with pytest.raises(PluginError, match="--custom-rm-path"):
        Rewarder.build(custom_rm_path="my_rm:nope")


@pytest.mark.parametrize("path, group, match", [
    ("my_rm:broken", False, r"prompt 3, sample 1: reward my_rm:broken returned \{'oops': 1\}"),
    ("my_rm:crashes", False, "prompt 3, sample 0: reward my_rm:crashes raised RuntimeError"),
    ("my_rm:short_group", True, r"prompt 3: group reward my_rm:short_group returned \[1.0\] "
                                "for 2 samples")])
def test_reward_errors_name_the_prompt_and_sample(user_rewards, path, group, match):
    rewarder = Rewarder.build(custom_rm_path=path, group_rm=group)
    fn = rewarder.fn
    if path.endswith("broken"):  # sample 0 fine, sample 1 broken
        rewarder = Rewarder(fn=lambda s: 1.0 if s.metadata["response"] == "a" else fn(s),
                            name=path)
    with pytest.raises(RewardFunctionError, match=match):
        rewarder.score([_sample("a"), _sample("b")], where="prompt 3")
