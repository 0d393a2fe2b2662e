"""On-policy distillation from a teacher server (``--use-opd --opd-type sglang``, slime's and
miles'): the teacher's log-prob of every response token of every generated sample, asked of an
HTTP server once the rollout function has returned, on the engine rank that generated it.

slime asks the teacher in its reward function (``--custom-rm-path
slime.rollout.on_policy_distillation.reward_func`` with ``--rm-url``) and moves the reply into
``sample.teacher_log_probs`` in ``--custom-reward-post-process-path
...post_process_rewards``, which also sets every reward to 0. vime asks the teacher here, for
any rollout function, so those two plugin paths (slime's and miles') name this module's
counterparts (``settings/slime_flags.SLIME_VALUES``): :func:`opd_reward`, 0 as theirs.

The teacher is SGLang's native API (``/generate``, what the scripts start). Each sample is one
``POST {"input_ids": tokens, "sampling_params": {"temperature": T, "max_new_tokens": 0,
"skip_special_tokens": false}, "return_logprob": true, "logprob_start_len": 0}`` (``T``:
``--rollout-temperature``, as slime sends); the reply's ``meta_info.input_token_logprobs`` holds
one ``[log-prob, token id, text]`` per input token (the first one's log-prob is null, nothing
predicts it), and the last ``response_length`` entries are the response's.

Which server: ``--opd-teacher-urls NAME=URL ...`` (miles' multi-teacher form) sends a sample to
the URL its ``metadata[--opd-teacher-key]`` names, else to ``default``; otherwise every sample
goes to ``--rm-url``. A request that fails (refused, timed out, HTTP 5xx) is retried as
``--rm-url``'s are (``remote_reward.post_with_retries``), then raises :class:`TeacherError`
naming the URL; a reply without one finite log-prob per token is a :class:`TeacherError`
naming the sample.

Example: ``Teacher.build(cfg).score(samples)`` sets ``s.teacher_log_probs`` on each sample.
"""

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from vime_pure.data.rollout_output import flatten_rollout_output
from vime_pure.errors import VimeError, field_error, one_line
from vime_shell.rollout.remote_reward import RM_URL_TIMEOUT_S, post_with_retries

DEFAULT_TEACHER = "default"  # miles' fallback entry of --opd-teacher-urls
OPD_REWARD = "vime_shell.rollout.teacher:opd_reward"
# slime's and miles' OPD plugins: the reward function that asks the teacher, and the
# post-process that moves its reply onto the sample and zeroes the rewards
ANCHOR_OPD_REWARDS = tuple(f"{a}.rollout.on_policy_distillation.reward_func"
                           for a in ("slime", "miles"))
ANCHOR_OPD_POST_PROCESS = tuple(f"{a}.rollout.on_policy_distillation.post_process_rewards"
                                for a in ("slime", "miles"))
MAX_REQUESTS = 32  # samples in flight at once per engine rank


class TeacherError(VimeError):
    """The teacher server did not give one log-prob per token of a sample."""


def opd_reward(args: Any, sample: Any) -> float:
    """slime's and miles' OPD reward function and post-process, as vime runs them: the reward
    is 0, as their ``post_process_rewards`` sets it (the teacher alone teaches; vime asks it
    for ``teacher_log_probs`` itself, :class:`Teacher`)."""
    return 0.0


def teacher_urls(entries: Sequence[str] | None, flag: str = "--opd-teacher-urls"
                 ) -> dict[str, str]:
    """``NAME=URL`` entries as a mapping (miles' rules: split at the first ``=``, a name only
    once). Example: ``["math=http://a/generate"]`` -> ``{"math": "http://a/generate"}``."""
    urls: dict[str, str] = {}
    for entry in entries or ():
        name, eq, url = str(entry).partition("=")
        if not eq or not name or not url:
            raise field_error(TeacherError, flag, entry, "is not NAME=URL",
                              "pass e.g. math=http://127.0.0.1:13141/generate")
        if name in urls:
            raise field_error(TeacherError, flag, entry, f"names the teacher {name!r} twice",
                              "give every teacher one URL")
        urls[name] = url
    return urls


