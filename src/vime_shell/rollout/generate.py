"""Per-sample generation with slime's contract: ``async def generate(args, sample,
sampling_params) -> Sample | list[Sample]``.

:func:`generate` is the built-in one: **one turn** on the run's engine. It continues
``sample.tokens`` (the prompt, then everything the sample holds so far: earlier turns, tool
output) with at most ``sampling_params["max_new_tokens"] - sample.response_length`` new tokens
(``max_new_tokens`` is the budget of the whole response, as in slime, so resuming an aborted
sample or adding a turn never exceeds it), appends them with loss mask 1 and their raw
log-probs, records the engine's weight version of the segment in ``sample.weight_versions``,
sets ``sample.status`` from the finish reason (stop: completed, length: truncated, abort:
aborted) and ``metadata["response"]`` to the response's text. When a sample continues under
newer weights than its last segment's, ``metadata["resumed_at"]`` records the response length
at that point (the tokens before it are off-policy). A sample with no tokens yet is
encoded from ``metadata["prompt"]`` (by the runtime's ``encode``: with the chat template under
``--apply-chat-template``).

A custom function (``--custom-generate-function-path pkg.mod:fn``) has the same signature and
awaits :func:`generate` for each turn, as slime's custom functions await slime's. Returning a
list is a fan-out: the samples become one rollout group (siblings share the group id).

- ``args``: the run's ``TrainConfig``, read-only: every ``vime train`` flag as an attribute
  (``args.rollout_max_response_len``, ``args.n_samples_per_prompt``, ``args.partial_rollout``,
  ...). ``None`` when a test drives the function without a run.
- ``sample``: a :class:`vime_pure.Sample` with ``metadata`` holding ``prompt``, ``label`` and
  the dataset row's metadata; ``index`` is the request's number in the rollout.
- ``sampling_params``: a dict with slime's keys, a fresh copy per call (mutate it freely):
  ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k`` (0 or -1: off), ``stop`` (strings),
  ``stop_token_ids``, ``sampling_seed``; slime's text-only keys (``skip_special_tokens``,
  ``no_stop_trim``, ``spaces_between_special_tokens``) are accepted and have no effect on
  token ids. A function may lower ``max_new_tokens``, never raise it: :func:`generate` caps it
  at the value the rollout passed (``--rollout-max-response-len``, in evaluation
  ``--eval-max-response-len``) and at the model's context (``max_position_embeddings`` minus
  the prompt), with one warning per function naming the value and the cap
  (:func:`response_budget`).

The engine and tokenizer come from the :class:`GenerateRuntime` the caller installs with
:func:`use_runtime` (the rollout driver :func:`vime_shell.rollout.per_sample.generate_rollout`
does; an asynchronous pool does the same). While the runtime is *aborting* (a partial rollout
reached its boundary), :func:`generate` returns the sample at once with status aborted, so a
custom function should return when it sees ``Status.ABORTED``; one waiting on anything else
(a tool, a sleep) is cancelled there. Either way it is called again with the sample in a later
rollout, and must continue from what the sample holds.

Example (a two-turn custom function)::

    async def generate(args, sample, sampling_params):
        sample = await vime_generate(args, sample, sampling_params)
        if sample.status is Status.ABORTED:
            return sample
        append_tokens(sample, tokenizer_ids_of("#"), loss_mask=0)   # tool output
        return await vime_generate(args, sample, sampling_params)
"""

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from vime_pure.data.sample import Sample, Status
from vime_pure.errors import VimeError, field_error
from vime_pure.token_versions import NO_VERSION, version_runs
from vime_shell.engines.async_engine import AsyncRolloutEngine
from vime_shell.engines.base import SamplingParams
from vime_shell.rollout.tasks import TaskExample

GenerateFn = Callable[[Any, Sample, dict], Any]
FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
# slime's sampling keys that shape text only (detokenization); token ids do not depend on them.
_TEXT_ONLY_KEYS = frozenset({"skip_special_tokens", "no_stop_trim",
                             "spaces_between_special_tokens"})
