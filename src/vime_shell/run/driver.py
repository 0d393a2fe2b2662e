"""The ``vime train`` run: launch, resume, the rollout loop, checkpoints and logging around one
:class:`~vime_shell.train.step.Step` (one rollout source, one trainer).

Data flow of ``run_training``::

    launch_checks ─▶ (engine ranks: serve_rollouts until stop)
    trainer ─┬─ open_source (colocated, replay, or engine ranks of their own) ─▶ Step
             └─ --load: trainer state, source.restore(data state), step.sync(rollouts done)
    for k in start..total: [evaluate] ─▶ step.rollout(k) ─▶ log ─▶ checkpoint (with
        source.state(): the prompt source's position, so a resume continues the order)
    final evaluation ─▶ --save-hf ─▶ trainer.shutdown ─▶ source.close (last)

What one rollout does (generate, exchange, records, old log-probs and the weight-sync check,
train, sync) is :mod:`vime_shell.train.step`'s docstring.

Colocated in one process, or ``torchrun`` / ``vime_shell.megatron.spawn`` processes laid out
DP x TP x PP for the trainer and ``--rollout-num-gpus`` / ``--rollout-num-gpus-per-engine`` for
the engines (default: one engine per rank); only global rank 0 writes files.

Invariants the tests assert: each rank's trainer runs exactly the schedule's micro-batches;
the gap after every sync is below 1e-4 (fp32); parameters change; ``metrics.jsonl`` holds one
record per rollout; a resumed run continues with the same data and metrics; a replay trains on
exactly the dumped samples, group ids and schedule.

Example: ``run_training(TrainConfig(num_rollout=3, run_dir="runs/x"))`` trains the embedded
model on reverse2 for 3 rollouts of 16 prompts x 8 samples and writes ``runs/x/metrics.jsonl``.
"""

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from vime_shell.engines.layout import logprob_gap_tolerance
from vime_shell.engines.remote import Sides, open_sides
from vime_shell.megatron.layout import rank_from_env
from vime_shell.megatron.moe_bridge import num_experts_of
from vime_shell.megatron.platform import detect_platform
from vime_shell.megatron.trainer import MegatronTrainer
from vime_shell.run import run_checkpoint
from vime_shell.run.checkpoint_index import resume_checkpoint
from vime_shell.run.components import engine_options, trainer_config
from vime_shell.run.hf_save import save_hf, saves_hf
from vime_shell.run.interrupts import RunInterrupted, is_interrupt, raise_if_interrupted
from vime_shell.run.launch_checks import launch_checks, model_dir
from vime_shell.run.logs import configure_logging
from vime_shell.run.ownership import claim_run
from vime_shell.run.report import (eval_summary, launch_warnings, rollout_line, run_summary,
                                   shows_line)
from vime_shell.run.run_log import RunLogger
from vime_shell.settings.launch_plan import LaunchPlan
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.open import open_source
from vime_shell.sources.remote import serve_rollouts
from vime_shell.sources.replay import DumpWriter
from vime_shell.train.step import RolloutEvent, Step
from vime_shell.train.weight_check import LogprobCheckError, WeightSyncError

__all__ = ["LogprobCheckError", "RolloutEvent", "TrainResult", "WeightSyncError",
           "claimed_run", "run_training"]


log = logging.getLogger("vime.train")


@attrs.frozen(kw_only=True)
class TrainResult:
    records: list[dict]
    plots: list[Path]
    hf_checkpoint: Path
    start_rollout: int


