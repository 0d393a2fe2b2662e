"""The per-request engine API: many concurrent ``generate`` calls, each one response.

:class:`AsyncRolloutEngine` is what a per-sample ``generate(args, sample, sampling_params)``
function (:mod:`vime_shell.rollout.generate`) and an asynchronous generation pool need:

- ``await generate(prompt_ids, params) -> Generation``: one response, sampled with seed
  ``params.seed`` (``params.request_seed(0)``), its raw log-probs, ``finish_reason`` and the
  ``weight_version`` it was generated under. Any number may be in flight; the engine runs at
  most ``max_concurrency`` at once and queues the rest;
- ``abort_all() -> int``: every request in flight or queued returns now with
  ``finish_reason="abort"`` and its tokens so far (partial rollouts, weight updates). The HF
  front runs in its callers' event loop (call it from that loop's thread); the vLLM engine
  runs its own loop on a thread (call it from anywhere but that thread);
- ``pause(mode) -> int`` / ``resume()``: around a weight load that meets requests in flight
  (``--pause-generation-mode``: ``in_place``, ``retract``, ``abort``; the fully-async pools);
  ``pause`` returns the requests it retracted or ended, and every token keeps the version
  that sampled it (``Generation.token_versions``);
- ``weight_version``: the version of the engine's weights (0 as built, set at every sync);
- ``in_flight``: requests admitted or queued.

Implementations, by the batched engine they front (its traits' ``front``, found by
``RolloutEngine.name`` in ``vime_shell.engines.ENGINES``): ``hf``:
:class:`vime_shell.engines.hf_async.HfAsyncFront`, an asyncio front batching the requests
waiting at each forward; ``vllm``: :class:`vime_shell.engines.vllm_async.VllmAsyncEngine`,
vLLM's V1 ``AsyncLLM`` (its own engine, multiprocess: the traits' ``per_request_target``). An
engine that already implements this protocol is its own front.

Example::

    front = async_front(engine, max_concurrency=64)
    gen = await front.generate([5, 6, 14], SamplingParams(max_new_tokens=2, seed=3))
"""

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from vime_pure.errors import field_error
from vime_pure.token_versions import PAUSE_MODES
from vime_shell.engines import ENGINES, engines_with
from vime_shell.engines.base import EngineError, Generation, RolloutEngine, SamplingParams
from vime_shell.engines.traits import load_target

DEFAULT_CONCURRENCY = 512  # slime's --sglang-server-concurrency default


@runtime_checkable
class AsyncRolloutEngine(Protocol):
    """See the module docstring."""

    name: str

    @property
    def weight_version(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams
                       ) -> Generation: ...

    def abort_all(self) -> int: ...

    def pause(self, mode: str) -> int: ...

    def resume(self) -> None: ...


def checked_pause_mode(mode: str) -> str:
    """``mode`` when it is a sync policy (``--pause-generation-mode``), else a typed error."""
    if mode not in PAUSE_MODES:
        raise field_error(EngineError, "--pause-generation-mode", mode, "is not a sync policy",
                          f"use one of {PAUSE_MODES}")
    return mode


def async_front(engine: RolloutEngine | AsyncRolloutEngine, *,
                max_concurrency: int = DEFAULT_CONCURRENCY,
                decode: Callable[[list[int]], str] | None = None) -> AsyncRolloutEngine:
    """The per-request front of ``engine`` (``engine`` itself when it is one already).

    ``decode`` (token ids -> text) lets the front detect stop strings.
    """
    if hasattr(engine, "abort_all"):
        return engine  # type: ignore[return-value]
    target = _front(engine)
    if target is None:
        raise field_error(EngineError, "--rollout-engine", engine.name,
                          "has no per-request (asynchronous) API",
                          f"use --rollout-engine {engines_with(lambda t: t.per_request)}")
    return load_target(target)(engine, max_concurrency=max_concurrency, decode=decode)


def has_per_request_api(engine: Any) -> bool:
    """Whether :func:`async_front` serves ``engine``: it is a per-request engine, or its
    traits name a front for it."""
    return hasattr(engine, "abort_all") or _front(engine) is not None


def _front(engine: Any) -> str | None:
    traits = ENGINES.get(engine.name)  # a stand-in engine of a test may be in no registry
    return None if traits is None else traits.front
