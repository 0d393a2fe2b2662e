"""Launching the trainer: a ``torchrun``-compatible entry and a ``spawn`` helper for tests.

Purpose: read the parallel layout from flags named as in Megatron/slime, reject a layout the
platform cannot run *before* any model is built (a one-line typed error and exit status 2, not
a stack trace), and start real processes for multi-process tests.

Flags: ``--hf-checkpoint DIR``, ``--tensor-model-parallel-size``,
``--pipeline-model-parallel-size``, ``--num-layers-per-virtual-pipeline-stage``,
``--context-parallel-size``, ``--lr``, ``--use-distributed-optimizer``,
``--overlap-grad-reduce``, ``--overlap-param-gather``, ``--seed``.
World size and ranks come from the ``torchrun`` environment (``WORLD_SIZE``, ``RANK``, ...).

Example: ``torchrun --nproc-per-node 2 -m vime_shell.megatron.launch --hf-checkpoint m
--pipeline-model-parallel-size 2`` builds the model on 2 pipeline stages and runs one
self-check step; ``--context-parallel-size 2`` on CPU exits with
``UnsupportedLayoutError: context_parallel_size=2: ...``.
"""

import argparse
import os
import sys
from collections.abc import Sequence

from vime_pure.data.microbatch import rank_batch
from vime_pure.errors import VimeError
from vime_shell.megatron.config import OptimConfig, TrainerConfig
from vime_shell.megatron.layout import (context_parallel_available, resolve_layout,
                                        world_size_from_env)
from vime_shell.models.hf_config import read_config_summary
from vime_shell.rollout.synthetic import synthetic_batch, synthetic_schedule


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vime_shell.megatron.launch",
                                description="Megatron-core trainer entry (torchrun-compatible).")
    p.add_argument("--hf-checkpoint", required=True, help="HF model directory to train")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    return p


def trainer_from_args(args: argparse.Namespace):
    """Validate the layout for this machine and world, then build the trainer."""
    # Resolve first, torch-free: a bad layout must fail before Megatron is imported or any
    # process group or model exists.
    cp = args.context_parallel_size
    resolve_layout(world_size=world_size_from_env(),
                   num_layers=read_config_summary(args.hf_checkpoint).num_layers,
                   supports_context_parallel=cp > 1 and context_parallel_available(),
                   tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                   cp=cp, num_layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage)
    from vime_shell.megatron.trainer import MegatronTrainer  # heavy: only once the layout is valid

    config = TrainerConfig(
        optim=OptimConfig(lr=args.lr, use_distributed_optimizer=args.use_distributed_optimizer,
                          overlap_grad_reduce=args.overlap_grad_reduce,
                          overlap_param_gather=args.overlap_param_gather),
        seed=args.seed)
    return MegatronTrainer.from_hf(
        args.hf_checkpoint, config, tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size, cp=cp,
        num_layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: build the trainer and run one self-check step on synthetic rollouts."""
    args = build_parser().parse_args(argv)
    try:
        trainer = trainer_from_args(args)
        batch = synthetic_batch(trainer.bridge.hf_config.vocab_size, num_groups=12,
                                seed=args.seed)
        schedule = synthetic_schedule(batch, trainer.layout, global_batch_size=8)
        results = trainer.train(rank_batch(batch, schedule, dp_rank=trainer.dp_rank,
                                           cp_rank=trainer.cp_rank, cp_size=trainer.layout.cp,
                                           row_multiple=trainer.row_multiple))
    except (VimeError, OSError, UnicodeDecodeError) as exc:  # one line, exit 2, as `vime`
        print(f"{type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        for i, r in enumerate(results):
            print(f"step {i}: groups={r.num_groups} micro-batches/rank={r.num_microbatches} "
                  f"loss={r.metrics['loss']:.6f} lr={r.lr:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
