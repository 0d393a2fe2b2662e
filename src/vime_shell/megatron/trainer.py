"""Megatron-core train and log-prob steps over the core's micro-batch records.

Purpose: consume a rank's ``RankBatch`` (``vime_pure.rank_batch``) unchanged. Each optimizer
step runs exactly the step's ``K`` records through ``get_forward_backward_func()``; the loss is
scaled so Megatron's and DDP's averaging cancel (:mod:`vime_shell.megatron.objective`); the LR
schedule advances by the step's real group count ``G_s``; the step report is
``vime_pure.reduce_train_step`` / ``reduce_metrics`` over every rank's partial sums, gathered
with :mod:`vime_shell.megatron.collectives`.

Wiring that matters (each is silently wrong when missing):

- Megatron DDP with ``config.no_sync_func`` and ``config.finalize_model_grads_func`` (and
  ``grad_sync_func`` under ``overlap_grad_reduce``), so overlapped reduction happens once, after
  the last micro-batch;
- every virtual-pipeline chunk gets its own iterator over the **same** micro-batch list;
- ``opt_param_scheduler.step(increment=G_s)``, so a partial step of 8 groups moves the schedule
  by 8, not by a full step;
- under ``overlap_param_gather`` the all-gather of updated shards waits for the next forward,
  so export and checkpoint force it first (else ranks read stale shards);
- under ``--use-rollout-routing-replay`` every chunk's routers get the record's routes right
  before that chunk's forward, and the pending routes are cleared after every schedule run
  (:mod:`vime_shell.megatron.routing_replay`).

Invariants (tested in ``tests/shell``): final loss and parameters after k steps are equal across
DP1, DP2, DP2 + distributed optimizer + overlap, TP2, PP2 and PP2xVPP2 (fp32, 1e-5); the
micro-batches and tokens each rank ran equal the schedule's; log-probs equal transformers'.

Example::

    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=OptimConfig(lr=1e-4)))
    mine = rank_batch(batch, schedule, dp_rank=trainer.dp_rank, cp_rank=trainer.cp_rank,
                      cp_size=trainer.layout.cp, loss_mode="group_token_mean",
                      row_multiple=trainer.row_multiple)
    logps = trainer.compute_log_probs(mine.microbatches, mine.num_response_tokens)
    results = trainer.train(with_log_probs(mine, old_log_probs=logps))  # one per step
"""

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mbridge.core.util import unwrap_model
from megatron.core import parallel_state as mpu
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       finalize_model_grads)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from vime_pure.data.microbatch import RankBatch, StepBatch, TrainMicroBatch
from vime_pure.errors import VimeError, field_error
from vime_pure.metrics import Metric
from vime_pure.torch_ops.loss import token_weights
from vime_shell.megatron import checkpoint, mtp
from vime_shell.megatron.bridge import (build_model_chunks, export_hf_weights, hf_state_dict,
                                        make_bridge, read_hf_config)
from vime_shell.megatron.collectives import gather_metrics, gather_step_report
from vime_pure.scheduling.flops import FlopsModel
from vime_shell.megatron.config import OptimConfig, StepResult, TrainerConfig  # noqa: F401
from vime_shell.megatron.cuda_compat import native_torch
from vime_shell.megatron.lora import attach_lora, merged
from vime_shell.megatron.muon import build_muon_optimizer
from vime_shell.megatron.mla_bridge import is_mla
from vime_shell.megatron.layout import (TrainLayout, UnsupportedLayoutError,
                                        check_mla_tensor_parallel, resolve_layout,
                                        sequence_parallel_on, world_size_from_env)
from vime_shell.megatron.moe_bridge import num_experts_of
from vime_shell.megatron.offload import OffloadReport, StorageOffload, trainer_tensors
from vime_shell.engines.sync import buckets
from vime_shell.megatron.objective import (STEP_KEYS, TOKEN_KEYS, extra_token_keys,
                                           loss_factor, microbatch_objective,
                                           response_log_probs)