# metadata key: the response length at which the sample continued under its latest weights
# (the tokens before it came from older ones; see per_sample.offpolicy_prefix).
RESUMED_AT = "resumed_at"
# SamplingParams fields that slime's sampling dict names differently.
_SLIME_NAMES = {"seed": "sampling_seed"}
# Segment k >= 1 of a sample (a later turn, a resumed piece) draws with its sampling seed moved
# by k golden-ratio steps mod 2**62: an independent draw, far from the rollout's structured
# seeds (base + round * 2**20 + turn * 2**18 + request); segment 0 keeps the seed itself.
_SEGMENT_STEP = 0x9E3779B97F4A7C15
log = logging.getLogger("vime.train")  # the run's log (run.logs formats it)


def segment_seed(seed: int, k: int) -> int:
    """Seed of segment ``k`` of a sample whose ``sampling_seed`` is ``seed``.
    Example: ``segment_seed(5, 0) == 5``; ``segment_seed(5, 1) != 6``."""
    return seed if k == 0 else (seed + k * _SEGMENT_STEP) % (1 << 62)


class GenerateError(VimeError):
    """A per-sample generate call was misused (no runtime, bad sampling parameters)."""


@attrs.define(eq=False)
class GenerateRuntime:
    """What :func:`generate` generates with: the per-request engine, the tokenizer, how a prompt
    becomes tokens (``encode``: the rollout's ``encode_prompt``, chat template included; None:
    the text as is), and the partial-rollout switches. ``aborting``: set while in-flight work is being aborted (new
    calls return aborted at once); ``mask_offpolicy`` (``--mask-offpolicy-in-partial-rollout``):
    tokens from older weights get loss mask 0 when their group trains; ``context_len``: the
    model's ``max_position_embeddings`` (None: unknown, not capped); ``warned``: the caps
    already warned about (:func:`response_budget` warns once per function and kind).
    Example: ``GenerateRuntime(engine=async_front(hf_engine), tokenizer=tok)``.
    """

    engine: AsyncRolloutEngine
    tokenizer: Any
    encode: Callable[[TaskExample], list[int]] | None = None
    mask_offpolicy: bool = False
    context_len: int | None = None
    warned: set = attrs.Factory(set)
    aborting: bool = False
    # The fully-async pool under --partial-rollout: weight syncs that aborted this runtime's
    # engine requests (an execution that saw it move is continued, per_sample.PerSample), and
    # the samples of cut-off fan-outs started again there (never trained).
    cuts: int = 0
    restarted: int = 0
    executions: set = attrs.Factory(set)  # the execution tasks a driver registered
    _in_engine: set = attrs.Factory(set)  # tasks awaiting an engine request now

    def abort(self) -> int:
        """Abort everything in flight and refuse new turns until :meth:`resume`: engine
        requests return their partial tokens (status aborted), and registered execution tasks
        doing anything else (a tool call, a sleep) are cancelled where they wait, their sample
        keeping what it holds. Call it from the executions' event loop; returns the engine
        requests ended."""
        self.aborting = True
        ended = self.engine.abort_all()
        current = asyncio.current_task()
        for task in self.executions:
            if task is not current and not task.done() and task not in self._in_engine:
                task.cancel()
        return ended

    def resume(self) -> None:
        self.aborting = False


_RUNTIME: contextvars.ContextVar[GenerateRuntime | None] = contextvars.ContextVar(
    "vime_generate_runtime", default=None)


@contextlib.contextmanager
def use_runtime(runtime: GenerateRuntime) -> Iterator[GenerateRuntime]:
    """Install ``runtime`` for the :func:`generate` calls made in this context (and in the
    asyncio tasks created in it)."""
    token = _RUNTIME.set(runtime)
    try:
        yield runtime
    finally:
        _RUNTIME.reset(token)


@attrs.frozen
class ResponseLimit:
    """The response budget a rollout driver passed its executions (``max_new_tokens`` of the
    ``sampling_params`` it gave) and the function it passed it to, as its flag names it."""

    max_new_tokens: int
    function: str


_LIMIT: contextvars.ContextVar[ResponseLimit | None] = contextvars.ContextVar(
    "vime_generate_limit", default=None)


@contextlib.contextmanager
def use_limit(limit: ResponseLimit) -> Iterator[ResponseLimit]:
    """Cap the :func:`generate` calls made in this context (and its asyncio tasks) at
    ``limit`` (see :func:`response_budget`)."""
    token = _LIMIT.set(limit)
    try:
        yield limit
    finally:
        _LIMIT.reset(token)


