"""The rollout-engine protocol and its records.

A rollout engine turns prompt token ids into sampled response token ids, with the log-prob of
each sampled token under the engine's current weights and the reason generation stopped. The
trainer later recomputes the same log-probs; their difference after a weight sync is the
engine-trainer gap the loop checks, so engines report **raw** log-probs: ``log_softmax`` of the
unprocessed logits (temperature, top-p and top-k shape *sampling* only). This is vLLM's default
``logprobs_mode`` and what a Megatron forward computes.

Invariants the tests assert, for every engine:
- ``len(g.token_ids) == len(g.log_probs) <= params.max_new_tokens`` and every log-prob is <= 0;
- ``finish_reason == "stop"`` iff the last token is a stop token or completes a stop string;
  ``"length"`` iff the budget was used up; tokens after the first stop are never returned;
- the budget of a request is ``params.max_new_tokens_for(len(prompt))``: ``max_new_tokens``,
  capped by ``max_context_len - len(prompt)`` when a context limit is set;
- request ``i`` of a call with ``seed=s`` samples with seed ``s + i``: the samples of one group
  are independent draws (identical draws would give zero advantages and no learning) and a call
  is reproducible.
"""

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import attrs
import numpy as np

from vime_pure.errors import VimeError, field_error

if TYPE_CHECKING:  # torch is optional here: only the annotations name it
    import torch

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


class EngineError(VimeError):
    """A rollout engine was misconfigured, is unavailable, or was fed bad input."""


# Typed converters: attrs' mypy plugin reads a field's init type from its converter, and the
# generic ``tuple`` leaves it unsolved.
def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(values)


def _strs(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _check_number(field: str, value: object, lo: float, hi: float, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise field_error(EngineError, field, value, f"must be a number in [{lo}, {hi}]", fix)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one response per request.

    ``top_k=0`` disables top-k; ``temperature=0`` is greedy. ``seed=None`` draws from the
    engine's own RNG stream; otherwise request ``i`` uses seed ``seed + i``.
    ``stop_token_ids``: generation ends after any of them (the engines never add the model's
    EOS on their own: the caller lists every stop token). ``stop``: strings that end
    generation once the decoded response contains one; the response keeps the token that
    completed it (slime's ``--rollout-stop``, vLLM's ``stop``). ``max_context_len``: prompt +
    response tokens at most (``--rollout-max-context-len``).
    Example: ``SamplingParams(max_new_tokens=2, temperature=1.0, seed=7)`` samples two tokens
    per request, request 3 with seed 10; with ``max_context_len=10`` a 9-token prompt gets a
    budget of 1 token.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    max_context_len: int | None = None
    top_log_probs: int = 0

    def __attrs_post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise field_error(EngineError, "max_new_tokens", self.max_new_tokens,
                              "must be a positive integer", "pass e.g. max_new_tokens=2")
        _check_number("temperature", self.temperature, 0.0, 100.0, "use 1.0 for RL, 0 for greedy")
        _check_number("top_p", self.top_p, 1e-6, 1.0, "use 1.0 to disable nucleus sampling")
        for name, fix in (("top_k", "use 0 to disable top-k"),
                          ("top_log_probs", "use 0 to report none")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise field_error(EngineError, name, value, "must be an integer >= 0", fix)
        for tok in self.stop_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise field_error(EngineError, "stop_token_ids", self.stop_token_ids,
                                  "must hold non-negative token ids", "pass e.g. (eos_id,)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise field_error(EngineError, "seed", self.seed, "must be None or an integer >= 0",
                              "derive it from the run seed and the rollout id")
        if not all(isinstance(t, str) and t for t in self.stop):
            raise field_error(EngineError, "stop", self.stop, "must hold non-empty strings",
                              "pass e.g. ('</answer>',)")
        ctx = self.max_context_len
        if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 2):
            raise field_error(EngineError, "max_context_len", ctx,
                              "must be None or an integer >= 2", "pass e.g. 4096")

    def max_new_tokens_for(self, prompt_len: int) -> int:
        """The token budget of a request with ``prompt_len`` prompt tokens.

        Example: ``max_new_tokens=8, max_context_len=10``: a 4-token prompt gets 6, a
        1-token prompt 8. A prompt that leaves no room is an :class:`EngineError`.
        """
        if self.max_context_len is None:
            return self.max_new_tokens
        room = self.max_context_len - prompt_len
        if room < 1:
            raise field_error(EngineError, "max_context_len", self.max_context_len,
                              f"leaves no room for a response after a {prompt_len}-token prompt",
                              "raise --rollout-max-context-len, or drop long prompts with "
                              "--rollout-max-prompt-len")
        return min(self.max_new_tokens, room)

    def request_seed(self, i: int) -> int | None:
        """Seed of request ``i``: ``seed + i`` (None when unseeded)."""
        return None if self.seed is None else self.seed + i


@attrs.frozen(kw_only=True)
class Generation:
    """One sampled response: its token ids, their raw log-probs and why it ended.

    ``weight_version``: the engine's ``weight_version`` the request started under (set by the
    per-request engines, :mod:`vime_shell.engines.async_engine`; None from batched calls).
    ``token_versions``: the weight version that sampled each token, where a sync can land
    inside a request (the per-request fronts, ``--pause-generation-mode``); None where one
    version made them all.
    ``routed_experts``: MoE engines asked for them (``--use-rollout-routing-replay``), the
    experts routed for each prompt and response token, an int array ``[tokens, layers, topk]``
    (``tokens`` may omit the last response token, which the engine never fed back;
    ``vime_pure.data.routes``); None otherwise.
    ``top_token_ids`` / ``top_log_probs``: asked for (``SamplingParams.top_log_probs`` = k),
    each generated position's k most likely tokens, most likely first, and their raw
    log-probs: ``[len(token_ids), k]`` int64 / float32; None otherwise.
    Example: ``Generation(token_ids=(7, 4), log_probs=(-0.1, -2.3), finish_reason="length")``.
    """

    token_ids: tuple[int, ...] = attrs.field(converter=_ints)
    log_probs: tuple[float, ...] = attrs.field(converter=_floats)
    finish_reason: FinishReason
    weight_version: int | None = None
    routed_experts: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)
    token_versions: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_ints))
    top_token_ids: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)
    top_log_probs: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise field_error(EngineError, "log_probs", f"<{len(self.log_probs)} values>",
                              f"must have one entry per token ({len(self.token_ids)} tokens)",
                              "return one log-prob per sampled token")
        if self.token_versions is not None and len(self.token_versions) != len(self.token_ids):
            raise field_error(EngineError, "token_versions",
                              f"<{len(self.token_versions)} values>",
                              f"must have one entry per token ({len(self.token_ids)} tokens)",
                              "record the engine's weight version at each sampled token")
        ids, values = self.top_token_ids, self.top_log_probs
        shapes = (None if ids is None else ids.shape, None if values is None else values.shape)
        if shapes[0] != shapes[1] or ids is not None and (
                ids.ndim != 2 or len(ids) != len(self.token_ids)):
            raise field_error(EngineError, "top_token_ids", shapes[0],
                              f"must match top_log_probs' shape {shapes[1]}, one row per token "
                              f"({len(self.token_ids)} tokens)",
                              "return both, [tokens, k], or neither")
        if self.finish_reason not in FINISH_REASONS:
            raise field_error(EngineError, "finish_reason", self.finish_reason,
                              "is not a known finish reason", f"use one of {FINISH_REASONS}")


    def top_pairs(self) -> list[list[list[float]]] | None:
        """``Sample.rollout_top_log_probs`` of these tokens: per token its top-k as
        ``[token id, log-prob]`` pairs, most likely first; None when not asked for."""
        if self.top_token_ids is None or self.top_log_probs is None:
            return None
        return [[[int(t), float(v)] for t, v in zip(ids, values)]
                for ids, values in zip(self.top_token_ids.tolist(), self.top_log_probs.tolist())]


