"""``vime train``: the RL loop of :mod:`vime_shell.loop.loop` from the command line.

Every ``TrainConfig`` setting is a flag (slime / Megatron names: ``--global-batch-size`` in
groups, ``--rollout-batch-size``, ``--n-samples-per-prompt``, ``--max-tokens-per-gpu``,
``--balance-data``, ``--lr``, ``--num-rollout``, ``--save``, ``--load``, ``--seed``, ...), read
after an optional ``--config`` file; all of it is validated before any model is built, and a
bad value exits with status 2 and one line naming the setting and the fix.

Multi-process: ``torchrun --nproc-per-node 2 -m vime_shell.cli train
--tensor-model-parallel-size 2``; multi-node adds torchrun's ``--nnodes``, ``--node-rank`` and
``--rdzv-endpoint``. Every rank with an engine generates its share of the prompts (see
``--rollout-num-gpus``), rank 0 writes the files, every rank trains.

Example: ``vime train --num-rollout 50 --lr 3e-4 --run-dir runs/r1 --save ck --save-hf hf_out``.
"""

import argparse
import os
import sys
import warnings

from vime_shell.loop.config import add_train_arguments, config_from_args
from vime_shell.loop.launch_checks import launch_checks, model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Validate every setting (no torch yet), then run the loop and print its summary."""
    cfg = config_from_args(args)
    plan = launch_checks(cfg, model_dir(cfg))
    # Megatron and mbridge announce every missing optional kernel (TE, Apex) on CPU at import.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|mbridge)\.")
    from vime_shell.loop.loop import run_training  # torch, Megatron: only for a valid run

    result = run_training(cfg, plan=plan)
    if int(os.environ.get("RANK", "0")) == 0 and result.records:
        print(f"vime train: metrics in {cfg.run_dir}/metrics.jsonl", file=sys.stderr)
        for path in result.plots:
            print(f"vime train: plot {path}", file=sys.stderr)
    return 0