class _Loop:
    """One run's state on one rank: the trainer, the rollout source and the step that joins
    them; ``run_training`` is the public entry."""

    def __init__(self, cfg: TrainConfig, on_rollout: Callable[[RolloutEvent], None] | None,
                 plan: LaunchPlan, sides: Sides | None = None, gather_batches: bool = True):
        self.cfg, self.plan = cfg, plan
        self.hf_dir = plan.hf_dir
        self.trainer = self._build_trainer()
        self.rank = dist.get_rank()
        options, gap_tolerance = None, cfg.logprob_gap_tolerance
        source = None
        try:  # a failure from here on: what is built goes down, as run_training's finally does
            if plan.engine_layout is not None:  # not a train-only replay
                options = engine_options(cfg, self.trainer.platform.kind == "cuda",
                                         num_experts_of(self.trainer.bridge.hf_config))
                if gap_tolerance is None:
                    gap_tolerance = logprob_gap_tolerance(options.dtype)
            self.source = source = open_source(cfg, plan, options, sides)
            # every trainer rank: a leader writes its part, rank 0 the index or the batch
            self.dumps = (DumpWriter(cfg.save_rollout_data, plan.hf_dir)
                          if cfg.save_rollout_data is not None else None)
            self.step = Step(cfg=cfg, plan=plan, trainer=self.trainer, source=source,
                             gap_tolerance=gap_tolerance, dumps=self.dumps,
                             on_rollout=on_rollout, gather_batches=gather_batches)
        except BaseException:
            self.trainer.shutdown()
            if source is not None:
                source.close()  # last, as in run_training
            raise

    def _build_trainer(self) -> MegatronTrainer:
        cfg, t0 = self.cfg, time.perf_counter()
        trainer = MegatronTrainer.from_hf(
            self.hf_dir, trainer_config(cfg, self.plan.num_rollout),
            tp=cfg.tensor_model_parallel_size,
            pp=cfg.pipeline_model_parallel_size, cp=cfg.context_parallel_size,
            num_layers_per_virtual_stage=cfg.num_layers_per_virtual_pipeline_stage,
            num_virtual_stages=cfg.num_virtual_stages_per_pipeline_rank,
            ep=cfg.expert_model_parallel_size, etp=cfg.expert_tensor_parallel_size,
            first_stage_layers=cfg.decoder_first_pipeline_num_layers,
            last_stage_layers=cfg.decoder_last_pipeline_num_layers, platform=detect_platform())
        if cfg.needs_reference:  # the initial weights (--ref-load when given, as in slime)
            trainer.load_frozen("reference", self.hf_dir)
        if cfg.use_opd and cfg.opd_teacher_load is not None:  # required with it (settings)
            trainer.load_frozen("teacher", cfg.opd_teacher_load)  # an HF dir, as --ref-load
        layout = trainer.layout
        log.info("startup: trainer built in %.1f s (%s, dp %d tp %d pp %d cp %d)",
                 time.perf_counter() - t0, self.hf_dir, layout.dp, layout.tp, layout.pp,
                 layout.cp)
        if trainer.config.lora is not None:
            lora = trainer.config.lora
            params = [p for chunk in trainer.model for p in chunk.parameters()]
            experts = (f" (MoE experts: {lora.expert_layout})" if lora.expert_modules
                       and num_experts_of(trainer.bridge.hf_config) is not None else "")
            log.info("startup: LoRA rank %d (alpha %g) on %s%s: %d of %d parameters train on "
                     "this rank; the engine and --save-hf get the merged weights", lora.rank,
                     lora.alpha, ",".join(lora.megatron_modules), experts,
                     sum(p.numel() for p in params if p.requires_grad),
                     sum(p.numel() for p in params))
        return trainer

    def rollout(self, rid: int) -> dict:
        return self.step.rollout(rid, evaluate=self._evaluates(rid))

    def _evaluates(self, rid: int) -> bool:
        """Before rollout ``rid`` (weights trained on rollouts ``< rid``) every
        ``--eval-interval`` rollouts; ``run_training`` adds one after the last rollout. Not in
        replays: their engine (forge) never generates."""
        cfg = self.cfg
        if not self._evaluates_at_end() or (rid == 0 and cfg.skip_eval_before_train):
            return False
        # without --eval-interval (slime): before the first rollout and after the last
        return rid == 0 if cfg.eval_interval is None else rid % cfg.eval_interval == 0

    def _evaluates_at_end(self) -> bool:
        return self.source.generates and self.cfg.eval_prompt_data is not None

    def save_hf(self, template: str, rollouts_done: int) -> Path:
        """Collective: ``--save-hf`` (``template``) after ``rollouts_done`` rollouts
        (``hf_save.save_hf``)."""
        return save_hf(self.cfg, self.trainer, self.hf_dir, template, rollouts_done)