NamedTensors = Iterable[tuple[str, "torch.Tensor"]]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from an inference engine.

    ``generate``: one :class:`Generation` per prompt, in prompt order.
    ``update_weights_from_tensors``: load HF-named tensors (e.g. ``model.layers.0.mlp.up_proj.
    weight``), as exported by the trainer; every name must exist in the engine's model.
    ``update_weights_from_path``: load a saved HF model directory (``*.safetensors``).
    ``sleep(level)`` / ``wake_up(tags)``: release and re-acquire accelerator memory when the
    engine shares devices with the trainer (vLLM's sleep levels and wake-up tags ``"weights"``
    / ``"kv_cache"``; ``tags=None`` wakes everything); no-ops where that does not apply.
    ``weight_version``: which weights the engine holds: 0 as built; the caller sets it after
    a complete update (``EngineGroup.sync_weights``: a sync streams several buckets, each one
    ``update_weights_from_tensors`` call); ``update_weights_from_path`` bumps it by one.
    """

    name: str
    weight_version: int

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Generation]: ...

    def update_weights_from_tensors(self, named_tensors: NamedTensors) -> None: ...

    def update_weights_from_path(self, path: str | Path) -> None: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None: ...

    def close(self) -> None: ...


def stop_string_end(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
                    stops: Sequence[str]) -> int | None:
    """Length of the shortest prefix of ``token_ids`` whose decoded text contains one of
    ``stops`` (the response keeps the token that completed the stop string), or None.

    A prefix's text only grows with it, so a binary search needs ~log2(n) decodes.
    Example: tokens decoding to ``"ab"``, ``"c</"``, ``"a>"``, ``"zz"`` with
    ``stops=("</a>",)`` give 3.
    """
    def hit(n: int) -> bool:
        text = decode(token_ids[:n])
        return any(s in text for s in stops)

    if not stops or not token_ids or not hit(len(token_ids)):
        return None
    lo, hi = 1, len(token_ids)  # hit(hi) holds; find the smallest such n
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Validate prompt token ids; returns them as lists of ints.

    Example: ``check_prompts([[3, 4]], vocab_size=16) == [[3, 4]]``; ``[[]]`` or ``[[99]]``
    raise :class:`EngineError` naming ``prompts[0]``.
    """
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise field_error(EngineError, f"prompts[{i}]", [],
                              "has no token ids: the rollout function sent an empty request "
                              "(dataset prompts that tokenize to nothing fail at launch)",
                              "give every request at least one prompt token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise field_error(EngineError, f"prompts[{i}]", ids,
                              f"holds token ids {bad} outside the vocabulary [0, {vocab_size})",
                              "tokenize with the engine's own tokenizer")
        out.append(ids)
    return out