from vime_shell.megatron.platform import Platform, detect_platform, initialize_parallel
from vime_shell.megatron.routing_replay import RouteReplayer
from vime_shell.megatron.tensors import Layout, MicroBatchTensors, cpu_layout, to_tensors
from vime_shell.storage.untrained import is_mtp_tensor


def _model_platform(platform: Platform, config: TrainerConfig) -> Platform:
    """The platform the model is built for: LoRA wraps Megatron's own linear layers
    (lora.py), so a LoRA run builds the local spec, with its fusions, packing and parallelism,
    even where TransformerEngine is installed."""
    return platform.local_spec() if config.lora is not None else platform


def _sequence_parallel(config: TrainerConfig, layout: TrainLayout, platform: Platform) -> bool:
    """Whether Megatron's sequence parallelism runs (``layout.sequence_parallel_on``)."""
    return sequence_parallel_on(config.sequence_parallel, tp=layout.tp, cp=layout.cp,
                                transformer_engine=platform.transformer_engine)


def _natively(loss_fn, row, output):
    """``loss_fn(row, output)`` outside the CPU device mode (see ``cuda_compat.native_torch``)."""
    with native_torch(model=True):
        return loss_fn(row, output)


def _with_mtp_report(loss_fn, row, mtp_report: dict, output):
    """:func:`_natively` with the forward's MTP sums in the report (``mtp_loss``)."""
    loss, report = _natively(loss_fn, row, output)
    return loss, {**report, **mtp_report}


def mtp_position_weights(row: MicroBatchTensors, *, factor: float, depth: int) -> torch.Tensor:
    """Each position's MTP loss weight ``[rows, columns]``, aligned with ``row.labels``: the
    policy's ``m / D`` of the response token it predicts (``token_weights``) times ``factor``,
    0 elsewhere and at positions ``< depth`` of a sample (``vime_shell.megatron.mtp``)."""
    weights = torch.zeros(row.labels.numel(), dtype=torch.float32, device=row.labels.device)
    weights[row.logit_index] = token_weights(row.loss_mask.float(), row.token_sample,
                                             row.denominators, torch.float32) * factor
    return torch.where(row.position_ids >= depth, weights.view_as(row.labels), 0.0)