def run_training(cfg: TrainConfig, *, on_rollout: Callable[[RolloutEvent], None] | None = None,
                 progress: bool | None = None, plan: LaunchPlan | None = None,
                 gather_batches: bool = True) -> TrainResult:
    """Run ``cfg.num_rollout`` rollouts, or ``--num-epoch`` passes over the dataset (from the
    ``--load`` checkpoint's counter, if any).

    Collective over the launched world. Returns the per-rollout records (on every rank) and,
    on rank 0, the PNG plots written. The trainer is shut down at the end, also after a
    failure, so one process may run several trainings in turn (with the same world).
    ``plan``: the ``launch_checks`` result when the caller already ran them (the CLI does,
    before importing this module). ``gather_batches``: an ``on_rollout`` hook may call
    ``RolloutEvent.gather_batch`` (every trainer rank then receives every part of each
    rollout); False for a hook that reads only metrics, shares and bytes.
    """
    _quiet_libraries()
    configure_logging(cfg.log_level, dist.get_rank() if dist.is_initialized()
                      else rank_from_env())
    plan = plan or launch_checks(cfg, model_dir(cfg))
    sides = None
    if plan.roles is not None:  # separate trainer and engine ranks
        platform = detect_platform()
        sides = open_sides(plan.roles, backend=platform.backend)
        if not sides.is_trainer:
            configure_logging(cfg.log_level, sides.rank)
            serve_rollouts(cfg, plan, engine_options(cfg, platform.kind == "cuda"), sides)
            return TrainResult(records=[], plots=[], hf_checkpoint=plan.hf_dir, start_rollout=0)
    with claimed_run(cfg, plan.run_id):  # before the model is built: a second run fails now
        loop = _Loop(cfg, on_rollout, plan, sides, gather_batches)
        try:
            return _run(loop, cfg, progress)
        finally:  # also after a failure: a caller that catches it may start another run
            loop.trainer.shutdown()  # frees Megatron's parallel state
            loop.source.close()  # last: vLLM's teardown ends the world


@contextlib.contextmanager
def claimed_run(cfg: TrainConfig, run_id: str) -> Iterator[None]:
    """Global rank 0 locks the run's directories for the run's lifetime
    (``ownership.claim_run``: another run on them fails; ``--overwrite-run-dir`` moves the
    earlier run aside under the lock). Taken before the process group exists (rank from
    ``RANK``); a failure here ends rank 0, and the launcher (torchrun, ``spawn``) ends the
    others."""
    rank = dist.get_rank() if dist.is_initialized() else rank_from_env()
    if rank != 0:
        yield
        return
    claim, moved = claim_run(cfg, run_id)
    if moved is not None:
        configure_logging(cfg.log_level, rank)
        log.info("moved the earlier run's files in %s to %s/", cfg.run_dir, moved)
    try:
        yield
    finally:
        claim.release()


