"""Launching the trainer: a ``torchrun``-compatible entry and a ``spawn`` helper for tests.

Purpose: read the parallel layout from flags named as in Megatron/slime, reject a layout the
platform cannot run *before* any model is built (a one-line typed error and exit status 2, not
a stack trace), and start real processes for multi-process tests.

Flags: ``--hf-checkpoint DIR``, ``--tensor-model-parallel-size``,
``--pipeline-model-parallel-size``, ``--num-layers-per-virtual-pipeline-stage``,
``--context-parallel-size``, ``--lr``, ``--use-distributed-optimizer``,
``--overlap-grad-reduce``, ``--overlap-param-gather``, ``--seed``.
World size and ranks come from the ``torchrun`` environment (``WORLD_SIZE``, ``RANK``, ...).

Example: ``torchrun --nproc-per-node 2 -m vime_shell.launch --hf-checkpoint m
--pipeline-model-parallel-size 2`` builds the model on 2 pipeline stages and runs one
self-check step; ``--context-parallel-size 2`` on CPU exits with
``UnsupportedLayoutError: context_parallel_size=2: ...``.
"""

import argparse
import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from vime_pure.errors import VimeError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vime_shell.launch",
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
    """Validate the layout for this platform and world, then build the trainer."""
    from vime_shell.model import hf_num_layers
    from vime_shell.platform import detect_platform, resolve_layout

    platform = detect_platform(install_compat=False)  # from_hf installs it below
    num_layers = hf_num_layers(args.hf_checkpoint)
    # Resolve first: a bad layout must fail before Megatron is imported or any process group
    # or model exists.
    resolve_layout(world_size=int(os.environ.get("WORLD_SIZE", "1")), num_layers=num_layers,
                   platform=platform, tp=args.tensor_model_parallel_size,
                   pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
                   num_layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage)
    from vime_shell.objective import LossConfig
    from vime_shell.trainer import MegatronTrainer, OptimConfig, TrainerConfig

    config = TrainerConfig(
        optim=OptimConfig(lr=args.lr, use_distributed_optimizer=args.use_distributed_optimizer,
                          overlap_grad_reduce=args.overlap_grad_reduce,
                          overlap_param_gather=args.overlap_param_gather),
        loss=LossConfig(), seed=args.seed)
    return MegatronTrainer.from_hf(
        args.hf_checkpoint, config, tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
        num_layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: build the trainer and run one self-check step on synthetic rollouts."""
    args = build_parser().parse_args(argv)
    try:
        from vime_shell.synthetic import synthetic_batch, synthetic_schedule
        from vime_shell.train_plan import rank_inputs

        trainer = trainer_from_args(args)
        batch = synthetic_batch(trainer.bridge.hf_config.vocab_size, num_groups=12,
                                seed=args.seed)
        schedule = synthetic_schedule(batch, trainer.layout, global_batch_size=8)
        results = trainer.train(*rank_inputs(batch, schedule, trainer.dp_rank))
    except VimeError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        for i, r in enumerate(results):
            print(f"step {i}: groups={r.num_groups} micro-batches/rank={r.num_microbatches} "
                  f"loss={r.metrics['loss']:.6f} lr={r.lr:g}")
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    result = fn(rank, *args)
    with open(Path(out_dir) / f"{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def spawn(fn: Callable, world_size: int, *args, timeout: float = 600.0) -> list:
    """Run ``fn(rank, *args)`` in ``world_size`` fresh processes with a torchrun-like env.

    ``fn`` must be importable (module level). Returns each rank's return value, rank order.
    A failing rank raises ``RuntimeError`` carrying its traceback.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vime-spawn-") as out_dir:
        ctx = mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        while not ctx.join(timeout=timeout):
            pass
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


if __name__ == "__main__":
    raise SystemExit(main())
