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

Top-k distillation (``--opd-log-prob-top-k K``, miles'): the engine reported each generated
token's ``K`` most likely tokens (``Sample.rollout_top_log_probs``); the request adds
``"token_ids_logprob"``, the sorted ids of all of them (or, with ``--opd-topk-per-position``,
``"token_ids_logprob_positions"``: one id list per input position, for a patched server), and
``"top_logprobs_num": K`` for a strategy that reads the teacher's own top-k. The reply's
``meta_info.input_token_ids_logprobs`` / ``input_top_logprobs`` hold one list of ``[log-prob,
id, text]`` per input token (the first a placeholder); the last ``response_length`` are the
response's. :func:`vime_pure.distillation.top_k_reverse_kl` turns them into
``sample.opd_reverse_kl``, which replaces ``teacher_log_probs``.

Example: ``Teacher.build(cfg).score(samples)`` sets ``s.teacher_log_probs`` on each sample.
"""

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from vime_pure.data.rollout_output import flatten_rollout_output
from vime_pure.distillation import TEACHER_TOP, DistillationError, LogProbs, top_k_reverse_kl
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
    top_k: int = 0  # --opd-log-prob-top-k; 0: the sampled token's log-prob only
    strategy: str = "only-student"  # --opd-top-k-strategy
    weight_mode: str = "student_p"  # --opd-reward-weight-mode
    per_position: bool = False  # --opd-topk-per-position

    @classmethod
    def build(cls, cfg: Any) -> "Teacher | None":
        """The run's teacher server(s), or None unless ``--use-opd --opd-type sglang``."""
        if not cfg.opd_server:
            return None
        urls = teacher_urls(cfg.opd_teacher_urls) or {DEFAULT_TEACHER: cfg.rm_url}
        return cls(urls=urls, key=cfg.opd_teacher_key, temperature=cfg.rollout_temperature,
                   timeout=cfg.reward_timeout or RM_URL_TIMEOUT_S, top_k=cfg.opd_log_prob_top_k,
                   strategy=cfg.opd_top_k_strategy, weight_mode=cfg.opd_reward_weight_mode,
                   per_position=cfg.opd_topk_per_position)

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
        """Every sample of a rollout output gets ``teacher_log_probs``, or with
        ``--opd-log-prob-top-k`` ``opd_reverse_kl`` (module docstring)."""
        samples = flatten_rollout_output(output).samples
        if not samples:
            return
        with ThreadPoolExecutor(min(MAX_REQUESTS, len(samples)),
                                thread_name_prefix="vime-teacher") as pool:
            found = list(pool.map(self._one, samples, range(len(samples))))
        field = "opd_reverse_kl" if self.top_k else "teacher_log_probs"
        for sample, values in zip(samples, found):
            setattr(sample, field, values)

    def _one(self, sample: Any, k: int) -> list[float]:
        r = int(sample.response_length)
        if r == 0:
            return []
        tokens = [int(t) for t in sample.tokens]
        url = self.url_of(sample)
        where = f"{url}, sample {k}"
        student = self._student_top(sample, r, where) if self.top_k else None
        reply = post_with_retries(url, self._request(tokens, student), self.timeout,
                                  error=TeacherError, what=f"teacher {url}",
                                  fix="start the teacher server (SGLang's /generate) or correct "
                                  "--rm-url / --opd-teacher-urls")
        if student is None:
            return response_log_probs(reply, len(tokens), r, where=where)
        top = (response_entries(reply, "input_top_logprobs", len(tokens), r, where)
               if self.strategy in TEACHER_TOP else [{}] * r)
        scored = response_entries(reply, "input_token_ids_logprobs", len(tokens), r, where)
        try:
            return top_k_reverse_kl(student, top, scored, strategy=self.strategy,
                                    weight_mode=self.weight_mode).tolist()
        except DistillationError as exc:
            raise TeacherError(f"{where}: {exc}") from None

    def _request(self, tokens: list[int], student: list[LogProbs] | None) -> dict[str, Any]:
        """SGLang's scoring request for ``tokens`` (module docstring)."""
        body: dict[str, Any] = {
            "input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"temperature": self.temperature, "max_new_tokens": 0,
                                "skip_special_tokens": False}}
        if student is None:
            return body
        if self.strategy in TEACHER_TOP:
            body["top_logprobs_num"] = self.top_k
        if self.per_position:  # response position j is input position len(tokens) - r + j
            body["token_ids_logprob_positions"] = (
                [[] for _ in range(len(tokens) - len(student))] + [list(m) for m in student])
        else:
            body["token_ids_logprob"] = sorted({y for m in student for y in m})
        return body

    def _student_top(self, sample: Any, r: int, where: str) -> list[LogProbs]:
        """The engine's top-k of each response token (``Sample.rollout_top_log_probs``)."""
        top = sample.rollout_top_log_probs
        if top is None or len(top) != r:
            raise TeacherError(
                f"{where}: --opd-log-prob-top-k {self.top_k} needs the engine's top-k log-probs "
                f"of each of the {r} response tokens, and the sample has "
                f"{'none' if top is None else len(top)}. Fix: generate with vime's rollout "
                "functions (they ask the engine for them), or set "
                "sample.rollout_top_log_probs in a custom one.")
        return [{int(y): float(v) for y, v in entries} for entries in top]


def response_entries(reply: Any, field: str, num_tokens: int, response_length: int,
                     where: str) -> list[LogProbs]:
    """The last ``response_length`` entries of SGLang's per-input-token list ``field``
    (``input_token_ids_logprobs``, ``input_top_logprobs``: per token a list of ``[log-prob,
    id, text]``) as ``{id: log-prob}`` maps. Example: ``[None, [[-1.0, 5, "a"]]]`` with a
    response of 1 gives ``[{5: -1.0}]``."""
    entries = _meta_list(reply, field, num_tokens, where, ", top_logprobs_num, token_ids_logprob")
    out: list[LogProbs] = []
    for j, lists in enumerate(entries[num_tokens - response_length:]):
        try:
            out.append({int(e[1]): float(e[0]) for e in lists or () if e is not None})
        except (TypeError, ValueError, IndexError):
            raise TeacherError(f"{where}: meta_info.{field} of response token {j} is "
                               f"{one_line(repr(lists))[:80]}, not [log-prob, id, text] "
                               "entries. Fix: serve the teacher with SGLang's /generate.") from None
    return out


def _meta_list(reply: Any, field: str, num_tokens: int, where: str, how: str = "") -> list:
    """``reply['meta_info'][field]``, checked to hold one entry per input token."""
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    entries = meta.get(field) if isinstance(meta, dict) else None
    if not isinstance(entries, list) or len(entries) != num_tokens:
        raise TeacherError(
            f"{where}: the reply {one_line(repr(reply))[:160]} has no meta_info.{field} with "
            f"one entry per input token ({num_tokens}). Fix: point the URL at SGLang's "
            f"/generate (return_logprob with logprob_start_len 0{how}).")
    return entries


def response_log_probs(reply: Any, num_tokens: int, response_length: int, *, where: str
                       ) -> list[float]:
    """The last ``response_length`` log-probs of SGLang's ``input_token_logprobs`` (one
    ``[log-prob, id, text]`` per input token). Example: a reply for 4 tokens with log-probs
    ``[None, -1, -2, -3]`` and a response of 2 gives ``[-2.0, -3.0]``."""
    entries = _meta_list(reply, "input_token_logprobs", num_tokens, where)
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
