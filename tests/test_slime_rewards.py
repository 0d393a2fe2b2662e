"""slime's rule rewards (deepscaler, dapo, f1, gpqa, boxed_*) on reference examples, slime's
reward signatures (sync, async, batched) detected by signature, dict rewards through
--reward-key, and --rm-url against a local HTTP server (retries, concurrency, failure)."""

import http.server
import json
import sys
import textwrap
import threading

import pytest

from vime_pure import Sample
from vime_shell.rollout import remote_reward
from vime_shell.rollout.plugins import PluginError
from vime_shell.rollout.reward_plugins import last_boxed
from vime_shell.rollout.rewards import Rewarder, RewardFunctionError
from vime_shell.settings.train_config import TrainConfig


def _s(response, label="8", **meta) -> Sample:
    return Sample(tokens=[1, 2], response_length=1,
                  metadata={"prompt": "q", "response": response, "label": label, **meta})


def _score(rm_type, response, label="8", **meta):
    return Rewarder.build(rm_type=rm_type).score([_s(response, label, **meta)])[0]


@pytest.mark.parametrize("response, label, expected", [
    ("<think>5+3</think> The answer is \\boxed{8}.", "8", 1.0),
    ("<think>..</think> \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<think>..</think> \\boxed{9}", "8", 0.0),
    ("\\boxed{8}", "8", 0.0),  # no </think>: slime's deepscaler scores non-thinking output 0
    ("###Response so \\boxed{8}", "\\boxed{8}", 1.0),
    ("<think>..</think> 8", "8", 0.0),  # no \boxed{}
])
def test_deepscaler_reference_examples(response, label, expected):
    assert _score("deepscaler", response, label) == expected


@pytest.mark.parametrize("response, label, expected", [
    ("work...\nAnswer: 42", "42", 1.0), ("Answer: $42$", "42.0", 1.0),
    ("Answer: 1,000", "1000", 1.0), ("Answer: 41", "42", -1.0), ("42", "42", -1.0),
])
def test_dapo_reference_examples_train_on_the_score_entry(response, label, expected):
    sample = _s(response, label)
    assert Rewarder.build(rm_type="dapo").score([sample]) == [expected]
    assert sample.metadata["reward_dict"]["acc"] is (expected == 1.0)  # the dict is kept
    assert Rewarder.build(rm_type="dapo", reward_key="acc").score([_s(response, label)]) == \
        [float(expected == 1.0)]


@pytest.mark.parametrize("response, label, expected", [
    ("The Eiffel Tower", "eiffel tower", 1.0), ("the Eiffel tower", "Eiffel Tower in Paris",
                                                 2 * 0.5 / 1.5),
    ("yes", "no", 0.0), ("Paris", "London", 0.0),
])
def test_f1_reference_examples(response, label, expected):
    assert _score("f1", response, label) == pytest.approx(expected)


@pytest.mark.parametrize("response, label, meta, expected", [
    ("Answer: C", "C", {}, 1.0), ("<think>A?</think> The answer is (B)", "B", {}, 1.0),
    ("I pick D", 3, {}, 1.0), ("Answer: A", "C", {}, 0.0),
    ("Answer: B", "blue", {"choices": ["red", "blue", "green", "black"]}, 1.0),
])
def test_gpqa_reference_examples(response, label, meta, expected):
    assert _score("gpqa", response, label, **meta) == expected


def test_boxed_prefix_grades_the_last_box_with_the_named_reward():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x}") == "x"
    assert _score("boxed_exact", "so \\boxed{8}") == 1.0
    assert _score("exact", "so \\boxed{8}") == 0.0
    assert _score("boxed_f1", "\\boxed{Eiffel Tower} Paris", "eiffel tower") == 1.0
    assert _score("boxed_exact", "no box") == 0.0


