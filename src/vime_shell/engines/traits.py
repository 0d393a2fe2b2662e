"""What one rollout engine is and can do, readable before anything is built: ``EngineTraits``.

Every engine-specific decision outside this package reads the chosen engine's traits
(``vime_shell.engines.engine_traits(cfg.rollout_engine)``) instead of comparing its name:

- the launch checks: the engine layout (:mod:`vime_shell.engines.layout`: ``tensor_parallel``,
  ``joins_world``, per-request support and the world it runs in), ``--rollout-enable-expert-
  parallel`` (``expert_parallel``), routing replay on CPU (``routes_need_cuda``), the sampling
  temperature (``max_temperature``), and whether ``--vllm-engine-args`` apply
  (``takes_engine_args``);
- the defaults: ``--rollout-engine`` by capability (``preferred_with_cuda``), ``--colocate`` on
  CUDA (``colocate_on_cuda``), work-queue claims per engine (``tail_bound``);
- the build: the class ``target`` names (``per_request_target`` when the run generates per
  sample) builds itself from the run's settings with ``Class.from_options(hf_dir, options,
  layout, seed=)``, the engine-specific build arguments being its own business; ``front`` wraps
  a batched engine for per-request calls (:mod:`vime_shell.engines.async_engine`).

The record is torch-free and names classes as ``"module:Class"`` strings: an engine module
imports its heavy dependencies (transformers, vllm) at load, so it is imported only when its
engine is built. Messages name an engine by ``label`` (``"vLLM"``, ``"the HF engine"``).

Example: ``EngineTraits(name="echo", label="the echo engine", target="pkg.echo:EchoEngine")``
is an engine with no tensor parallelism, no per-request API and no package to install;
registered in ``vime_shell.engines.ENGINES``, ``--rollout-engine echo`` runs it.
"""

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import attrs

from vime_pure.errors import field_error
from vime_shell.engines.base import EngineError
from vime_shell.models.hf_config import MODEL_TYPE_ALIASES


def load_target(target: str) -> type[Any]:
    """The class ``"module:Class"`` names (imports the module)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@attrs.frozen(kw_only=True)
class EngineTraits:
    """One engine's description (module docstring); every field but the first three has the
    answer of an engine that can do nothing special."""

    name: str  # --rollout-engine's value
    label: str  # how messages name it
    target: str  # "module:Class" of the batched engine (RolloutEngine, with from_options)
    package: str | None = None  # the import package it needs, looked up without importing it
    install: str = ""  # the fix when ``package`` is missing
    preferred_with_cuda: bool = False  # the default engine where CUDA is and it is installed
    colocate_on_cuda: bool = False  # --colocate's default on CUDA: sleep around training
    tail_bound: bool = False  # a call lasts as long as its longest response, even on CPU
    tensor_parallel: bool = False  # shards the attention heads over an engine's ranks
    joins_world: str | None = None  # why every rank of a multi-rank world must host an engine
    front: str | None = None  # "module:Class" of the per-request front of a batched engine
    per_request_target: str | None = None  # "module:Class" built for per-sample generation
    per_request_max_gpus: int | None = None  # per-sample generation: engines this big at most
    per_request_limit: str = ""  # why per-sample generation needs so small an engine
    expert_parallel: bool = False  # splits a MoE model's experts over an engine's ranks
    routes_need_cuda: str | None = None  # what returns routed experts only on CUDA
    max_temperature: float | None = None  # the largest sampling temperature it accepts
    takes_engine_args: bool = False  # --vllm-engine-args (and the mapped --sglang-X flags)
    # model_types whose config.json it reads only as the checkpoint's remote code, which vime
    # never runs (vime reads them as their aliases, models/hf_config.MODEL_TYPE_ALIASES)
    remote_code_types: tuple[str, ...] = ()
    # model_types it serves only on CUDA (their attention kernels), and why
    cuda_only_types: tuple[str, ...] = ()
    cuda_only_why: str = ""

    def cannot_serve(self, model_type: str, cuda: Callable[[], bool]) -> str | None:
        """Why it cannot serve a ``model_type`` checkpoint on this machine (``cuda``: asked only
        where the answer matters), or None."""
        if model_type in self.remote_code_types:
            return (f"reads a {model_type} config.json only as the checkpoint's remote code, "
                    "which vime never runs (it reads the model as "
                    f"{MODEL_TYPE_ALIASES[model_type]})")
        if model_type in self.cuda_only_types and not cuda():
            return f"serves {model_type} on CUDA only: {self.cuda_only_why}"
        return None

    @property
    def per_request(self) -> bool:
        """Whether it serves per-sample generation (through a front, or as its own engine)."""
        return self.front is not None or self.per_request_target is not None

    def available(self) -> bool:
        """True when its package can be imported (without importing it)."""
        return self.package is None or importlib.util.find_spec(self.package) is not None

    def engine_class(self, *, per_request: bool = False) -> type[Any]:
        """The class to build (``per_request``: for a run that generates per sample); imports
        its module."""
        if not self.available():
            raise field_error(EngineError, "rollout_engine", self.name,
                              f"{self.package} is not installed", self.install)
        chosen = self.per_request_target if per_request and self.per_request_target else None
        return load_target(chosen or self.target)

    def default_colocate(self, cuda: bool) -> bool:
        """``--colocate``'s default: sleep around training where the engine can (CUDA)."""
        return cuda and self.colocate_on_cuda