@attrs.frozen(kw_only=True)
class Teacher:
    """Where each sample's teacher is and how it is asked (module docstring)."""

    urls: Mapping[str, str]  # teacher name -> URL; one DEFAULT_TEACHER entry for --rm-url
    key: str = "opd_teacher"  # the sample metadata entry naming its teacher
    temperature: float = 1.0
    timeout: float = RM_URL_TIMEOUT_S

    @classmethod
    def build(cls, cfg: Any) -> "Teacher | None":
        """The run's teacher server(s), or None unless ``--use-opd --opd-type sglang``."""
        if not cfg.opd_server:
            return None
        urls = teacher_urls(cfg.opd_teacher_urls) or {DEFAULT_TEACHER: cfg.rm_url}
        return cls(urls=urls, key=cfg.opd_teacher_key, temperature=cfg.rollout_temperature,
                   timeout=cfg.reward_timeout or RM_URL_TIMEOUT_S)

    def url_of(self, sample: Any) -> str:
        """The URL of ``sample``'s teacher: its metadata's name, else ``default``."""
        meta = sample.metadata if isinstance(sample.metadata, dict) else {}
        name = meta.get(self.key)
        url = self.urls.get(name) if isinstance(name, str) else None
        if url is None:
            url = self.urls.get(DEFAULT_TEACHER)
        if url is None:
            raise field_error(TeacherError, f"metadata[{self.key!r}]", name,
                              f"names none of the teachers {sorted(self.urls)} and there is no "
                              f"{DEFAULT_TEACHER!r} one",
                              f"add {DEFAULT_TEACHER}=URL to --opd-teacher-urls, or name a "
                              "teacher in every prompt row's metadata")
        return url

    def score(self, output: Any) -> None:
        """Every sample of a rollout output gets ``teacher_log_probs`` (module docstring)."""
        samples = flatten_rollout_output(output).samples
        if not samples:
            return
        with ThreadPoolExecutor(min(MAX_REQUESTS, len(samples)),
                                thread_name_prefix="vime-teacher") as pool:
            found = list(pool.map(self._one, samples, range(len(samples))))
        for sample, log_probs in zip(samples, found):
            sample.teacher_log_probs = log_probs

    def _one(self, sample: Any, k: int) -> list[float]:
        r = int(sample.response_length)
        if r == 0:
            return []
        tokens = [int(t) for t in sample.tokens]
        url = self.url_of(sample)
        reply = post_with_retries(url, {
            "input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"temperature": self.temperature, "max_new_tokens": 0,
                                "skip_special_tokens": False}}, self.timeout,
            error=TeacherError, what=f"teacher {url}", fix="start the teacher server (SGLang's "
            "/generate) or correct --rm-url / --opd-teacher-urls")
        return response_log_probs(reply, len(tokens), r, where=f"{url}, sample {k}")


def response_log_probs(reply: Any, num_tokens: int, response_length: int, *, where: str
                       ) -> list[float]:
    """The last ``response_length`` log-probs of SGLang's ``input_token_logprobs`` (one
    ``[log-prob, id, text]`` per input token). Example: a reply for 4 tokens with log-probs
    ``[None, -1, -2, -3]`` and a response of 2 gives ``[-2.0, -3.0]``."""
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or len(entries) != num_tokens:
        raise TeacherError(
            f"{where}: the reply {one_line(repr(reply))[:160]} has no meta_info."
            f"input_token_logprobs with one entry per input token ({num_tokens}). Fix: point "
            "the URL at SGLang's /generate (return_logprob with logprob_start_len 0).")
    out = []
    for j, entry in enumerate(entries[num_tokens - response_length:]):
        value = entry[0] if isinstance(entry, (list, tuple)) and entry else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise TeacherError(f"{where}: response token {j} has the log-prob entry "
                               f"{one_line(repr(entry))[:80]}, not a finite number. Fix: "
                               "serve the teacher with SGLang's /generate.")
        out.append(float(value))
    return out
