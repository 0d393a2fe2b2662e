"""Megatron-core train and log-prob steps driven by the rollout-side schedule.

Purpose: consume a rank's share of a ``Schedule`` unchanged. Each optimizer step runs exactly
the step's ``num_microbatches`` packed rows through ``get_forward_backward_func()``; the loss is
scaled so Megatron's and DDP's averaging cancel (:mod:`vime_shell.objective`); the LR schedule
advances by the step's real group count ``G_s``; metrics are reduced as (sum, count) pairs.

Wiring that matters (each is silently wrong when missing):

- Megatron DDP with ``config.no_sync_func`` and ``config.finalize_model_grads_func`` (and
  ``grad_sync_func`` under ``overlap_grad_reduce``), so overlapped reduction happens once, after
  the last micro-batch;
- every virtual-pipeline chunk gets its own iterator over the **same** micro-batch list;
- ``opt_param_scheduler.step(increment=G_s)``, so a partial step of 8 groups moves the schedule
  by 8, not by a full step;
- under ``overlap_param_gather`` the all-gather of updated shards waits for the next forward,
  so export and checkpoint force it first (else ranks read stale shards).

Invariants (tested in ``tests/shell``): final loss and parameters after k steps are equal across
DP1, DP2, DP2 + distributed optimizer + overlap, TP2, PP2 and PP2xVPP2 (fp32, 1e-5); the
micro-batches and tokens each rank ran equal the schedule's; log-probs equal transformers'.
Records (configs, plans, results) live in :mod:`vime_shell.train_plan`, checkpoints in
:mod:`vime_shell.checkpoint`.

Example::

    trainer = MegatronTrainer.from_hf(hf_dir, TrainerConfig(optim=OptimConfig(lr=1e-4)))
    plan = RankPlan.from_schedule(schedule, trainer.dp_rank)
    rows = global_rows.select(schedule.partitions[trainer.dp_rank])
    results = trainer.train(rows, plan)          # one StepResult per step
    logps = trainer.compute_log_probs(rows, plan)  # response log-probs per sample
"""

from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch

from vime_pure.errors import VimeError, field_error
from vime_shell.objective import (STEP_KEYS, TOKEN_KEYS, loss_factor, microbatch_objective,
                                  response_log_probs)
from vime_shell.packing import PackedRow, TrainRows, pack
from vime_shell.platform import Platform, TrainLayout
from vime_shell.train_plan import (OptimConfig, RankPlan, StepResult, StepSpec,  # noqa: F401
                                   TrainerConfig)