def _run(loop: _Loop, cfg: TrainConfig, progress: bool | None) -> TrainResult:
    """Resume (``--load``) or start, run the rollouts, evaluate and export: ``run_training``'s
    body, between building the loop and tearing it down."""
    configure_logging(cfg.log_level, loop.rank)
    for warning in launch_warnings(cfg, loop.plan.num_rollout):
        log.warning(warning)
    start = 0
    # --load must hold a checkpoint (a mistyped path never starts afresh; launch checked it and
    # its manifest), except slime's first run of --load X --save X on a missing or empty X
    found = resume_checkpoint(cfg.load, cfg.save, weights=cfg.hf_checkpoint, verify=False)
    if cfg.load is not None and found is None:
        log.info("--load %s holds no checkpoint yet and is the --save directory: starting "
                 "fresh (slime's first run)", cfg.load)
    if found is not None:
        state = run_checkpoint.load(found, loop.trainer, cfg.to_dict())
        start = state.rollouts_done
        loop.step.weight_version = start  # one sync per trained rollout
        loop.source.restore(state.data)
        log.info("resumed from %s at rollout %d", found, start)
        loop.step.sync(start)  # the engines were built from the HF checkpoint, not this one
    if loop.plan.prompts_dropped and loop.rank == 0:
        log.warning("--rollout-max-prompt-len %d dropped %d of the %d prompts of %s",
                    cfg.rollout_max_prompt_len, loop.plan.prompts_dropped,
                    loop.plan.prompts_dropped + len(loop.plan.prompts or ()), cfg.prompt_data)
    total = loop.plan.num_rollout  # --num-rollout, or derived from --num-epoch
    logger = RunLogger(cfg.run_dir, start=start, total=total, enabled=loop.rank == 0,
                       progress=progress, wandb=cfg.to_dict() if cfg.use_wandb else None)
    # ``pending``: the first rollout not yet logged, the one a Ctrl-C interrupts (one landing
    # in a logged rollout's checkpoint save interrupts the next one, not the logged one)
    records, began, pending = [], time.perf_counter(), start
    try:
        for rid in range(start, total):
            raise_if_interrupted()
            record = loop.rollout(rid)
            records.append(record)
            logger.log(record)
            pending = rid + 1
            if rid == start:
                log.info("startup: first rollout done in %.1f s", time.perf_counter() - began)
            if shows_line(record, rid - start, total - start, cfg.log_interval,
                           logger.has_progress_bar):
                logger.line(rollout_line(record))
            _after_rollout(loop, cfg, rid + 1, total)
        if loop._evaluates_at_end() and total > start:  # the trained weights, once more
            final = loop.step.evaluate(total)
            logger.log_eval(total, final)
            logger.line(f"eval after rollout {total - 1}: {eval_summary(final)}")
    except BaseException as exc:
        if is_interrupt(exc):  # Ctrl-C: the CLI says where and how to resume
            raise RunInterrupted(pending, cfg.save, cfg.save_interval) from exc
        raise
    finally:
        plots = logger.finish(loop.step.last_schedule)
        if loop.dumps is not None:
            loop.dumps.close()
    if cfg.save_hf is not None and (not records or not saves_hf(cfg, total, total)):
        log.info("wrote HF checkpoint %s", loop.save_hf(cfg.save_hf, total))
    if records:
        log.info(run_summary(records, time.perf_counter() - began))
    return TrainResult(records=records, plots=plots, hf_checkpoint=loop.hf_dir,
                       start_rollout=start)


def _after_rollout(loop: _Loop, cfg: TrainConfig, done: int, total: int) -> None:
    """Checkpoint (``--save-interval``) and HF export (``--save-hf-interval``) after ``done``
    rollouts, each with a log line."""
    if cfg.save is not None and (done % cfg.save_interval == 0 or done == total):
        if loop.dumps is not None:
            loop.dumps.flush()  # a checkpoint never runs ahead of the dumps
        t0 = time.perf_counter()
        run_checkpoint.save(cfg.save, done, loop.trainer, cfg.to_dict(),
                            data=loop.source.state(), run_id=loop.plan.run_id)
        log.info("checkpoint after %d rollouts saved to %s in %.1f s", done, cfg.save,
                 time.perf_counter() - t0)
    if cfg.save_hf is not None and saves_hf(cfg, done, total):
        t0 = time.perf_counter()
        path = loop.save_hf(cfg.save_hf, done)
        log.info("HF checkpoint after %d rollouts written to %s in %.1f s", done, path,
                 time.perf_counter() - t0)


def _quiet_libraries() -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|mbridge)\.")
    warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True")
    # transformers draws a "Loading weights" bar at every engine (re)load: noise in the log.
    hf_logging.disable_progress_bar()
