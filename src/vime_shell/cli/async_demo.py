"""``vime demo --async``: the embedded demo on separate ranks, 1 trainer and 1 engine.

The command relaunches itself under ``torchrun --standalone --nproc-per-node 2`` (the parent
imports no torch and checks every flag first, as ``vime train`` does); rank 0 trains, rank 1
only generates (``--rollout-num-gpus 1``). By default one step off (``--train-async``);
``vime demo --async --fully-async --max-weight-staleness 2`` runs the fully-async pool
instead. It writes ``runs/demo-async/`` unless ``--run-dir`` says otherwise.

Example: ``vime demo --async --num-rollout 200`` learns reverse-two-digits with rollout k+1
generated while rollout k trains.
"""

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

from vime_shell.run.interrupts import INTERRUPTED
from vime_shell.run.launch_checks import launch_checks, model_dir
from vime_shell.settings.flags import config_from_args

RANKS = 2  # 1 trainer + 1 engine


def apply_defaults(args: argparse.Namespace) -> None:
    """What ``--async`` adds to ``vime demo`` (each overridable by the same flag)."""
    if not getattr(args, "fully_async", False) and not hasattr(args, "train_async"):
        args.train_async = True
    if not hasattr(args, "rollout_num_gpus"):
        args.rollout_num_gpus = 1
    if not hasattr(args, "run_dir"):
        args.run_dir = "runs/demo-async"


def launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Check the flags for a 2-rank job, then run ``vime demo`` on 2 ranks; the exit status
    of the job."""
    os.environ["WORLD_SIZE"] = str(RANKS)  # the launch checks split this world
    try:
        cfg = config_from_args(args)
        launch_checks(cfg, model_dir(cfg))
    finally:
        del os.environ["WORLD_SIZE"]
    mode = "fully async" if cfg.fully_async else "one step off"
    print(f"vime demo --async: {mode} on {RANKS} ranks (rank 0 trains, rank 1 generates); "
          f"writing {cfg.run_dir}/", file=sys.stderr)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={RANKS}", "-m", "vime_shell.cli", *argv]
    child = subprocess.Popen(command)
    try:
        return child.wait()
    except KeyboardInterrupt:  # the job's ranks got the same Ctrl-C: its rank 0 says where
        try:  # torchrun stops its ranks within its own 30 s, then kills them
            child.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        return INTERRUPTED


STOP_TIMEOUT_S = 120.0