class MegatronTrainer:
    """Megatron-core model chunks, DDP, optimizer and LR scheduler on this rank.

    Build with :meth:`from_hf` (initialises distributed + Megatron parallel state) or, when the
    parallel state exists already, the constructor. All methods are collective over the world.
    """

    def __init__(self, hf_dir: str | Path, platform: Platform, layout: TrainLayout,
                 config: TrainerConfig = TrainerConfig()):
        from megatron.core import parallel_state as mpu

        from vime_shell.model import build_model_chunks, make_bridge

        self.platform, self.layout, self.config = platform, layout, config
        self.bridge = make_bridge(hf_dir, platform)
        self.model = self._wrap(build_model_chunks(self.bridge, platform, layout))
        self.optimizer, self.scheduler = self._optimizer()
        self.dp_rank = mpu.get_data_parallel_rank()
        self.trace: list[tuple[int, tuple[int, ...], int]] = []  # (step, indices, tokens) run
        self.steps_done = 0

    @classmethod
    def from_hf(cls, hf_dir: str | Path, config: TrainerConfig = TrainerConfig(), *,
                tp: int = 1, pp: int = 1, cp: int = 1,
                num_layers_per_virtual_stage: int | None = None,
                platform: Platform | None = None) -> "MegatronTrainer":
        """Detect the platform (unless given), resolve the layout for the launched world,
        initialise distributed + Megatron parallel state, build. Flags map 1:1 to Megatron's
        ``--tensor-model-parallel-size`` etc.; a layout the platform cannot run raises
        ``UnsupportedLayoutError`` before anything is built."""
        import torch.distributed as dist

        from vime_shell.model import read_hf_config
        from vime_shell.platform import detect_platform, initialize_parallel, resolve_layout

        platform = platform or detect_platform()
        world = dist.get_world_size() if dist.is_initialized() else _env_world_size()
        layout = resolve_layout(world_size=world, num_layers=read_hf_config(hf_dir).num_hidden_layers,
                                platform=platform, tp=tp, pp=pp, cp=cp,
                                num_layers_per_virtual_stage=num_layers_per_virtual_stage)
        initialize_parallel(layout, platform, seed=config.seed)
        return cls(hf_dir, platform, layout, config)

    # -- construction ---------------------------------------------------------------------
    def _wrap(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.transformer.module import Float16Module

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
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.config.optim
        bf16 = self.platform.dtype is torch.bfloat16
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr,
                            weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                            bf16=bf16, params_dtype=self.platform.dtype,
                            use_distributed_optimizer=o.use_distributed_optimizer),
            self.model)
        self.bridge.config.grad_scale_func = optimizer.scale_loss
        decay = o.lr_decay_groups if o.lr_decay_groups is not None else 1 << 40
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if o.lr_warmup_groups else o.lr, max_lr=o.lr,
            min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_groups,
            lr_decay_steps=max(decay, o.lr_warmup_groups + 1), lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=1,
            wd_incr_style="constant")
        return optimizer, scheduler

    # -- data --------------------------------------------------------------------------------
    def _packed(self, rows: TrainRows, microbatches: Sequence[Sequence[int]]) -> list[PackedRow]:
        from megatron.core import parallel_state as mpu

        device = torch.cuda.current_device() if self.platform.kind == "cuda" else "cpu"
        cp_size, cp_rank = self.layout.cp, mpu.get_context_parallel_rank()
        out = [pack(rows, mb, self.platform.packing, cp_size=cp_size, cp_rank=cp_rank)
               for mb in microbatches]
        return [r.to(device) for r in out] if self.platform.kind == "cuda" else out

    def _iterators(self, packed: list[PackedRow]):
        """One iterator per model chunk, each over the same list (what interleaving needs)."""
        iters = [iter(packed) for _ in self.model]
        return iters if len(iters) > 1 else iters[0]

    def _forward_step(self, loss_fn, record_step: int | None):
        def forward_step(data_iterator: Iterator[PackedRow], model):
            row = next(data_iterator)
            if record_step is not None and model is self.model[0]:
                self.trace.append((record_step, row.indices, row.num_tokens))
            # No labels: the last stage returns vocab-parallel logits [1, T, V/tp], of which the
            # loss needs only the rows that predict response tokens.
            out = model(row.tokens, row.position_ids, row.attention_mask,
                        packed_seq_params=row.packed_seq_params)
            return out, partial(loss_fn, row)
        return forward_step

    def _run(self, packed: list[PackedRow], loss_fn, forward_only: bool, record_step=None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        group = self.layout.microbatch_group
        if self.layout.vpp > 1 and len(packed) % group:
            raise field_error(VimeError, "num_microbatches", len(packed),
                              f"is not a multiple of microbatch_group={group}, which the "
                              f"interleaved schedule (vpp={self.layout.vpp}) needs",
                              "build the plan from a Schedule planned for this layout "
                              "(TrainLayout.scheduler_layout())")
        return get_forward_backward_func()(
            forward_step_func=self._forward_step(loss_fn, record_step),
            data_iterator=self._iterators(packed), model=self.model,
            num_microbatches=len(packed), seq_length=max(r.num_tokens for r in packed),
            micro_batch_size=1, forward_only=forward_only)

    # -- steps -------------------------------------------------------------------------------
    def train_step(self, rows: TrainRows, step: StepSpec) -> StepResult:
        """One optimizer step over ``step.microbatches`` (positions into ``rows``)."""
        if not step.microbatches:
            raise field_error(VimeError, "microbatches", (), "is empty",
                              "pass the step's micro-batches from the schedule")
        packed = self._packed(rows, step.microbatches)
        num_samples = self._step_samples(step)
        cfg = self.config.loss
        factor = loss_factor(cfg, len(packed), step.num_groups, num_samples, self.layout.dp,
                             self.layout.cp)

        def loss_fn(row: PackedRow, output: torch.Tensor):
            logp, entropy = response_log_probs(output, row, with_entropy=True)
            return microbatch_objective(logp, row, cfg, factor, entropy=entropy)

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._run(packed, loss_fn, forward_only=False, record_step=self.steps_done)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise VimeError(f"step {self.steps_done}: the optimizer skipped the update (inf/nan "
                            "gradients). Fix: lower the learning rate or check the data.")
        self.scheduler.step(increment=step.num_groups)
        self.steps_done += 1
        metrics = self._reduce(reports, step.num_groups, num_samples)
        return StepResult(metrics=metrics, num_groups=step.num_groups,
                          num_microbatches=len(packed), lr=float(self.optimizer.param_groups[0]["lr"]),
                          grad_norm=float(grad_norm if grad_norm is not None else 0.0))

    def train(self, rows: TrainRows, plan: RankPlan) -> list[StepResult]:
        """Every step of ``plan`` in order (several optimizer steps per rollout batch)."""
        return [self.train_step(rows, step) for step in plan.steps]

    def _step_samples(self, step: StepSpec) -> int:
        """``N_s``: the step's sample count over all DP ranks (sample-mean modes divide by it)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        if step.num_samples is not None:
            return step.num_samples
        local = torch.tensor([sum(len(mb) for mb in step.microbatches)], dtype=torch.int64,
                             device="cuda" if self.platform.kind == "cuda" else "cpu")
        dist.all_reduce(local, group=mpu.get_data_parallel_group())
        return int(local.item())

    def _reduce(self, reports: list[dict], num_groups: int, num_samples: int) -> dict[str, float]:
        """Sum the rows' report sums over micro-batches and ranks (``all_reduce_step_sums``);
        loss-like keys are divided by the step divisor ``C``, token keys by the token count."""
        from megatron.core import parallel_state as mpu

        from vime_pure.denominators import step_divisor
        from vime_pure.metrics import Metric
        from vime_shell.collectives import all_reduce_step_sums

        keys = (*STEP_KEYS, *TOKEN_KEYS, "tokens")
        # Only the last pipeline stage computed losses; TP ranks hold identical copies.
        owner = (mpu.is_pipeline_last_stage(ignore_virtual=True)
                 and mpu.get_tensor_model_parallel_rank() == 0)
        sums = {k: sum(float(r[k]) for r in reports) if owner else 0.0 for k in keys}
        totals = all_reduce_step_sums(sums, None, check_keys=False,
                                      device="cuda" if self.platform.kind == "cuda" else "cpu")
        divisor = step_divisor(self.config.loss.mode, num_groups, num_samples)
        out = {k: totals[k] / divisor for k in STEP_KEYS}
        out.update({k: Metric(totals[k], totals["tokens"]).value for k in TOKEN_KEYS})
        out["tokens"] = totals["tokens"]
        out["num_samples"] = float(num_samples)
        return out

    @torch.no_grad()
    def compute_log_probs(self, rows: TrainRows, plan: RankPlan) -> list[np.ndarray]:
        """Per-token log-probs of every sample's response, in ``rows`` order (forward only).

        Runs the plan's micro-batches in one forward-only pass; the last pipeline stage's
        results are broadcast so every rank returns them. Samples not in the plan are an error.
        """
        from megatron.core import parallel_state as mpu

        microbatches = [mb for step in plan.steps for mb in step.microbatches]
        packed = self._packed(rows, microbatches)

        def loss_fn(row: PackedRow, output: torch.Tensor):
            logp, _ = response_log_probs(output, row, with_entropy=False)
            return logp.sum() * 0.0, {"log_probs": logp}

        reports = self._run(packed, loss_fn, forward_only=True)
        sizes = [r.num_response_tokens for r in packed]
        flat = torch.zeros(sum(sizes), dtype=torch.float32)
        if mpu.is_pipeline_last_stage(ignore_virtual=True):
            for row, report, piece in zip(packed, reports, torch.split(flat, sizes)):
                piece[row.response_slot.cpu()] = report["log_probs"].float().cpu()
        self._sum_over_context_parallel(flat)
        self._broadcast_from_last_stage(flat)
        out: list[np.ndarray | None] = [None] * rows.num_samples
        for row, piece in zip(packed, torch.split(flat, sizes)):
            for i, part in zip(row.indices, torch.split(piece, list(row.response_lengths))):
                out[i] = part.numpy().astype(np.float64)
        missing = [i for i, v in enumerate(out) if v is None]
        if missing:
            raise field_error(VimeError, "plan", f"{len(missing)} samples uncovered",
                              f"samples {missing[:8]} are in no micro-batch",
                              "pass the plan built from the same schedule as the rows")
        return out

    def _sum_over_context_parallel(self, flat: torch.Tensor) -> None:
        """CP ranks hold disjoint response tokens (zeros elsewhere): their sum is the full row."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        if self.layout.cp == 1:
            return
        buf = flat.cuda() if self.platform.kind == "cuda" else flat
        dist.all_reduce(buf, group=mpu.get_context_parallel_group())
        flat.copy_(buf.cpu())

    def _broadcast_from_last_stage(self, flat: torch.Tensor) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        if mpu.get_pipeline_model_parallel_world_size() == 1:
            return
        group = mpu.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, mpu.get_pipeline_model_parallel_world_size() - 1)
        buf = flat.cuda() if self.platform.kind == "cuda" else flat
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
        """Per-rank checkpoint of model, optimizer, scheduler, step counter, RNG (collective);
        see :func:`vime_shell.checkpoint.save_checkpoint`."""
        from vime_shell.checkpoint import save_checkpoint

        self._finish_param_sync()
        save_checkpoint(self, path)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore :meth:`save_checkpoint` output written with the same layout (collective)."""
        from vime_shell.checkpoint import load_checkpoint

        load_checkpoint(self, path)

    def shutdown(self) -> None:
        """Drop Megatron's parallel state so another layout can be built in this process."""
        from megatron.core import parallel_state

        self.model, self.optimizer, self.scheduler = [], None, None
        parallel_state.destroy_model_parallel()

    # -- weights -----------------------------------------------------------------------------
    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` for every weight; collective, drain on every rank."""
        from vime_shell.model import export_hf_weights

        self._finish_param_sync()
        return export_hf_weights(self.bridge, self.model)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """All weights under HF names, as CPU tensors, on every rank."""
        from vime_shell.model import hf_state_dict

        self._finish_param_sync()
        return hf_state_dict(self.bridge, self.model)


def _env_world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))
