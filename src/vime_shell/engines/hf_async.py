"""``HfAsyncFront``: many concurrent per-request ``generate`` calls on one :class:`HfEngine`,
batched at every forward (continuous batching: requests join and leave between forwards).

A request is ``await front.generate(prompt_ids, params)`` from any coroutine. One stepper task
per event loop runs while requests exist; each of its iterations:

1. **admits** waiting requests (up to ``max_concurrency`` rows in flight, the slime
   ``--sglang-server-concurrency`` meaning): their prompts are prefilled together, left-padded,
   and the first token of each is sampled;
2. **decodes** one token for every row in flight: the rows' last tokens go through one forward
   over the shared KV cache (left-padded to the longest row, each row at its own position);
3. **retires** the rows that hit a stop token, a stop string or their budget: their caller's
   future gets the :class:`Generation`, and their cache rows leave the batch;
4. yields to the event loop, so callers submit their next turn before the next forward.

The forward runs in the event loop's thread (the model is not thread-safe, and a forward of a
tiny model is ~1 ms): other coroutines (tools, rewards, sleeps) run between forwards.

Sampling is :func:`vime_shell.engines.hf.choose_tokens` with one ``torch.Generator`` per request
seeded ``params.seed`` (a request is request 0 of its own call), so a request's draw depends on
its seed and its logits only: concurrent requests give the tokens of the batched
``HfEngine.generate`` for the same seeds, and log-probs equal to float noise (~1e-7; the
padding differs). Log-probs are raw (``log_softmax`` of the unprocessed logits).

``abort_all()`` ends every request in flight or waiting at once: each returns its tokens so far
with ``finish_reason="abort"`` (vLLM's behaviour on abort); resubmitting prompt + partial
tokens with the remaining budget continues it (exactly, for greedy sampling).
``weight_version`` is the engine's; each :class:`Generation` records the version it started
under and, per token, the version that sampled it (``token_versions``).

Weight syncs (``--pause-generation-mode``, miles' names): the caller loads weights between two
forwards (on the front's loop), after :meth:`HfAsyncFront.pause`:

- ``in_place``: nothing stops; the rows in flight keep their KV cache, built by the old
  weights, and their next tokens are sampled by the new ones;
- ``retract``: the rows in flight go back to the queue with their tokens; at their next
  admission prompt + tokens are prefilled under the new weights (the KV recomputed), and they
  continue: the tokens already sampled stay the old version's, their context is new;
- ``abort``: every request ends now with its tokens so far (``abort_all``); the caller drops
  or regenerates them.

With unchanged weights ``in_place`` and ``retract`` continue a request token for token as if
nothing happened (``retract`` up to the float noise of a recomputed cache).

Example::

    front = HfAsyncFront(engine, max_concurrency=64)
    gens = await asyncio.gather(*(front.generate([5, 6, 14], SamplingParams(
        max_new_tokens=2, seed=s)) for s in range(8)))
"""

import asyncio
import inspect
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from vime_pure.errors import field_error
from vime_shell.engines.async_engine import checked_pause_mode
from vime_shell.engines.base import (EngineError, FinishReason, Generation, SamplingParams,
                                     check_prompts)
from vime_shell.engines.hf import HfEngine, choose_tokens, top_entries


