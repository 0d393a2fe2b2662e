"""``--debug-rollout-only`` (slime's flag): generate, reward and dump, with no trainer and no
optimizer: the engines serve the initial weights for every rollout.

Each rollout is produced exactly as in training (``RolloutProducer``: prompts, generation,
rewards, dynamic sampling), built into the ``RolloutBatch``, dumped with
``--save-rollout-data`` and logged to ``metrics.jsonl`` with its schedule's shape; the loss
fields are NaN, since nothing trains. Useful to measure generation alone, or to record dumps
that ``--load-rollout-data`` replays into a training later.

Example: ``vime train --debug-rollout-only --num-rollout 3 --save-rollout-data
d/r_{rollout_id}.npz`` writes three dumps and three records.
"""

import time
from pathlib import Path

import torch
import torch.distributed as dist

from vime_pure.data.batch import schedule_for
from vime_shell.engines.group import EngineGroup
from vime_shell.megatron.platform import detect_platform, ensure_process_group
from vime_shell.run.components import engine_options
from vime_shell.run.driver import TrainResult, claimed_run
from vime_shell.run.interrupts import RunInterrupted, is_interrupt, raise_if_interrupted
from vime_shell.run.logs import configure_logging
from vime_shell.run.run_log import RunLogger
from vime_shell.settings.launch_plan import LaunchPlan
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.replay import DumpWriter
from vime_shell.sources.rollouts import RolloutProducer
from vime_shell.train.records import rollout_record, skipped_record


def run_rollouts_only(cfg: TrainConfig, plan: LaunchPlan, *,
                      progress: bool | None = None) -> TrainResult:
    """Collective over the world: ``plan.num_rollout`` rollouts, no training (module doc)."""
    with claimed_run(cfg, plan.run_id):  # the run's directories, as a training holds them
        return _rollouts(cfg, plan, progress)


def _rollouts(cfg: TrainConfig, plan: LaunchPlan, progress: bool | None) -> TrainResult:
    platform = detect_platform()
    ensure_process_group(platform)
    rank = dist.get_rank()
    configure_logging(cfg.log_level, rank)
    engines = EngineGroup.build(plan.hf_dir, plan.built_engine_layout("--debug-rollout-only"),
                                engine_options(cfg, torch.cuda.is_available()))
    dumps = (DumpWriter(cfg.save_rollout_data, plan.hf_dir)
             if cfg.save_rollout_data is not None and rank == 0 else None)
    logger = RunLogger(cfg.run_dir, start=0, total=plan.num_rollout, enabled=rank == 0,
                       progress=progress, wandb=cfg.to_dict() if cfg.use_wandb else None)
    records, schedule, rid = [], None, 0
    try:
        producer = RolloutProducer(cfg, plan, engines)
        for rid in range(plan.num_rollout):
            raise_if_interrupted()
            start = time.perf_counter()
            produced = producer.produce(rid)  # collective; the batch on rank 0
            if produced is None:
                continue
            batch, stats = produced
            if batch is None:  # the filter removed every prompt group: nothing to dump
                record = skipped_record(rid, stats.as_record(), lr=None, evaluated={},
                                        rollout_s=time.perf_counter() - start)
                records.append(record)
                logger.log(record)
                continue
            if dumps is not None:
                dumps.submit(rid, batch, list(stats.annotations) or None)
            schedule = schedule_for(batch, plan.layout.scheduler_layout(), plan.policy)
            record = {**rollout_record(rid, batch, schedule, [], gap=None, gap_max=None,
                                       times=(time.perf_counter() - start, 0.0, 0.0)),
                      **stats.as_record()}
            records.append(record)
            logger.log(record)
    except BaseException as exc:
        if is_interrupt(exc):  # Ctrl-C: the CLI says where it stopped
            raise RunInterrupted(rid, None, unsaved="--debug-rollout-only saves none") from exc
        raise
    finally:
        plots = logger.finish(schedule)
        if dumps is not None:
            dumps.close()
        engines.close()
    return TrainResult(records=records, plots=plots, hf_checkpoint=Path(plan.hf_dir),
                       start_rollout=0)
