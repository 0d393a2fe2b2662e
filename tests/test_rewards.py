"""Rewards: built-in exact and math (math-verify) rewards, user rewards by path, group rewards,
and errors that name the prompt and sample."""

import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_pure import Sample
from vime_shell.rollout.plugins import PluginError, PluginTimeoutError, call_plugin
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
    assert sorted(RM_TYPES) == ["exact", "math"]
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

        def exits(sample):
            raise SystemExit(0)

        def interrupted(sample):
            raise KeyboardInterrupt

        class Odd(BaseException):
            pass

        def odd(sample):
            raise Odd("not an Exception")

        def sleeps(sample):
            import time
            time.sleep(30)
            return 1.0

        def busy(sample):
            while True:
                pass
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


@pytest.mark.parametrize("path, kind", [("my_rm:exits", "exited with SystemExit: 0"),
                                        ("my_rm:interrupted", "exited with KeyboardInterrupt"),
                                        ("my_rm:odd", "raised Odd: not an Exception")])
def test_a_reward_cannot_end_the_run_or_fake_success(user_rewards, path, kind):
    """SystemExit(0) would end `vime train` with status 0: it becomes a typed error."""
    with pytest.raises(RewardFunctionError, match=f"prompt 3, sample 0: reward {path} {kind}"):
        Rewarder.build(custom_rm_path=path).score([_sample("a")], where="prompt 3")


def test_reward_errors_keep_their_cause_and_point_at_the_flag(user_rewards):
    with pytest.raises(RewardFunctionError) as info:
        Rewarder.build(custom_rm_path="my_rm:crashes").score([_sample("a")])
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "chained traceback" not in str(info.value) and "--custom-rm-path" in str(info.value)


@pytest.mark.parametrize("path", ["my_rm:sleeps", "my_rm:busy"])
def test_reward_timeout_bounds_each_call(user_rewards, path):
    """A sleeping or spinning reward is interrupted after --reward-timeout seconds."""
    rewarder = Rewarder.build(custom_rm_path=path, reward_timeout=0.2)
    with pytest.raises(PluginTimeoutError, match=f"prompt 0, sample 0: reward {path} did not "
                                                 "return within --reward-timeout 0.2 s"):
        rewarder.score([_sample("a")], where="prompt 0")
    # The limit is per call: a fast reward under the same limit, and math-verify's own
    # SIGALRM timeouts, still work afterwards.
    assert Rewarder.build(rm_type="math", reward_timeout=5).score([_sample("8")]) == [1.0]


@pytest.mark.parametrize("label, response, expected", [
    (43.0, "43", 1.0), (43, "43.0", 1.0), (43.0, "44", 0.0), (0.5, "0.50", 1.0),
    ("43.0", "43", 0.0)])
def test_number_labels_are_compared_as_numbers(label, response, expected):
    """A label 43.0 read from JSON is the number 43 (it used to become the text "43.0")."""
    assert exact_match(response, label) == expected
    math_expected = 1.0 if expected or label == "43.0" else 0.0
    assert Rewarder.build(rm_type="math").score([_sample(response, label)]) == [math_expected]


def test_filters_and_rollout_functions_go_through_the_same_wrapper():
    """call_plugin is the one door into user code (filter, rollout function, reward)."""
    with pytest.raises(PluginError, match=r"rollout 2, round 0, prompt 1: filter my.mod:keep "
                                          r"exited with SystemExit: 3\. Fix: correct the "
                                          "function --dynamic-sampling-filter-path names"):
        call_plugin(lambda samples: sys.exit(3), [], what="filter my.mod:keep",
                    flag="--dynamic-sampling-filter-path", where="rollout 2, round 0, prompt 1")
    assert call_plugin(lambda ctx: [ctx], 5, what="rollout function f",
                       flag="--rollout-function-path", where="rollout 0") == [5]