@pytest.fixture
def slime_rms(tmp_path, monkeypatch):
    (tmp_path / "slime_rm.py").write_text(textwrap.dedent("""
        import asyncio
        async def async_rm(args, sample):
            await asyncio.sleep(0)
            return float(sample.response == sample.label) + args.entropy_coef
        def sync_rm(args, sample):
            return {"score": float(len(sample.response)), "extra": "kept"}
        async def batched_rm(args, samples):
            return [float(i) for i, _ in enumerate(samples)]
        def three(a, b, c):
            return 0.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("slime_rm", None)


def test_slime_reward_signatures_are_detected(slime_rms):
    args = TrainConfig(entropy_coef=0.5)
    rm = Rewarder.build(custom_rm_path="slime_rm.async_rm", args=args)
    assert rm.score([_s("8"), _s("9")]) == [1.5, 0.5]  # args is the run's config
    one = _s("abc")
    assert Rewarder.build(custom_rm_path="slime_rm:sync_rm", args=args,
                          reward_key="score").score([one]) == [3.0]
    assert one.metadata["reward_dict"]["extra"] == "kept"
    batched = Rewarder.build(custom_rm_path="slime_rm:batched_rm", group_rm=True, args=args)
    assert batched.score([_s("a"), _s("b"), _s("c")]) == [0.0, 1.0, 2.0]
    with pytest.raises(PluginError, match="takes 3 positional arguments"):
        Rewarder.build(custom_rm_path="slime_rm:three", args=args)
    with pytest.raises(RewardFunctionError, match="not a finite number"):  # dict, no key
        Rewarder.build(custom_rm_path="slime_rm:sync_rm", args=args).score([_s("a")])


class _Handler(http.server.BaseHTTPRequestHandler):
    fail_first = 0  # requests answered 503 before the server works
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if type(self).fail_first > 0:
            type(self).fail_first -= 1
            self.send_response(503)
            self.end_headers()
            return
        reply = json.dumps({"score": float(body["response"] == body["label"])}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(remote_reward, "RM_URL_BACKOFF_S", 0.01)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Handler.seen, _Handler.fail_first = [], 0
    yield f"http://127.0.0.1:{httpd.server_address[1]}/reward"
    httpd.shutdown()
    httpd.server_close()


def test_rm_url_posts_each_sample_and_retries(server):
    cfg = TrainConfig(rm_url=server, reward_key="score")
    rm = Rewarder.build(rm_url=cfg.rm_url, args=cfg, reward_key=cfg.reward_key)
    _Handler.fail_first = 2  # two 503s, then answers: retried, not failed
    assert rm.score([_s("8"), _s("7"), _s("8")]) == [1.0, 0.0, 1.0]
    assert len(_Handler.seen) == 5
    assert _Handler.seen[-1].keys() == {"prompt", "response", "label"}


def test_rm_url_failure_names_the_url_after_the_retries(server, monkeypatch):
    monkeypatch.setattr(remote_reward, "RM_URL_RETRIES", 1)
    cfg = TrainConfig(rm_url=server, reward_key="score")
    _Handler.fail_first = 10
    with pytest.raises(RewardFunctionError, match=r"--rm-url=http://127\.0\.0\.1:\d+/reward"):
        Rewarder.build(rm_url=cfg.rm_url, args=cfg, reward_key="score").score([_s("8")])
    assert len(_Handler.seen) == 2  # first attempt + one retry


def test_rm_url_scores_the_whole_rollout_concurrently(server, monkeypatch):
    """Every sample of every prompt is in flight at once: with a server that answers only when
    4 requests wait together, 2 prompts x 2 samples finish (one prompt at a time would hang)."""
    barrier = threading.Barrier(4, timeout=50)  # a safety net under the client's 60 s
    monkeypatch.setattr(remote_reward, "RM_URL_RETRIES", 0)
    original = _Handler.do_POST

    def gathered(self):
        barrier.wait()
        original(self)

    monkeypatch.setattr(_Handler, "do_POST", gathered)
    cfg = TrainConfig(rm_url=server, reward_key="score")
    rm = Rewarder.build(rm_url=cfg.rm_url, args=cfg, reward_key="score")
    groups = [[_s("8"), _s("7")], [_s("8"), _s("8")]]
    assert rm.score_groups(groups, lambda p: f"prompt {p}") == [[1.0, 0.0], [1.0, 1.0]]