@attrs.define(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    generator: torch.Generator | None
    version: int
    tokens: list[int] = attrs.Factory(list)
    log_probs: list[float] = attrs.Factory(list)
    versions: list[int] = attrs.Factory(list)  # the weight version that sampled each token
    top: list[tuple[np.ndarray, np.ndarray]] = attrs.Factory(list)  # top_log_probs asked

    def key(self) -> tuple[float, float, int]:
        p = self.params
        return (p.temperature, p.top_p, p.top_k)


@attrs.define
class _Cache:
    """The rows in flight: per-layer keys / values ``[B, heads, T, head_dim]`` left-padded,
    the attention mask ``[B, T]`` and each row's next position (its real token count)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    positions: torch.Tensor


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [B, ..., T(, D)] with zeros prepended along the sequence dim up to ``width``."""
    dim = 2 if t.dim() == 4 else 1
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge(a: _Cache | None, b: _Cache) -> _Cache:
    if a is None:
        return b
    width = max(a.mask.shape[1], b.mask.shape[1])
    kv = [(torch.cat([_pad_left(ka, width), _pad_left(kb, width)]),
           torch.cat([_pad_left(va, width), _pad_left(vb, width)]))
          for (ka, va), (kb, vb) in zip(a.kv, b.kv)]
    return _Cache(kv=kv, mask=torch.cat([_pad_left(a.mask, width), _pad_left(b.mask, width)]),
                  positions=torch.cat([a.positions, b.positions]))


def _layer_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values after a forward. The rows' cache is rebuilt from these
    alone, so a layer that holds other state (linear attention) is an error, never dropped."""
    kv = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin) or not isinstance(
                layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise field_error(EngineError, f"cache layer {i}", type(layer).__name__,
                              "holds more than attention keys and values (linear attention), "
                              "which per-request HF generation cannot carry between steps",
                              "generate with --rollout-engine vllm for this model")
        kv.append((layer.keys, layer.values))
    return kv


def _select(c: _Cache, rows: list[int]) -> _Cache | None:
    """The cache of ``rows`` only, with the columns no kept row uses trimmed off the left."""
    if not rows:
        return None
    idx = torch.tensor(rows, dtype=torch.long)
    mask = c.mask.index_select(0, idx)
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if used.numel() else mask.shape[1]
    kv = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
          for k, v in c.kv]
    return _Cache(kv=kv, mask=mask[:, start:], positions=c.positions.index_select(0, idx))


class HfAsyncFront:
    """The asyncio per-request front of an :class:`HfEngine` (see the module docstring).

    ``decode``: token ids -> text for stop strings (default: the engine's tokenizer).
    """

    def __init__(self, engine: HfEngine, *, max_concurrency: int = 512,
                 decode: Callable[[list[int]], str] | None = None):
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) \
                or max_concurrency < 1:
            raise field_error(EngineError, "--sglang-server-concurrency", max_concurrency,
                              "must be a positive integer", "pass e.g. 512")
        self.engine, self.max_concurrency, self.decode = engine, max_concurrency, decode
        self.name = engine.name
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []
        self._cache: _Cache | None = None
        self._stepper: asyncio.Task | None = None
        model = engine.model
        self._cache_kw = ("cache" if "cache" in inspect.signature(model.forward).parameters
                          else "past_key_values")

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def in_flight(self) -> int:
        """Requests admitted or waiting."""
        return len(self._active) + len(self._waiting)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """One response to ``prompt_ids``, sampled with seed ``params.seed`` (the engine's own
        stream when None); returns when it ends or is aborted."""
        (ids,) = check_prompts([prompt_ids], self.engine.vocab_size)
        params.max_new_tokens_for(len(ids))  # a prompt that fills the context: this caller's error
        if params.stop and self.decode is None:  # the engine's tokenizer (typed error if none)
            self.decode = self.engine._decoder().decode
        loop = asyncio.get_running_loop()
        if self._stepper is not None and self._stepper.get_loop() is not loop:
            # A new event loop (one asyncio.run per rollout): requests of an earlier loop that
            # ended without collecting them can never be delivered; drop them.
            self._active, self._waiting, self._cache, self._stepper = [], [], None, None
        seed = params.seed if params.seed is not None else self.engine.draw_seeds(1)[0]
        generator = (None if params.temperature == 0 else
                     torch.Generator(device=self.engine.device).manual_seed(int(seed)))
        request = _Request(prompt=ids, params=params, future=loop.create_future(),
                           generator=generator, version=self.weight_version)
        self._waiting.append(request)
        if self._stepper is None or self._stepper.done():
            self._stepper = loop.create_task(self._run())
        return await request.future

    def pause(self, mode: str) -> int:
        """Ready the requests in flight for a weight load that follows on this loop (the module
        docstring's sync policies); returns how many requests it touched."""
        if checked_pause_mode(mode) == "abort":
            return self.abort_all()
        if mode == "retract":
            retracted, self._active, self._cache = self._active, [], None
            self._waiting = retracted + self._waiting  # first in line, prefilled again
            return len(retracted)
        return 0  # in place: the rows keep their cache

    def resume(self) -> None:
        """Nothing to resume: the load ran between two forwards, and the next one samples
        with the new weights."""

    def abort_all(self) -> int:
        """End every request now with ``finish_reason="abort"`` and its tokens so far; returns
        how many were ended. Call it from the thread running the requests' event loop (from
        another thread: ``loop.call_soon_threadsafe(front.abort_all)``)."""
        ended = self._active + self._waiting
        self._active, self._waiting, self._cache = [], [], None
        for r in ended:
            self._finish(r, "abort")
        return len(ended)

    # -- the stepper ---------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while self._waiting or self._active:
                with torch.no_grad():
                    self._admit()
                    if self._active:
                        self._decode_step()
                await asyncio.sleep(0)
        except BaseException as exc:  # a failed forward fails every caller, never hangs them
            for r in self._active + self._waiting:
                if not r.future.done():
                    r.future.set_exception(exc)
            self._active, self._waiting, self._cache = [], [], None
            if not isinstance(exc, Exception):
                raise

    def _admit(self) -> None:
        self._waiting = [r for r in self._waiting if not r.future.done()]  # callers cancelled
        room = self.max_concurrency - len(self._active)
        if room <= 0 or not self._waiting:
            return
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        # a retracted row prefills its tokens so far as well (its cache was dropped)
        contexts = [r.prompt + r.tokens for r in joining]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(joining), width), self.engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(joining), width), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            mask[i, width - len(c):] = 1
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=self.engine.model.config)
        logits = self._forward(ids, mask, positions, cache)
        new = _Cache(kv=_layer_kv(cache), mask=mask, positions=mask.sum(-1))
        self._active, self._cache = self._step_rows(self._active, self._cache, joining, new,
                                                    logits)

    def _decode_step(self) -> None:
        c = self._cache
        assert c is not None  # the rows in flight (there are some) have a cache
        last = torch.tensor([[r.tokens[-1]] for r in self._active], dtype=torch.long)
        mask = torch.cat([c.mask, c.mask.new_ones((c.mask.shape[0], 1))], dim=1)
        cache = DynamicCache(ddp_cache_data=c.kv, config=self.engine.model.config)
        logits = self._forward(last, mask, c.positions[:, None], cache)
        grown = _Cache(kv=_layer_kv(cache), mask=mask, positions=c.positions + 1)
        self._active, self._cache = self._step_rows([], None, self._active, grown, logits)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: DynamicCache) -> torch.Tensor:
        device = self.engine.device
        out = self.engine.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                position_ids=positions.to(device), use_cache=True,
                                **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()

    def _step_rows(self, kept: list[_Request], kept_cache: _Cache | None, rows: list[_Request],
                   cache: _Cache, logits: torch.Tensor) -> tuple[list[_Request], _Cache | None]:
        """Sample the next token of each of ``rows`` from ``logits``; retire finished rows;
        return the rows still in flight (``kept`` first) and their cache."""
        chosen = torch.empty(len(rows), dtype=torch.long)
        by_params: dict[tuple, list[int]] = {}
        for i, r in enumerate(rows):
            by_params.setdefault(r.key(), []).append(i)
        for members in by_params.values():
            idx = torch.tensor(members, dtype=torch.long)
            # greedy rows (temperature 0, one key) have no generator and draw nothing
            generators = [g for i in members if (g := rows[i].generator) is not None]
            chosen[idx] = choose_tokens(logits.index_select(0, idx), generators,
                                        rows[members[0]].params).cpu()
        full = torch.log_softmax(logits, dim=-1)
        logp = full.gather(-1, chosen[:, None].to(logits.device))
        staying: list[int] = []
        for i, r in enumerate(rows):
            r.tokens.append(int(chosen[i]))
            r.log_probs.append(float(logp[i, 0]))
            top = top_entries(full[i], r.params.top_log_probs)
            if top is not None:
                r.top.append(top)
            r.versions.append(self.weight_version)
            reason = self._finish_reason(r)
            if reason is None:
                staying.append(i)
            else:
                self._finish(r, reason)
        if len(staying) < len(rows):
            selected = _select(cache, staying)
        else:
            selected = cache
        return kept + [rows[i] for i in staying], (
            kept_cache if selected is None else _merge(kept_cache, selected))

    def _finish_reason(self, r: _Request) -> FinishReason | None:
        p = r.params
        if r.tokens[-1] in p.stop_token_ids:
            return "stop"
        if p.stop:
            assert self.decode is not None  # generate() set it for a request with stop strings
            if any(s in self.decode(r.tokens) for s in p.stop):
                return "stop"
        return "length" if len(r.tokens) >= p.max_new_tokens_for(len(r.prompt)) else None

    @staticmethod
    def _finish(r: _Request, reason: FinishReason) -> None:
        if not r.future.done():
            ids = np.stack([t[0] for t in r.top]) if r.top else None
            values = np.stack([t[1] for t in r.top]) if r.top else None
            r.future.set_result(Generation(token_ids=r.tokens, log_probs=r.log_probs,
                                           finish_reason=reason, weight_version=r.version,
                                           token_versions=r.versions, top_token_ids=ids,
                                           top_log_probs=values))
