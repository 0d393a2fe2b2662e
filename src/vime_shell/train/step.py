"""One rollout through the trainer: :class:`Step` holds one rollout source and one trainer, and
never asks which source or which mode it holds.

Data flow of ``Step.rollout(k)`` on every trainer rank, top to bottom::

    source.next(k, v)            this rank's part, its chunks' metadata, rank 0's statistics
      ─▶ exchange               metadata to rank 0; plan_rollout (a plain function: checks,
                                advantages, Schedule) broadcast; one all-to-all: each rank
                                receives its DP share (sources/exchange.py, train/planning.py)
      ─▶ records                share_batch: this rank's micro-batches (the core's)
      ─▶ old log-probs          the training forward's own where step 0 is fresh, else a
                                forward-only pass before any update; the weight-sync gap
                                (train/offpolicy.py, train/weight_check.py)
      ─▶ train                  every step of the schedule
      ─▶ source.sync(w, v + 1)  when --update-weights-interval says so; a probe, when the
                                source generated one, is scored on the same weights

``v`` is the trainer's weight version (the rollouts trained so far). Whether batches may be
stale, and by how much, is the source's business and the plan's bound ``K``; a replay's
batches (``source.generates`` False) skip the staleness bound and the gap check.

Example: ``Step(cfg=cfg, plan=plan, trainer=trainer, source=source, gap_tolerance=1e-4)
.rollout(0)`` returns rollout 0's metrics record on every rank.
"""

import functools
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from vime_pure.async_pool import weights_sync_due
from vime_pure.data.batch import RolloutBatch, schedule_for
from vime_pure.data.held_parts import held_rows, join_parts
from vime_pure.data.microbatch import RankBatch, rank_batch, share_batch, with_log_probs
from vime_pure.data.shares import BatchMeta, RankShare, SharePlan
from vime_pure.data.vocab import check_token_ids
from vime_pure.errors import VimeError, field_error
from vime_pure.scheduling.schedule import Schedule
from vime_shell.engines.byte_counts import ByteCounts
from vime_shell.engines.group import EngineGroupError
from vime_shell.megatron.collectives import rank0_result
from vime_shell.megatron.mtp import mtp_keys
from vime_shell.megatron.objective import extra_token_keys
from vime_shell.megatron.offload import offloaded
from vime_shell.megatron.trainer import MegatronTrainer
from vime_shell.settings.launch_plan import LaunchPlan
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.base import Produced, RolloutSource, SyncReport
from vime_shell.sources.replay import DumpWriter
from vime_shell.train import offpolicy
from vime_shell.sources.exchange import ExchangeStats, ShareExchange
from vime_shell.train.planning import PlanInputs, plan_rollout
from vime_shell.train.records import rollout_record, skipped_record
from vime_shell.train.weight_check import GapMeter, check_gap, check_probe_gap, measure_gap


@attrs.frozen(kw_only=True)
class RolloutEvent:
    """What ``on_rollout`` hooks see after each rollout, on every rank.

    ``records``: this rank's micro-batch records (``vime_pure.RankBatch``); ``trace``: what
    this rank's trainer ran, ``(step, sample indices, tokens)`` per micro-batch; ``engine``:
    this rank's rollout engine (after this rollout's weight sync) or None; ``share``: the
    samples this rank received (``vime_pure.data.shares.RankShare``), ``plan`` what every rank
    received, ``exchange`` the bytes this rank moved in the share exchange, ``transfers`` the
    bytes it moved outside it since the previous rollout, per kind (the bridge to engine ranks
    of their own, the leaders' gather: ``vime_shell.engines.byte_counts``), ``meta`` the
    rollout's planned metadata. No rank holds the whole batch: :meth:`gather_batch` assembles
    it from the parts the exchange shipped for inspection (a run started with
    ``gather_batches=False`` ships none, and moves only what training needs).
    """

    rollout_id: int
    metrics: dict
    schedule: Schedule
    records: RankBatch
    trace: tuple
    trainer: MegatronTrainer
    engine: object = None
    share: RankShare | None = None
    plan: SharePlan | None = None
    exchange: ExchangeStats | None = None
    transfers: ByteCounts | None = None
    meta: BatchMeta | None = None
    gather: Callable[[], RolloutBatch] | None = attrs.field(default=None, repr=False)

    def gather_batch(self) -> RolloutBatch:
        """The rollout's whole ``RolloutBatch`` (on any trainer rank; nothing collective)."""
        assert self.gather is not None  # set by Step for every event it sends
        return self.gather()