class MegatronTrainer:
    """Megatron-core model chunks, DDP, optimizer and LR scheduler on this rank.

    Build with :meth:`from_hf` (initialises distributed + Megatron parallel state) or, when the
    parallel state exists already, the constructor. All methods are collective over the world.
    """

    def __init__(self, hf_dir: str | Path, platform: Platform, layout: TrainLayout,
                 config: TrainerConfig = TrainerConfig()):
        platform = _model_platform(platform, config)
        self.platform, self.layout, self.config = platform, layout, config
        self.sequence_parallel = _sequence_parallel(config, layout, platform)
        # Sequence parallelism splits each packed row over the TP ranks: rows are padded to it.
        self.row_multiple = layout.tp if self.sequence_parallel else 1
        self.bridge = make_bridge(hf_dir, platform, config.model, layout,
                                  sequence_parallel=self.sequence_parallel)
        # The forward FLOPs model picks each record's cheaper CPU attention layout (tensors.py).
        self.flops = FlopsModel.from_hf_config(self.bridge.hf_config,
                                               config.model.moe_router_topk)
        chunks = build_model_chunks(self.bridge, platform, layout)
        if config.lora is not None:  # frozen base, trainable adapters (lora.py)
            attach_lora(chunks, config.lora, self.bridge.config, seed=config.seed)
        self.model = self._wrap(chunks)
        self.optimizer, self.scheduler = self._optimizer()
        self.dp_rank = mpu.get_data_parallel_rank()
        self.cp_rank = mpu.get_context_parallel_rank()
        # The ranks that score one share's tokens between them (None: no CP to complete).
        self.cp_group = mpu.get_context_parallel_group() if layout.cp > 1 else None
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if platform.kind == "cuda" else torch.device("cpu")
        # Only the last pipeline stage computes losses; TP ranks hold identical copies.
        self.owns_loss = (mpu.is_pipeline_last_stage(ignore_virtual=True)
                          and mpu.get_tensor_model_parallel_rank() == 0)
        self.trace: list[tuple[int, tuple[int, ...], int]] = []  # (step, samples, tokens) run
        self.steps_done = 0
        # frozen models by role: "reference" (the KL penalty), "teacher" (on-policy distillation)
        self.frozen: dict[str, list[torch.nn.Module]] = {}
        self._offload = StorageOffload()
        self.offload_report: OffloadReport | None = None
        # --use-rollout-routing-replay: the routers take the engine's experts (routing_replay)
        self.replay = (RouteReplayer(self.bridge.config, mpu.get_tensor_model_parallel_rank(),
                                     layout.tp)
                       if config.model.moe_enable_routing_replay else None)

    @classmethod
    def from_hf(cls, hf_dir: str | Path, config: TrainerConfig = TrainerConfig(), *,
                tp: int = 1, pp: int = 1, cp: int = 1,
                num_layers_per_virtual_stage: int | None = None, ep: int = 1,
                etp: int | None = None, first_stage_layers: int | None = None,
                last_stage_layers: int | None = None, num_virtual_stages: int | None = None,
                platform: Platform | None = None) -> "MegatronTrainer":
        """Detect the platform (unless given), resolve the layout for the launched world,
        initialise distributed + Megatron parallel state, build. Flags map 1:1 to Megatron's
        ``--tensor-model-parallel-size`` etc. (``ep``: ``--expert-model-parallel-size``,
        ``first_stage_layers``: ``--decoder-first-pipeline-num-layers``,
        ``num_virtual_stages``: ``--num-virtual-stages-per-pipeline-rank``); a layout the
        platform cannot run raises ``UnsupportedLayoutError`` before anything is built."""
        platform = _model_platform(platform or detect_platform(), config)
        world = dist.get_world_size() if dist.is_initialized() else world_size_from_env()
        hf_config = read_hf_config(hf_dir)
        if etp not in (None, tp) and not platform.transformer_engine \
                and num_experts_of(hf_config) is not None:  # dense: no experts to split
            raise UnsupportedLayoutError(
                f"expert_tensor_parallel_size={etp}: without TransformerEngine the experts are "
                "Megatron's SequentialMLP, whose weights mbridge splits like the dense ones (over "
                f"tp={tp}). Fix: drop --expert-tensor-parallel-size here (it defaults to the "
                "TP size).")
        layout = resolve_layout(world_size=world, num_layers=hf_config.num_hidden_layers,
                                supports_context_parallel=platform.supports_context_parallel,
                                tp=tp, pp=pp, cp=cp,
                                num_layers_per_virtual_stage=num_layers_per_virtual_stage,
                                ep=ep, etp=etp, num_experts=num_experts_of(hf_config),
                                first_stage_layers=first_stage_layers,
                                last_stage_layers=last_stage_layers,
                                num_virtual_stages=num_virtual_stages)
        check_mla_tensor_parallel(layout.tp, mla=is_mla(hf_config),
                                  sequence_parallel=_sequence_parallel(config, layout, platform))
        initialize_parallel(layout, platform, seed=config.seed)
        return cls(hf_dir, platform, layout, config)

    # -- construction ---------------------------------------------------------------------
    def _wrap(self, chunks: list[torch.nn.Module]) -> list[DistributedDataParallel]:
        tconfig = self.bridge.config
        if self.platform.dtype is torch.bfloat16:
            chunks = [Float16Module(tconfig, c) for c in chunks]
        o = self.config.optim
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=o.overlap_grad_reduce,
            overlap_param_gather=o.overlap_param_gather,
            use_distributed_optimizer=o.use_distributed_optimizer)
        model = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c,
                                         disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        for chunk in model:
            chunk.broadcast_params()
        single = len(model) == 1
        no_sync = [c.no_sync for c in model]
        tconfig.no_sync_func = no_sync[0] if single else no_sync
        tconfig.finalize_model_grads_func = finalize_model_grads
        if o.overlap_grad_reduce:
            grad_sync = [c.start_grad_sync for c in model]
            tconfig.grad_sync_func = grad_sync[0] if single else grad_sync
        if o.overlap_param_gather:
            param_sync = [c.start_param_sync for c in model]
            tconfig.param_sync_func = param_sync[0] if single else param_sync
        return model

    def _optimizer(self):
        o = self.config.optim
        bf16 = self.platform.dtype is torch.bfloat16
        # Muon's chain builds its Adam(W) part from this same config (muon.py)
        build = get_megatron_optimizer if o.optimizer == "adam" else \
            partial(build_muon_optimizer, settings=o.muon)
        optimizer = build(
            OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr,
                            weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                            bf16=bf16, params_dtype=self.platform.dtype,
                            use_distributed_optimizer=o.use_distributed_optimizer,
                            optimizer_cpu_offload=o.optimizer_cpu_offload,
                            # all of the state, Megatron-LM's --optimizer-offload-fraction default
                            optimizer_offload_fraction=1.0 if o.optimizer_cpu_offload else 0.0,
                            overlap_cpu_optimizer_d2h_h2d=o.overlap_cpu_optimizer_d2h_h2d,
                            # TE's FusedAdam; without TE torch's Adam keeps fp32 state, as
                            # this does at Megatron's default state dtypes
                            use_precision_aware_optimizer=o.use_precision_aware_optimizer
                            and self.platform.transformer_engine),
            self.model)
        self.bridge.config.grad_scale_func = optimizer.scale_loss
        return optimizer, lr_scheduler(optimizer, o)

    # -- data --------------------------------------------------------------------------------
    def _tensors(self, records: Sequence[TrainMicroBatch]) -> list[MicroBatchTensors]:
        for r in records:
            if (r.cp_size, r.cp_rank) != (self.layout.cp, self.cp_rank):
                raise field_error(VimeError, "record", f"cp {r.cp_rank}/{r.cp_size}",
                                  f"was cut for another CP rank than this one "
                                  f"({self.cp_rank}/{self.layout.cp})",
                                  "build records with rank_batch(..., cp_size=trainer.layout.cp, "
                                  "cp_rank=trainer.cp_rank)")
            if self.replay is not None:
                self.replay.check(r)
        return [to_tensors(r, self.layout_of(r), self.device) for r in records]

    def layout_of(self, record: TrainMicroBatch) -> Layout:
        """THD with TransformerEngine; on CPU the record's cheaper exact layout by FLOPs."""
        if self.platform.packing == "thd":
            return "thd"
        return cpu_layout(record.seq_lengths.tolist(), self.flops)

    def _iterators(self, rows: list[MicroBatchTensors]):
        """One iterator per model chunk, each over the same list (what interleaving needs)."""
        iters = [iter(rows) for _ in self.model]
        return iters if len(iters) > 1 else iters[0]

    def _forward_step(self, loss_fn, record_step: int | None, mtp_weights=None):
        """Megatron's forward step over the rows; ``mtp_weights(row)``: train the MTP layers
        on the row with those per-position weights (``vime_shell.megatron.mtp``)."""
        def forward_step(data_iterator: Iterator[MicroBatchTensors], model):
            row = next(data_iterator)
            if record_step is not None and model is self.model[0]:
                self.trace.append((record_step, tuple(row.record.sample_indices.tolist()),
                                   row.num_tokens))
            if self.replay is not None:
                assert row.routed_experts is not None  # _tensors' replay.check refused none
                self.replay.before_forward(model, row.routed_experts)
            chunk = unwrap_model(model)
            inputs = contextlib.nullcontext() if mtp_weights is None else \
                mtp.mtp_inputs(chunk, row.labels, mtp_weights(row))
            # No labels: the last stage returns vocab-parallel logits [rows, T, V/tp], of which the
            # loss needs only the rows that predict response tokens.
            with native_torch(model=True), inputs:  # no CUDA name in the forward: skip the CPU mode
                out = model(row.tokens, row.position_ids, row.attention_mask,
                            packed_seq_params=row.packed_seq_params)
            if mtp_weights is not None:
                return out, partial(_with_mtp_report, loss_fn, row, mtp.pop_report(chunk))
            return out, partial(_natively, loss_fn, row)
        return forward_step

    def _run(self, rows: list[MicroBatchTensors], loss_fn, forward_only: bool, record_step=None,
             model: list[torch.nn.Module] | None = None, mtp_weights=None):
        group = self.layout.scheduler_layout().microbatch_multiple  # 1 without vpp
        if self.layout.vpp > 1 and len(rows) % group:
            raise field_error(VimeError, "num_microbatches", len(rows),
                              f"is not a multiple of microbatch_group={group}, which the "
                              f"interleaved schedule (vpp={self.layout.vpp}) needs",
                              "build the records from a Schedule planned for this layout "
                              "(TrainLayout.scheduler_layout())")
        try:
            return get_forward_backward_func()(
                forward_step_func=self._forward_step(loss_fn, record_step, mtp_weights),
                data_iterator=self._iterators(rows), model=model or self.model,
                num_microbatches=len(rows), seq_length=max(r.seq_length for r in rows),
                micro_batch_size=1, forward_only=forward_only)
        finally:
            if self.replay is not None:
                self.replay.clear()

    # -- steps -------------------------------------------------------------------------------
    def train_step(self, step: StepBatch,
                   before_update: Callable[[dict[str, float | None]], None] | None = None
                   ) -> StepResult:
        """One optimizer step over the step's records (this rank's ``K`` micro-batches).

        ``before_update(metrics)`` sees the reduced step report after the forward-backward and
        before the optimizer step (the loop checks the weight-sync gap there, so a broken sync
        never updates the weights).
        """
        if not step.microbatches:
            raise field_error(VimeError, "microbatches", (), "is empty",
                              "pass a step of rank_batch(...) with its micro-batches")
        rows = self._tensors(step.microbatches)
        cfg = self.config.loss
        factor = loss_factor(step.microbatches[0], self.layout.dp, self.layout.cp)

        def loss_fn(row: MicroBatchTensors, output: torch.Tensor):
            logp, entropy = response_log_probs(output, row, with_entropy=True,
                                               recompute=self.config.recompute_loss_function)
            return microbatch_objective(logp, row, cfg, factor, entropy=entropy,
                                        cp_group=self.cp_group)

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Megatron's schedule scales the returned loss by cp / K and the MTP loss (through
        # MTPLossAutoScaler) by 1 / K: the factor times cp treats both alike
        mtp_weights = None if self.config.model.mtp_loss_scaling_factor is None else \
            partial(mtp_position_weights, factor=factor * self.layout.cp,
                    depth=self.bridge.config.mtp_num_layers)
        reports = self._run(rows, loss_fn, forward_only=False, record_step=self.steps_done,
                            mtp_weights=mtp_weights)
        metrics = self._reduce(reports, step)
        if before_update is not None:
            before_update(metrics)
        grad_norm, skipped = self._update()
        if not skipped:  # Megatron's rule: a skipped iteration does not move the LR schedule
            self.scheduler.step(increment=step.num_groups)
        self.steps_done += 1
        return StepResult(metrics=metrics, num_groups=step.num_groups,
                          num_microbatches=len(rows),
                          lr=float(self.optimizer.param_groups[0]["lr"]),
                          grad_norm=grad_norm, skipped=skipped)

    def _update(self) -> tuple[float, bool]:
        """The optimizer step, after the gradient norm is known to be finite:
        ``(grad_norm, skipped)``.

        A NaN/inf norm (a batch with huge advantages, an overflowing loss) would turn every
        weight into NaN through the clip factor ``clip / norm``: it is a
        :class:`NonFiniteGradError` before any weight changes, or under
        ``skip_nonfinite_grad_steps`` a skipped update (no weight, optimizer-state or LR
        change). Costs one more gradient-norm reduction per step when clipping is on. With a
        loss scaler (fp16), Megatron's own overflow check decides instead.
        """
        opt = self.optimizer
        norm = None
        if not _has_grad_scaler(opt):
            opt.prepare_grads()  # main grads into .grad (idempotent without a scaler)
            norm = float(opt.get_grad_norm())
            if not np.isfinite(norm):
                if self.config.optim.skip_nonfinite_grad_steps:
                    return norm, True
                raise NonFiniteGradError(
                    f"step {self.steps_done}: the gradient norm is {norm}, so the update would "
                    "make the weights NaN; no weight was changed. Fix: look for huge advantages "
                    "or rewards, or a loss that overflows, in this rollout; lower --lr or "
                    "--clip-grad; or pass --skip-nonfinite-grad-steps to skip such steps "
                    "(counted in skipped_steps).")
        ok, grad_norm, _ = opt.step()
        if not ok:
            raise NonFiniteGradError(
                f"step {self.steps_done}: the optimizer skipped the update (inf/nan gradients "
                "under loss scaling). Fix: lower the learning rate or check the data.")
        if grad_norm is not None:
            return float(grad_norm), False
        # Megatron's fp32 optimizer measures no norm without clipping: the one measured above
        # (a loss scaler's optimizer, which skips that, always returns one).
        assert norm is not None
        return norm, False

    @property
    def current_lr(self) -> float:
        """The LR the next optimizer step uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    def train(self, batch: RankBatch,
              before_update: Callable[[int, dict[str, float | None]], None] | None = None
              ) -> list[StepResult]:
        """Every step of ``batch`` in order (several optimizer steps per rollout batch);
        ``before_update(step_index, metrics)`` runs before each step's update."""
        return [self.train_step(step, None if before_update is None
                                else partial(before_update, s))
                for s, step in enumerate(batch.steps)]

    def _reduce(self, reports: list[dict], step: StepBatch) -> dict[str, float | None]:
        """The step report, identical on every rank: loss-like partial numerators through
        ``reduce_train_step``, token means (and the weight-sync gap, on the batch's first
        step) as ``(sum, count)`` through ``reduce_metrics``."""
        owned = reports if self.owns_loss else []
        partials = {k: sum(float(r[k]) for r in owned) for k in STEP_KEYS}
        tokens = sum(float(r["tokens"]) for r in owned)
        keys = TOKEN_KEYS + extra_token_keys(self.config.loss)
        metrics = {k: Metric(sum(float(r[k]) for r in owned), tokens) for k in keys}
        for key in mtp.mtp_keys(self.config.model):  # the MTP layers' cross entropy
            metrics[key] = Metric(sum(float(r["mtp_sum"]) for r in owned),
                                  sum(float(r["mtp_tokens"]) for r in owned))
        gaps = [r for r in owned if "gap_sum" in r]
        gap_tokens = sum(float(r["gap_tokens"]) for r in gaps)
        metrics["logprob_gap"] = Metric(sum(float(r["gap_sum"]) for r in gaps), gap_tokens)
        metrics["logprob_gap_max"] = Metric(max((float(r["gap_max"]) for r in gaps),
                                                default=0.0), gap_tokens, "max")
        mode = step.microbatches[0].loss_mode
        reduced = gather_metrics(metrics, group_dst=None)
        # Over zero scored tokens every mean is None, never a 0 that reads like a measurement.
        out = gather_step_report(partials, step.num_groups, mode, cp=self.layout.cp,
                                 num_samples=step.num_samples,
                                 tokens=reduced[TOKEN_KEYS[0]].count)
        out.update({k: m.value for k, m in reduced.items()})
        out["tokens"] = reduced[TOKEN_KEYS[0]].count
        out["gap_tokens"] = reduced["logprob_gap"].count
        if "mtp_loss" in reduced:
            out["mtp_tokens"] = reduced["mtp_loss"].count
        out["num_samples"] = float(step.num_samples)
        return out

    @torch.no_grad()
    def compute_log_probs(self, records: Sequence[TrainMicroBatch], num_response_tokens: int,
                          *, frozen: str | None = None) -> np.ndarray:
        """Per-token log-probs of the records' scored response tokens, forward only, under the
        trained model or the frozen model of role ``frozen`` (``"reference"``, ``"teacher"``).

        Returns a float32 array in share coordinates (``num_response_tokens`` long, a
        ``RankBatch``'s ``num_response_tokens``: the rank's share, never the whole batch):
        entry ``record.share_index[t]`` holds the log-prob of token ``t``; tokens this rank does
        not score are NaN. The last pipeline
        stage's values are broadcast so every stage returns them.
        """
        if frozen is not None and frozen not in self.frozen:
            raise field_error(VimeError, "frozen", frozen, "has not been loaded",
                              "call load_frozen(role, hf_dir) first (--use-kl-loss loads the "
                              "reference, --use-opd the teacher)")
        rows = self._tensors(records)

        def loss_fn(row: MicroBatchTensors, output: torch.Tensor):
            logp, _ = response_log_probs(output, row, with_entropy=False)
            return logp.sum() * 0.0, {"log_probs": logp}

        reports = self._run(rows, loss_fn, forward_only=True,
                            model=None if frozen is None else self.frozen[frozen])
        flat = torch.full((num_response_tokens,), float("nan"), dtype=torch.float32)
        if mpu.is_pipeline_last_stage(ignore_virtual=True):
            for row, report in zip(rows, reports):
                flat[torch.from_numpy(row.record.share_index)] = report["log_probs"].float().cpu()
        self._broadcast_from_last_stage(flat)
        return flat.numpy()

    def _broadcast_from_last_stage(self, flat: torch.Tensor) -> None:
        if mpu.get_pipeline_model_parallel_world_size() == 1:
            return
        group = mpu.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, mpu.get_pipeline_model_parallel_world_size() - 1)
        buf = flat.to(self.device)
        dist.broadcast(buf, src=src, group=group)
        flat.copy_(buf.cpu())

    def _finish_param_sync(self) -> None:
        """With ``overlap_param_gather`` the all-gather of updated shards is deferred to the
        next forward; anything that reads parameters outside a forward must force it first."""
        if self.config.optim.overlap_param_gather:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path) -> None:
        """Model, optimizer, LR scheduler, step counter and RNGs in Megatron's distributed
        format (collective); see :func:`vime_shell.megatron.checkpoint.save_checkpoint`."""
        self._finish_param_sync()
        checkpoint.save_checkpoint(self, path)

    def load_checkpoint(self, path: str | Path) -> bool:
        """Restore :meth:`save_checkpoint` output written with any layout (collective).
        Returns True when the RNG states were restored too (same layout only)."""
        return checkpoint.load_checkpoint(self, path)

    # -- offload (--offload-train) ----------------------------------------------------------
    def offload(self) -> OffloadReport:
        """Free the accelerator memory of weights, gradients, optimizer state and the reference
        model until :meth:`reload` (see :mod:`vime_shell.megatron.offload`); local, no
        collective."""
        self._finish_param_sync()
        self.offload_report = self._offload.offload(
            trainer_tensors(self.model, self.optimizer,
                            [c for chunks in self.frozen.values() for c in chunks]))
        return self.offload_report

    def reload(self) -> None:
        """Bring back, bit-exact, everything :meth:`offload` freed."""
        self._offload.reload()

    def shutdown(self) -> None:
        """Drop Megatron's parallel state so another layout can be built in this process."""
        self.model, self.optimizer, self.scheduler = [], None, None
        mpu.destroy_model_parallel()

    # -- weights -----------------------------------------------------------------------------
    @property
    def reference(self) -> list[torch.nn.Module] | None:
        """The frozen reference model's chunks (KL penalty), or None."""
        return self.frozen.get("reference")

    def load_reference(self, hf_dir: str | Path) -> None:
        """The frozen reference model (KL penalty), from an HF directory."""
        self.load_frozen("reference", hf_dir)

    @torch.no_grad()
    def load_frozen(self, role: str, hf_dir: str | Path) -> None:
        """Build a frozen model of ``role`` (``"reference"``: the KL penalty; ``"teacher"``:
        on-policy distillation) from an HF directory of the trained model's architecture: its
        own model chunks on this rank's layout, never updated (no DDP, no optimizer, no
        gradients)."""
        chunks = build_model_chunks(self.bridge, self.platform, self.layout, load_weights=False)
        if self.platform.dtype is torch.bfloat16:
            chunks = [Float16Module(self.bridge.config, c) for c in chunks]
        self.bridge.load_weights([unwrap_model(c) for c in chunks], str(hf_dir))
        for chunk in chunks:
            chunk.eval()
            chunk.requires_grad_(False)
        self.frozen[role] = chunks

    @torch.no_grad()
    def load_hf_weights(self, hf_dir: str | Path) -> None:
        """Overwrite the model's weights with an HF directory's (collective), and refresh the
        optimizer's main parameters from them; optimizer moments and the LR schedule stay.
        With LoRA the directory's weights become the frozen base, and the adapters stay."""
        self._finish_param_sync()
        with merged(self.model, merge=False):  # the base weights, under mbridge's names
            self.bridge.load_weights([unwrap_model(c) for c in self.model], str(hf_dir))
        self.optimizer.reload_model_params()

    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` for every weight (LoRA merged in); collective, drain
        on every rank."""
        self._finish_param_sync()
        with merged(self.model):
            yield from export_hf_weights(self.bridge, self.model)

    def engine_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`export_hf` without trained MTP layers, which no engine drafts with (vime
        runs no speculative decoding): what a weight sync sends. Collective."""
        layers = self.bridge.config.num_layers
        return ((name, t) for name, t in self.export_hf()
                if not is_mtp_tensor(name, layers))

    def hf_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The export (:meth:`export_hf`) as host copies in consecutive buckets of at most
        ``bucket_bytes`` (a larger tensor goes alone): at most one bucket is alive per rank,
        never the model (``--save-hf`` casts each to the export dtype and streams it into the
        writer). Collective: drain on every rank."""
        for bucket in buckets(self.export_hf(), bucket_bytes, key=lambda name: name):
            yield [(name, t.to("cpu", copy=True)) for name, t in bucket]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """All weights under HF names, as CPU tensors, on every rank."""
        self._finish_param_sync()
        with merged(self.model):
            return hf_state_dict(self.bridge, self.model)


class NonFiniteGradError(VimeError):
    """A step whose gradient norm is NaN or infinite (its update would corrupt the weights)."""


def _has_grad_scaler(optimizer) -> bool:
    """Whether any (chained) optimizer scales the loss: fp16's overflow check then applies."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(getattr(o, "grad_scaler", None) is not None for o in parts)


def lr_scheduler(optimizer, o: OptimConfig) -> OptimizerParamScheduler:
    """Megatron's LR scheduler over ``o``'s lengths in groups (``step(increment=G_s)``).

    Without a decay length (a trainer built outside ``vime train``) the LR never decays.
    Example: ``lr_decay_groups=640`` with cosine reaches ``min_lr`` after 640 groups.
    """
    decay = o.lr_decay_groups if o.lr_decay_groups is not None else 1 << 40
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if o.lr_warmup_groups else o.lr, max_lr=o.lr,
        min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_groups,
        lr_decay_steps=max(decay, o.lr_warmup_groups + 1), lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=1,
        wd_incr_style="constant")
