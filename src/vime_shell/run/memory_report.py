"""The memory estimate of a ``vime train`` run, from its settings and its model directory.

The one place ``TrainConfig`` flags become a ``vime_pure.memory.MemoryPlan``;
``vime train --dry-run`` prints :func:`estimate_run`'s result. Reads only ``config.json``.

Example: ``estimate_run(cfg, hf_dir, layout, gpu_bytes=80 * GIB).as_gib()["train_peak"]``.
"""

import json
from pathlib import Path

from vime_pure.memory import MemoryEstimate, MemoryPlan, ModelShape, estimate_memory
from vime_shell.megatron.layout import TrainLayout
from vime_shell.settings.train_config import TrainConfig


def memory_plan(cfg: TrainConfig, layout: TrainLayout, *, gpu_bytes: int,
                param_bytes: int = 2) -> MemoryPlan:
    """``cfg``'s layout and memory flags as the estimator's plan (bf16 parameters by default,
    as on CUDA; the engine is colocated unless ``--colocate`` is off)."""
    return MemoryPlan(
        gpu_bytes=gpu_bytes,
        tokens_per_microbatch=cfg.max_tokens_per_gpu or cfg.rollout_max_response_len or 1,
        tp=layout.tp, pp=layout.pp, cp=layout.cp, dp=layout.dp, ep=layout.ep, etp=layout.etp,
        recompute_granularity=cfg.recompute_granularity, recompute_method=cfg.recompute_method,
        recompute_num_layers=cfg.recompute_num_layers,
        distributed_optimizer=cfg.optim_config().use_distributed_optimizer,
        optimizer_cpu_offload=cfg.optimizer_cpu_offload, offload_train=cfg.offload_train,
        colocate=cfg.colocate is not False, engine_share=cfg.rollout_gpu_memory_utilization,
        optimizer=cfg.optimizer, param_bytes=param_bytes)


def estimate_run(cfg: TrainConfig, hf_dir: str | Path, layout: TrainLayout, *,
                 gpu_bytes: int, param_bytes: int = 2) -> MemoryEstimate:
    """Per-GPU bytes of the run (``vime_pure.memory.estimate_memory``)."""
    config = json.loads((Path(hf_dir).expanduser() / "config.json").read_text())
    return estimate_memory(ModelShape.from_hf_config(config),
                           memory_plan(cfg, layout, gpu_bytes=gpu_bytes,
                                       param_bytes=param_bytes))
