"""Everything about a ``vime train`` run that can be checked before torch is imported.

``launch_checks(cfg)`` reads only files and the configuration: the model directory's
``config.json`` (without transformers), export paths and sizes, that TP divides the vocabulary,
the parallel layout for the launched world (``vime_shell.megatron.layout``), the batching
policy's feasibility (``vime_pure.check_feasible``), that every plugin path
(``--rollout-function-path``, ``--custom-rm-path``) names an importable function, and the
run's files (``check_run_paths``: run directory, ``--load``, ``--save``, replayed dumps). A bad
run then fails with one line in well under a second instead of after the model is built.

Example: ``launch_checks(TrainConfig(tensor_model_parallel_size=2))`` on the embedded model
raises ``ConfigError: tensor_model_parallel_size=2: does not divide the model's
vocab_size=19 ...``.
"""

import os
from pathlib import Path

import attrs

from vime_pure.config import BatchingPolicy, check_feasible
from vime_pure.errors import field_error
from vime_shell.loop.checkpoint_index import require_checkpoint
from vime_shell.loop.config import ConfigError, TrainConfig
from vime_shell.loop.replay import ReplaySource
from vime_shell.loop.run_dir import check_run_dir
from vime_shell.megatron.layout import (TrainLayout, context_parallel_available, resolve_layout,
                                        world_size_from_env)
from vime_shell.models.embedded import build_embedded
from vime_shell.models.hf_config import read_config_summary
from vime_shell.rollout.plugins import load_callable
from vime_shell.storage.sizes import ExportError, parse_size


@attrs.frozen(kw_only=True)
class LaunchPlan:
    """What the checks resolved: the model directory, the layout and the batching policy."""

    hf_dir: Path
    layout: TrainLayout
    policy: BatchingPolicy


def model_dir(cfg: TrainConfig) -> Path:
    """``--hf-checkpoint``, or the embedded model's directory (built on first use)."""
    return Path(cfg.hf_checkpoint).expanduser() if cfg.hf_checkpoint else build_embedded()


def launch_checks(cfg: TrainConfig, hf_dir: Path) -> LaunchPlan:
    """Check ``cfg`` against the model in ``hf_dir`` and the launched world (module docstring)."""
    if not (hf_dir / "config.json").is_file():
        raise field_error(ConfigError, "hf_checkpoint", str(hf_dir), "has no config.json",
                          "pass a Hugging Face model directory, or omit it for the embedded model")
    if cfg.save_hf is not None and Path(cfg.save_hf).expanduser().resolve() == hf_dir.resolve():
        raise field_error(ConfigError, "save_hf", cfg.save_hf,
                          "is the directory the model is loaded from",
                          "pass another --save-hf directory; vime never overwrites its source")
    try:
        parse_size(cfg.save_hf_max_shard_size)
    except ExportError as exc:
        raise ConfigError(f"save_hf_max_shard_size: {exc}") from exc
    summary = read_config_summary(hf_dir)
    tp = cfg.tensor_model_parallel_size
    if summary.vocab_size % tp:  # Megatron's vocab-parallel embedding splits rows evenly
        raise field_error(ConfigError, "tensor_model_parallel_size", tp,
                          f"does not divide the model's vocab_size={summary.vocab_size}",
                          "use a TP size that divides it (the embedded model's 19-token "
                          "vocabulary allows only TP=1), or pad the vocabulary")
    cp = cfg.context_parallel_size
    layout = resolve_layout(
        world_size=world_size_from_env(), num_layers=summary.num_layers,
        supports_context_parallel=cp > 1 and context_parallel_available(), tp=tp,
        pp=cfg.pipeline_model_parallel_size, cp=cp,
        num_layers_per_virtual_stage=cfg.num_layers_per_virtual_pipeline_stage)
    policy = cfg.batching_policy()
    check_feasible(layout.scheduler_layout(), policy)
    for flag, path in (("--rollout-function-path", cfg.rollout_function_path),
                       ("--custom-rm-path", cfg.custom_rm_path)):
        if path is not None:
            load_callable(path, flag=flag)
    check_run_paths(cfg)
    return LaunchPlan(hf_dir=hf_dir, layout=layout, policy=policy)


def check_run_paths(cfg: TrainConfig) -> None:
    """The run's files: the run directory (``run_dir.check_run_dir``), output directories that
    can be created, the ``--load`` checkpoint (it must exist: a mistyped path never starts a
    new run) and every dump ``--load-rollout-data`` will replay (the first one read and
    validated)."""
    check_run_dir(cfg)
    outputs = (("run_dir", cfg.run_dir), ("save", cfg.save), ("save_hf", cfg.save_hf),
               ("save_rollout_data", cfg.save_rollout_data and str(
                   Path(cfg.save_rollout_data).parent)))
    for field, path in outputs:
        if path is not None:
            _check_writable(field, Path(path).expanduser())
    start = 0
    if cfg.load is not None:
        start = int(require_checkpoint(cfg.load).name.split("_")[-1])
    if cfg.load_rollout_data is not None and start < cfg.num_rollout:
        source = ReplaySource(template=cfg.load_rollout_data,
                              fallback=cfg.load_rollout_data_fallback)
        for rid in range(start, cfg.num_rollout):
            source.path(rid)  # a missing dump is a ReplayError naming it, now, not mid-run
        source.load(start)  # DumpFormatError for a damaged or foreign file


def _check_writable(field: str, path: Path) -> None:
    """An output directory can be created where it is asked for: its nearest existing ancestor
    is a writable directory (a typo that runs through a file, or a read-only mount, fails now,
    not at the first checkpoint)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise field_error(ConfigError, field, str(path), f"runs through the file {existing}",
                          "pass a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise field_error(ConfigError, field, str(path), f"is under {existing}, which is not "
                          "writable", "pass a directory you can write to")
