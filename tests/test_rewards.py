"""Rewards: built-in exact and math (math-verify) rewards, user rewards by path, group rewards,
and errors that name the prompt and sample."""

import concurrent.futures as futures
import sys
import textwrap
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_pure import Sample
from vime_shell.rollout import math_reward
from vime_shell.rollout.plugins import (DeadlineExpired, PluginError, PluginTimeoutError,
                                        call_plugin, run_within)
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

        def default_math_verify(sample):  # math-verify's own timeouts: signal.alarm
            from math_verify import parse
            return float(bool(parse(sample.metadata["response"])))
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
                                        ("my_rm:odd", "raised Odd: not an Exception")])
def test_a_reward_cannot_end_the_run_or_fake_success(user_rewards, path, kind):
    """SystemExit(0) would end `vime train` with status 0: it becomes a typed error."""
    with pytest.raises(RewardFunctionError, match=f"prompt 3, sample 0: reward {path} {kind}"):
        Rewarder.build(custom_rm_path=path).score([_sample("a")], where="prompt 3")


def test_call_plugin_passes_the_users_ctrl_c_unchanged(user_rewards):
    """A KeyboardInterrupt in the main thread is the user's Ctrl-C: it propagates as it is
    (the CLI reports the interrupted run), never as a plugin error."""
    with pytest.raises(KeyboardInterrupt):
        Rewarder.build(custom_rm_path="my_rm:interrupted").score([_sample("a")])


def test_a_plugins_own_keyboard_interrupt_off_the_main_thread_is_typed(user_rewards):
    """Off the main thread (a pool thread, a --reward-timeout worker) no Ctrl-C lands: a
    KeyboardInterrupt there is the plugin's own, and may not end the run unnamed."""
    kind = "exited with KeyboardInterrupt. Fix: return a result from the function"
    with pytest.raises(RewardFunctionError, match=f"sample 0: reward my_rm:interrupted {kind}"):
        Rewarder.build(custom_rm_path="my_rm:interrupted", reward_timeout=60).score(
            [_sample("a")])
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_raised(
        lambda: Rewarder.build(custom_rm_path="my_rm:interrupted").score([_sample("a")]))))
    thread.start()
    thread.join(timeout=60)
    assert isinstance(errors[0], RewardFunctionError) and kind in str(errors[0])


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test reads what was raised
        return exc
    return None


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
    # The limit is per call: a fast reward under the same limit still works afterwards.
    assert Rewarder.build(rm_type="math", reward_timeout=5).score([_sample("8")]) == [1.0]


def _in_thread(fn):
    """``fn()`` on a pool thread, as the fully-async pool scores: its result or exception."""
    with futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(fn)
        try:
            return future.result(timeout=120)
        except Exception as exc:  # noqa: BLE001 - the test reads what was raised
            return exc


def test_math_reward_runs_in_a_pool_thread():
    """math-verify's own timeouts need the main thread (signal.alarm); vime's bound does not."""
    rewarder = Rewarder.build(rm_type="math")
    assert _in_thread(lambda: rewarder.score([_sample(r"\boxed{8}"), _sample("9")])) == [1.0, 0.0]


@pytest.mark.parametrize("rm_type, response, expected", [
    ("math", r"so \boxed{\frac{16}{2}}", 1.0), ("boxed_math", r"\boxed{8.0}", 1.0),
    ("deepscaler", r"<think>..</think> \boxed{\frac{16}{2}}", 1.0),
    ("boxed_deepscaler", r"<think>..</think> \boxed{8}", 0.0),  # the box holds no </think>
    ("dapo", "Answer: 8", 1.0), ("boxed_dapo", r"\boxed{8}", -1.0)])
def test_every_math_verify_reward_runs_in_a_thread(rm_type, response, expected):
    rewarder = Rewarder.build(rm_type=rm_type)
    assert _in_thread(lambda: rewarder.score([_sample(response)])) == [expected]
    assert rewarder.score([_sample(response)]) == [expected]  # and in the main thread alike


def test_a_slow_math_verify_call_counts_as_no_answer(monkeypatch):
    """Over its bound (math-verify's 5 s default) a parse scores 0, as math-verify's own
    timeout does, in any thread."""
    monkeypatch.setattr(math_reward, "MATH_VERIFY_TIMEOUT_S", 0.05)
    monkeypatch.setattr(math_reward, "parse", lambda text, **kw: threading.Event().wait())
    assert _in_thread(lambda: Rewarder.build(rm_type="math").score([_sample("8")])) == [0.0]


@pytest.mark.parametrize("path", ["my_rm:sleeps", "my_rm:busy"])
def test_reward_timeout_holds_in_a_worker_thread(user_rewards, path):
    """Off the main thread (the fully-async pool's threads) the limit holds as well."""
    rewarder = Rewarder.build(custom_rm_path=path, reward_timeout=0.2)
    error = _in_thread(lambda: rewarder.score([_sample("a")], where="prompt 0"))
    assert isinstance(error, PluginTimeoutError)
    assert f"prompt 0, sample 0: reward {path} did not return within --reward-timeout" \
        in str(error)


def test_a_spinning_reward_given_up_on_stops_running():
    """The abandoned worker of a spinning call is interrupted, so it stops using the CPU."""
    spinning = []

    def spin():
        spinning.append(threading.current_thread())
        while True:
            pass

    with pytest.raises(DeadlineExpired):
        run_within(0.1, spin)
    spinning[0].join(timeout=60)
    assert not spinning[0].is_alive() and spinning[0].daemon


def test_a_reward_that_needs_the_main_thread_is_named_with_the_fix(user_rewards):
    """A plugin using math-verify's defaults (signal.alarm) on a thread: one line with the fix,
    not math-verify's advice about "threaded environments"."""
    rewarder = Rewarder.build(custom_rm_path="my_rm:default_math_verify")
    error = _in_thread(lambda: rewarder.score([_sample("8")], where="prompt 2"))
    assert isinstance(error, RewardFunctionError)
    message = str(error)
    assert message.startswith("prompt 2, sample 0: reward my_rm:default_math_verify raised")
    assert "parsing_timeout=None" in message and message.count("Fix:") == 1


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
                                          r"exited with SystemExit: 3\. Fix: return a result "
                                          "from the function --dynamic-sampling-filter-path "
                                          "names"):
        call_plugin(lambda samples: sys.exit(3), [], what="filter my.mod:keep",
                    flag="--dynamic-sampling-filter-path", where="rollout 2, round 0, prompt 1")
    assert call_plugin(lambda ctx: [ctx], 5, what="rollout function f",
                       flag="--rollout-function-path", where="rollout 0") == [5]


def test_a_failing_built_in_reward_asks_for_a_report_not_a_correction():
    """A built-in (--rm-type) reward is vime's code: its error does not ask the user to correct
    "the function --rm-type names"."""
    def broken(sample):
        raise ValueError("sympy gave up")

    rewarder = Rewarder(fn=broken, name="math", flag="--rm-type")
    with pytest.raises(RewardFunctionError) as info:
        rewarder.score([_sample("8")], where="prompt 1")
    message = str(info.value)
    assert message.startswith("prompt 1, sample 0: reward math raised ValueError: sympy gave up. "
                              "Fix: report it with this response")
    assert "correct the function" not in message and message.count("Fix:") == 1
