"""The model and its rollout engines (section ``model``): which checkpoint, which engine, how
many ranks host it, its memory share and vLLM arguments.

Example: ``EngineArgs(rollout_gpu_memory_utilization=1.5)`` raises
``rollout_gpu_memory_utilization=1.5: must lie in (0, 1) ...``.
"""

import attrs

from vime_pure.errors import field_error
from vime_shell.engines import ENGINE_NAMES
from vime_shell.engines.layout import (DEFAULT_GPU_MEMORY_UTILIZATION,
                                       DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE, ROLLOUT_DTYPES,
                                       EngineLayoutError, check_gpu_memory_utilization)
from vime_shell.settings.common import ConfigError, Record, setting, setting_list

SECTION = "model"


def _f(default, help, choices=None):
    return setting(default, help, SECTION, choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class EngineArgs(Record):
    """The model directory and the engines that generate with it."""

    hf_checkpoint: str | None = _f(None, "HF model dir; default: the embedded tiny Qwen2")
    rollout_engine: str | None = _f(None, "rollout engine; default: by capability",
                                    ENGINE_NAMES)
    rollout_num_gpus: int | None = _f(None, "ranks that host a rollout engine; default: every "
                                      "rank; with --no-colocate, --train-async or "
                                      "--fully-async the last N ranks run engines only (as "
                                      "slime's non-colocated mode)")
    rollout_num_gpus_per_engine: int = _f(1, "ranks (GPUs) per engine: vLLM's tensor-parallel "
                                          "size")
    rollout_dtype: str | None = _f(None, "engine dtype; default: the trainer's (bf16 on CUDA, "
                                   "fp32 on CPU)", ROLLOUT_DTYPES)
    colocate: bool | None = _f(None, "engines sleep while the trainer runs; default: on with "
                               "CUDA vLLM")
    rollout_gpu_memory_utilization: float = _f(DEFAULT_GPU_MEMORY_UTILIZATION,
                                               "share of each GPU the awake engine may claim")
    update_weight_buffer_size: int = _f(DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE, "bytes per weight-"
                                        "sync bucket (a decoder layer is never split)")
    rollout_enable_expert_parallel: bool = _f(False, "vLLM expert parallelism inside each "
                                              "engine (MoE): each engine rank holds and is "
                                              "sent only its experts")
    rollout_enforce_eager: bool = _f(False, "vLLM without CUDA graphs (faster start, slower "
                                     "decode)")
    prefill_num_servers: int | None = _f(None, "slime's prefill-decode disaggregation (its "
                                         "SGLang router's prefill servers); vime's engines "
                                         "prefill and decode each request themselves, so it "
                                         "is accepted with a launch note: the same rollouts, "
                                         "another serving layout")
    vllm_engine_args: tuple[str, ...] | None = setting_list(
        "vLLM engine arguments KEY=VALUE; what --vllm-KEY VALUE and the mapped --sglang-X "
        "flags become", SECTION)

    def _check(self) -> None:
        if self.prefill_num_servers is not None and self.prefill_num_servers < 1:
            raise field_error(ConfigError, "--prefill-num-servers", self.prefill_num_servers,
                              "is not a server count", "pass 1 or more, or drop the flag")
        try:
            check_gpu_memory_utilization(self.rollout_gpu_memory_utilization)
        except EngineLayoutError as exc:
            raise ConfigError(str(exc)) from exc
        bad = next((a for a in self.vllm_engine_args or () if "=" not in a.strip("=")), None)
        if bad is not None:
            raise field_error(ConfigError, "--vllm-engine-args", bad, "is not KEY=VALUE",
                              "pass e.g. --vllm-engine-args max_num_seqs=64")