class Step:
    """One source, one trainer: the module docstring's rollout, on every trainer rank."""

    def __init__(self, *, cfg: TrainConfig, plan: LaunchPlan, trainer: MegatronTrainer,
                 source: RolloutSource, gap_tolerance: float | None,
                 dumps: DumpWriter | None = None,
                 on_rollout: Callable[[RolloutEvent], None] | None = None,
                 gather_batches: bool = True):
        self.cfg, self.plan, self.trainer, self.source = cfg, plan, trainer, source
        self.dumps, self.on_rollout = dumps, on_rollout
        # A hook may gather the batch: the exchange ships it the parts (inspection only).
        self.keep_parts = on_rollout is not None and gather_batches
        # None: a train-only replay, which generates nothing and so checks no gap
        self.gap_tolerance = float("inf") if gap_tolerance is None else gap_tolerance
        self.layout = trainer.layout
        asynchrony = cfg.asynchrony  # the bound is a number here, never a mode
        self.max_staleness = asynchrony.max_staleness if asynchrony.bounded else None
        self.weight_version = 0  # rollouts trained (resumes at rollouts done)
        self.syncs_done = 0  # weight syncs so far (with --load, the resume's counts)
        self.probe_gap: float | None = None  # the last sync's probe gap (None: no probe)
        # The engine-trainer gap is checked on generated batches, unless --no-logprob-check.
        self.logprob_check = source.generates and cfg.effective_logprob_check
        self.rejection = cfg.rejection_config()
        self.mis = cfg.mis_config()
        self.last_schedule: Schedule | None = None
        # Parts stay on their holders (trainer or engine ranks: the source's group); rank 0
        # plans, each rank receives its share (gloo).
        self.exchange = ShareExchange(trainer.dp_rank, group=source.exchange_group)
        self._meta: BatchMeta | None = None  # the last rollout's planned metadata (hooks)
        self._planned: BatchMeta | None = None  # rank 0's, until the rollout is dumped

    # -- the rollout, top to bottom ------------------------------------------------------------
    def rollout(self, rid: int, *, evaluate: bool = False) -> dict:
        """Collective: rollout ``rid`` (after an evaluation when ``evaluate``); its record."""
        with offloaded(self.trainer, self.cfg.offload_train and self.source.generates):
            evaluated = self.evaluate(rid) if evaluate else {}
            t0 = time.perf_counter()
            produced, error = self._next(rid)
            plan, share, extra = self.exchange.distribute(
                produced.part, produced.meta,
                functools.partial(self._plan, self._plan_inputs(rid, produced)),
                what=f"rollout {rid}", error=error, failure=EngineGroupError,
                name_of=self.source.holder_name, keep_parts=self.keep_parts)
        t1 = time.perf_counter()
        if plan is None:  # every prompt filtered out: no step, no sync, the LR stays
            return skipped_record(rid, extra["stats"], lr=self.trainer.current_lr,
                                  rollout_s=t1 - t0, evaluated=evaluated)
        assert share is not None  # a trainer rank has a DP index, so a share
        self._meta = extra.get("meta")
        self._dump(rid, produced)
        self._planned = None
        mine = share_batch(share, plan.schedule, plan.mask_sums, dp_rank=self.trainer.dp_rank,
                           cp_rank=self.trainer.cp_rank, cp_size=self.layout.cp,
                           loss_mode=self.cfg.effective_loss_mode, norm=self._loss_norm(),
                           row_multiple=self.trainer.row_multiple)
        results, mine, gap, corrections, t_old = self._train(rid, plan, share, mine)
        t2 = time.perf_counter()
        if results:  # the trainer's weights changed: a new version
            self.weight_version += 1
            if weights_sync_due(rid, self.cfg.update_weights_interval):
                self.sync(self.weight_version)
        t3 = time.perf_counter()
        record = {**rollout_record(rid, None, plan.schedule, results, gap=gap.mean,
                                   gap_max=gap.max, times=(t1 - t0, t2 - t1, t3 - t2),
                                   fields=extra["fields"]),
                  "old_logprob_s": t_old - t1, "logprob_check": int(self.logprob_check),
                  "probe_gap": self.probe_gap, **extra["stats"], **corrections,
                  **offpolicy.token_means(results, extra_token_keys(self.trainer.config.loss)),
                  **offpolicy.token_means(results, mtp_keys(self.trainer.config.model),
                                          count="mtp_tokens"),
                  **evaluated}
        self._notify(rid, record, plan, share, mine)
        self.last_schedule = plan.schedule
        return record

    def _next(self, rid: int) -> tuple[Produced, BaseException | None]:
        """This rank's part (or its failure, which the exchange reports to every rank)."""
        produced, error = Produced(), None
        try:
            produced = self.source.next(rid, self.weight_version)
            if produced.part is not None and self.plan.vocab_size is not None:
                origin = f" ({produced.origin})" if produced.origin else ""
                check_token_ids(produced.part, self.plan.vocab_size,
                                source=f"rollout {rid}{origin}")
        except Exception as exc:  # noqa: BLE001 - reported to every rank by distribute
            error = exc
        return produced, error

    def _plan_inputs(self, rid: int, produced: Produced) -> PlanInputs:
        return PlanInputs(
            rollout_id=rid, produced=produced, weight_version=self.weight_version,
            generates=self.source.generates, logprob_check=self.logprob_check,
            max_staleness=self.max_staleness, normalization=self.source.normalization,
            layout=self.layout.scheduler_layout(), policy=self.plan.policy,
            flops=self.trainer.flops.per_sample,
            rollout_function=self.cfg.effective_rollout_function_path)

    def _plan(self, inputs: PlanInputs, merged: BatchMeta | None
              ) -> tuple[SharePlan | None, dict]:
        """Rank 0's planning (``plan_rollout``). The planned metadata stays here (a dump's
        index) and travels with the plan only where a hook may gather the batch."""
        plan, extra = plan_rollout(inputs, merged)
        self._planned = extra.pop("meta", None)
        if self.on_rollout is not None:
            extra["meta"] = self._planned
        return plan, extra

    def _dump(self, rid: int, produced: Produced) -> None:
        """``--save-rollout-data``, where the parts are: each holder writes its part, rank 0
        the index (metadata); a batch rank 0 holds alone is written whole, as one file."""
        if self.dumps is None:
            return
        notes = (list(produced.annotations) if self.source.generates and produced.annotations
                 else None)
        holders, planned = self.exchange.holders, self._planned  # rank 0's
        if holders is not None and planned is not None and len(holders) == 1 \
                and produced.part is not None:  # rank 0 is the one holder
            whole = join_parts([produced.part], planned, rows=held_rows([produced.meta]))
            self.dumps.submit(rid, whole, notes)
            return
        if produced.part is not None:
            self.dumps.submit_part(rid, self.exchange.rank, produced.part, notes)
        if holders is not None and planned is not None:
            self.dumps.submit_index(rid, planned, holders)

    def _train(self, rid: int, plan: SharePlan, share: RankShare, mine: RankBatch
               ) -> tuple[list, RankBatch, GapMeter, dict, float]:
        """Old log-probs, then every step of the schedule, the gap checked before the first
        update; ``(results, records, gap, corrections, time the old log-probs were ready)``."""
        del self.trainer.trace[:]
        results: list = []
        gap, corrections = GapMeter(), dict[str, Any]()
        if mine.steps:
            mine, corrections = self._attach_log_probs(rid, plan, share, mine, gap)
        t_old = time.perf_counter()
        if mine.steps:
            def before_update(step: int, metrics: dict) -> None:
                if step == 0 and metrics["gap_tokens"]:  # the generation weights' forward
                    gap.add(metrics["logprob_gap"], metrics["logprob_gap_max"],
                            metrics["gap_tokens"])
                    self._check_gap(rid, gap)

            results = self.trainer.train(mine, before_update)
        return results, mine, gap, corrections, t_old

    def _notify(self, rid: int, record: dict, plan: SharePlan, share: RankShare | None,
                mine: RankBatch) -> None:
        if self.on_rollout is not None:
            self.on_rollout(RolloutEvent(
                rollout_id=rid, metrics=record, schedule=plan.schedule, records=mine,
                trace=tuple(self.trainer.trace), trainer=self.trainer,
                engine=self.source.engine, share=share, plan=plan,
                exchange=self.exchange.stats, transfers=self.source.take_bytes(),
                meta=self._meta, gather=self.gather_batch))
        self._meta = None  # the parts live until the hook ran, not beyond
        self.exchange.parts = []

    def _attach_log_probs(self, rid: int, plan: SharePlan, share: RankShare,
                          mine: RankBatch, gap: GapMeter) -> tuple[RankBatch, dict]:
        """Old log-probs where they differ from the training forward's, reference ones for KL,
        the MIS weights (``--tis-function mis``) and rejection masks (``--use-rs``), judged on
        this rank's ``share``; returns the records and the mismatch metrics.

        When every sample of step 0 is fresh (generated by the weights being trained), step 0
        trains those very weights: its old log-probs are the forward's own, detached (ratio 1),
        and its forward also measures the weight-sync gap, so no separate pass runs for it.
        Later steps follow an update, stale samples came from older weights, a replayed batch
        from another engine, and MIS and rejection need the old log-probs first: their old
        log-probs are recomputed here, before any update; the gap is measured on their fresh
        samples.
        """
        schedule = plan.schedule
        fresh = plan.fresh  # rank 0's fresh_samples, for generated batches
        judged = self.rejection is not None or self.mis is not None  # on whole samples
        shortcut = (fresh is not None and not judged
                    and offpolicy.step_is_fresh(schedule, 0, fresh))
        needed = mine.steps[1:] if shortcut else mine.steps
        records = [mb for step in needed for mb in step.microbatches]
        old, metrics = None, dict.fromkeys(offpolicy.MISMATCH_KEYS)  # None: not measured
        if records:
            old = self.trainer.compute_log_probs(records, mine.num_response_tokens)
            gap_samples = fresh if fresh is not None else np.ones(
                len(schedule.lengths_array), bool)
            gap.add(*self._gap(records, old, gap_samples))
            self._check_gap(rid, gap)
            metrics = offpolicy.mismatch(records, old, self.trainer.owns_loss)
        def frozen(role: str) -> np.ndarray:  # a frozen model's log-probs of this share
            return self.trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens,
                                                  frozen=role)

        ref = frozen("reference") if self.cfg.needs_reference else None
        # A teacher server's log-probs came with the samples (--opd-type sglang).
        teacher = frozen("teacher") if self.cfg.use_opd and self.cfg.opd_type == "megatron" \
            else None
        mine = with_log_probs(mine, old_log_probs=old, ref_log_probs=ref,
                              teacher_log_probs=teacher, old_from_step=1 if shortcut else 0)
        if judged:
            assert old is not None  # judging turns the step-0 shortcut off
            mine = self._judge(mine, share, schedule, old, metrics)
        return mine, metrics

    def _judge(self, mine: RankBatch, share: RankShare, schedule: Schedule, old: np.ndarray,
               metrics: dict) -> RankBatch:
        """Collective: the MIS weights and the rejection masks of this rank's ``share``, on
        whole samples (``old`` completed over the CP ranks first); their metrics join
        ``metrics``."""
        trainer = self.trainer
        full = offpolicy.share_log_probs(old, trainer.cp_group, trainer.device)
        counts = trainer.owns_loss and trainer.cp_rank == 0  # one rank per DP replica
        keep = None
        if self.mis is not None:
            mine, keep, weighed = offpolicy.importance(
                mine, share, schedule, full, self.mis, counts=counts, device=trainer.device,
                weigh=self.cfg.use_tis)
            metrics.update(weighed)
        if self.rejection is not None or keep is not None:
            mine, rejected = offpolicy.reject(
                mine, share, schedule, full, self.rejection, self._loss_norm(),
                counts=counts, device=trainer.device, keep=keep)
            metrics.update(rejected)
        return mine

    # -- the weight sync and its checks --------------------------------------------------------
    def sync(self, version: int) -> SyncReport:
        """Collective: the trainer's HF-named weights into the source's engines as ``version``
        (rollouts trained); a probe the source generated is scored on the same weights."""
        report = self.source.sync(self.trainer.engine_weights, version)
        if report.moved is not None:
            self.syncs_done += 1
        if report.probed:
            self.check_probe(report)
        return report

    def check_probe(self, report: SyncReport) -> None:
        """Collective: score the engine's probe (generated by the weights just synced, see
        ``sources/probe.py``) with the same weights; its gap above the tolerance is a failed
        sync (:class:`WeightSyncError`), as for an on-policy batch."""
        output = rank0_result(f"weight-sync probe of version {self.weight_version}",
                              lambda: report.probe)
        batch = RolloutBatch.from_samples(output)
        policy = attrs.evolve(self.plan.policy, allow_partial_step=True)  # one small group
        mine = rank_batch(batch, schedule_for(batch, self.layout.scheduler_layout(), policy),
                          dp_rank=self.trainer.dp_rank, cp_rank=self.trainer.cp_rank,
                          cp_size=self.layout.cp, loss_mode=self.cfg.effective_loss_mode,
                          norm=self._loss_norm(), row_multiple=self.trainer.row_multiple)
        records = [mb for step in mine.steps for mb in step.microbatches]
        old = self.trainer.compute_log_probs(records, mine.num_response_tokens)
        gap = GapMeter()
        gap.add(*self._gap(records, old, np.ones(batch.num_samples, dtype=bool)))
        self.probe_gap = gap.mean
        check_probe_gap(self.weight_version, gap, self.gap_tolerance)

    def _check_gap(self, rid: int, gap: GapMeter) -> None:
        if self.logprob_check:
            check_gap(rid, gap, tolerance=self.gap_tolerance, syncs_done=self.syncs_done)

    def _gap(self, records: list, old: np.ndarray, samples: np.ndarray
             ) -> tuple[float, float, float]:
        """Collective: the gap of ``records``' fresh ``samples`` (``measure_gap``)."""
        return measure_gap(records, old, samples, owns_loss=self.trainer.owns_loss,
                           device=self.trainer.device)

    # -- evaluation and inspection -------------------------------------------------------------
    def evaluate(self, rid: int) -> dict[str, float]:
        """Collective: every eval set on the engines' current weights, with ``eval_s``."""
        start = time.perf_counter()
        out = self.source.evaluate(rid)
        return {**out, "eval_s": time.perf_counter() - start}

    def _loss_norm(self) -> float:
        """Dr. GRPO's constant (``sample_token_sum_norm``): the generation cap."""
        return float(self.cfg.max_response_len)

    def gather_batch(self) -> RolloutBatch:
        """The last rollout's whole batch: every holder's part, which the exchange shipped to
        this rank (``keep_parts``), joined with the planned ids and advantages. For inspection
        and tests only; training never needs it."""
        if not self.keep_parts:
            raise field_error(VimeError, "gather_batches", False,
                              "kept the exchange from shipping the parts",
                              "start the run with gather_batches=True to gather batches")
        held = self.exchange.parts
        assert self._meta is not None  # shipped with the plan while a hook is set
        return join_parts([p for p, _ in held], self._meta,
                          rows=held_rows([m for _, m in held]))