def function_name(fn: Callable) -> str:
    """``pkg.mod:fn``, as ``--custom-generate-function-path`` spells a function."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def response_budget(params: SamplingParams, sample: Sample, rt: GenerateRuntime) -> int:
    """The whole response's token budget: ``params.max_new_tokens`` capped at the rollout's
    limit (a function may lower slime's ``max_new_tokens``; raising it past the run's
    ``--rollout-max-response-len`` would train responses the run never allowed) and at the
    model's context after the prompt. Each cap warns once per function.

    Example: a function that sets ``max_new_tokens`` 10000 under ``--rollout-max-response-len
    2`` gets 2, and one warning; with a 60-token prompt and a context of 64, at most 4.
    """
    budget, limit = params.max_new_tokens, _LIMIT.get()
    who = ("a generate call" if limit is None
           else f"--custom-generate-function-path {limit.function}")
    if limit is not None and budget > limit.max_new_tokens:
        _warn_once(rt, (who, "limit"), f"{who} set sampling_params[\"max_new_tokens\"]="
                   f"{budget}, above the rollout's response limit: capped at "
                   f"{limit.max_new_tokens} (--rollout-max-response-len, or "
                   "--eval-max-response-len in evaluation; a generate function may lower it, "
                   "never raise it)")
        budget = limit.max_new_tokens
    prompt_len = len(sample.tokens) - sample.response_length
    if rt.context_len is not None and prompt_len + budget > rt.context_len:
        room = rt.context_len - prompt_len
        _warn_once(rt, (who, "context"), f"{who}: max_new_tokens={budget} after a "
                   f"{prompt_len}-token prompt exceeds the model's context of "
                   f"{rt.context_len} tokens (config.json max_position_embeddings): capped at "
                   f"{max(room, 0)}")
        budget = room
    return budget


def _warn_once(rt: GenerateRuntime, key: tuple[str, str], message: str) -> None:
    if key not in rt.warned:
        rt.warned.add(key)
        log.warning("%s (warned once)", message)


def current_runtime() -> GenerateRuntime:
    runtime = _RUNTIME.get()
    if runtime is None:
        raise GenerateError("vime_shell.rollout.functions.generate was called outside a vime "
                            "rollout (no GenerateRuntime). Fix: call it from a function run by "
                            "--custom-generate-function-path, or wrap the call in "
                            "use_runtime(GenerateRuntime(engine=..., tokenizer=...)).")
    return runtime


def sampling_params_dict(params: SamplingParams) -> dict[str, Any]:
    """slime's sampling dict for ``params``: every field under its own name, but the seed as
    ``sampling_seed`` (slime's key), tuples as lists.

    Example: ``SamplingParams(max_new_tokens=2, seed=5)`` -> ``{"max_new_tokens": 2,
    "temperature": 1.0, ..., "sampling_seed": 5}``.
    """
    out = {}
    for name, value in attrs.asdict(params, recurse=False).items():
        out[_SLIME_NAMES.get(name, name)] = list(value) if isinstance(value, tuple) else value
    return out


def engine_params(sampling_params: Mapping[str, Any] | SamplingParams) -> SamplingParams:
    """The engine's :class:`SamplingParams` from slime's dict (or one already); ``top_k`` -1
    means off, as in SGLang; slime's text-only keys are ignored; unknown keys are an error."""
    if isinstance(sampling_params, SamplingParams):
        return sampling_params
    if not isinstance(sampling_params, Mapping):
        raise field_error(GenerateError, "sampling_params", type(sampling_params).__name__,
                          "is not a dict", "pass the dict the rollout gave you, modified")
    fields = {_SLIME_NAMES.get(f.name, f.name): f.name for f in attrs.fields(SamplingParams)}
    unknown = sorted(set(sampling_params) - set(fields) - _TEXT_ONLY_KEYS)
    if unknown:
        raise field_error(GenerateError, "sampling_params", unknown, "are not sampling keys",
                          f"use {sorted(fields)}")
    kwargs = {fields[k]: v for k, v in sampling_params.items() if k in fields}
    for name in ("stop", "stop_token_ids"):
        if name in kwargs:
            kwargs[name] = tuple(kwargs[name] or ())
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0
    return SamplingParams(**kwargs)


def append_tokens(sample: Sample, token_ids: Sequence[int], *, loss_mask: int = 0,
                  log_probs: Sequence[float] | None = None,
                  versions: Sequence[int] | None = None,
                  top: Sequence[Sequence[Sequence[float]]] | None = None) -> Sample:
    """Append ``token_ids`` to the response: tool output (``loss_mask=0``, log-probs 0, not
    trained) or generated tokens (``loss_mask=1`` with their log-probs and, where the engine
    records them, the weight version of each, ``Generation.token_versions``, and each one's
    top-k log-probs, ``Generation.top_pairs``). The sample's ``token_versions`` and
    ``rollout_top_log_probs`` are each kept while every generated piece records them (tool
    output gets ``NO_VERSION`` and no top-k), else None.

    Example: a 3-token response plus ``append_tokens(s, [7, 8])`` has ``response_length`` 5
    and ``loss_mask`` ``[1, 1, 1, 0, 0]``.
    """
    n = len(token_ids)
    old = sample.response_length
    sample.tokens = list(sample.tokens) + [int(t) for t in token_ids]
    mask = [1] * old if sample.loss_mask is None else list(sample.loss_mask)
    sample.loss_mask = mask + [int(loss_mask)] * n
    logps = [0.0] * old if sample.rollout_log_probs is None else list(sample.rollout_log_probs)
    sample.rollout_log_probs = logps + (list(log_probs) if log_probs is not None else [0.0] * n)
    generated = bool(loss_mask)
    sample.token_versions = _kept(sample.token_versions, old, versions if generated
                                  else [NO_VERSION] * n)
    sample.rollout_top_log_probs = _kept(sample.rollout_top_log_probs, old, top if generated
                                         else [[] for _ in range(n)])
    sample.response_length = old + n
    return sample


def _kept(prev: Any, old: int, added: Sequence | None) -> list | None:
    """A per-token record extended by ``added``, kept while every piece has one (a response
    of ``old == 0`` tokens starts it empty), else None."""
    prev = [] if prev is None and old == 0 else prev
    return None if prev is None or added is None else list(prev) + list(added)


async def generate(args: Any, sample: Sample, sampling_params: Mapping[str, Any]) -> Sample:
    """One turn of ``sample`` on the run's engine (see the module docstring)."""
    del args  # the built-in turn reads nothing from the run's config
    rt = current_runtime()
    params = engine_params(sampling_params)
    if not len(sample.tokens):
        example = TaskExample(prompt=sample.metadata.get("prompt", ""),
                              tools=sample.metadata.get("tools"))
        sample.tokens = (rt.encode(example) if rt.encode is not None else
                         rt.tokenizer(str(example.prompt), add_special_tokens=False)["input_ids"])
        sample.response_length = 0
    if rt.aborting:
        sample.status = Status.ABORTED
        return sample
    budget = response_budget(params, sample, rt) - sample.response_length
    if budget < 1:
        sample.status = Status.TRUNCATED
        return sample
    versions = list(sample.weight_versions)
    if versions and versions[-1] < rt.engine.weight_version:  # resumed under newer weights
        sample.metadata[RESUMED_AT] = sample.response_length
    seed = None if params.seed is None else segment_seed(params.seed, len(versions))
    task = asyncio.current_task()
    rt._in_engine.add(task)  # an abort lets the engine end this request, never cancels it
    try:
        gen = await rt.engine.generate(list(sample.tokens),
                                       attrs.evolve(params, max_new_tokens=budget, seed=seed))
    finally:
        rt._in_engine.discard(task)
        if rt.aborting and task in rt.executions:
            task.cancel()  # as abort() did to the others: at the function's next wait
    if gen.token_ids:
        append_tokens(sample, gen.token_ids, loss_mask=1, log_probs=gen.log_probs,
                      versions=gen.token_versions, top=gen.top_pairs())
        # one entry per segment, or per run of versions where a sync landed inside it
        ran = ([int(gen.weight_version or 0)] if gen.token_versions is None
               else version_runs(gen.token_versions)[0])
        sample.weight_versions = versions + ran
    sample.status = FINISH_STATUS[gen.finish_reason]
    response = list(sample.tokens[len(sample.tokens) - sample.response_length:])
    sample.metadata["response"] = rt.tokenizer.decode(response, skip_special_tokens=True)
    return sample
