"""``vime train``: the RL loop of :mod:`vime_shell.run.driver` from the command line.

Every ``TrainConfig`` setting is a flag (slime / Megatron names: ``--global-batch-size`` in
groups, ``--rollout-batch-size``, ``--n-samples-per-prompt``, ``--max-tokens-per-gpu``,
``--balance-data``, ``--lr``, ``--num-rollout``, ``--save``, ``--load``, ``--seed``, ...), read
after an optional ``--config`` file; all of it is validated before any model is built, and a
bad value exits with status 2 and one line naming the setting and the fix.

A slime or miles launch script runs with its flags unchanged (README "Coming from slime"):
Megatron's architecture flags are checked against the HF config, its switches and slime's
engine flags (``--sglang-X``, ``--vllm-X``) are accepted with a one-line note where vime differs,
and a flag vime does not support prints its line from ``vime_shell.settings.slime_flags``.
``--dry-run`` runs every launch check and prints the resolved run without building anything.

Multi-process: ``torchrun --nproc-per-node 2 -m vime_shell.cli train
--tensor-model-parallel-size 2``; multi-node adds torchrun's ``--nnodes``, ``--node-rank`` and
``--rdzv-endpoint``. Every rank with an engine generates the prompt chunks its engine claims
from the work queue (see ``--rollout-num-gpus``), rank 0 writes the files, every rank trains.
The ranks agree on the launch checks before any process group exists, so the ``--dry-run``
report and a launch error print once (:mod:`vime_shell.cli.launch_verdict`); torchrun then exits
1 after its own ``ChildFailedError`` block. Ctrl-C ends the run with ``interrupted at rollout k;
resume with --load DIR`` (or why there is nothing to resume) and status 130; SIGTERM ends it at
once.

The process ends when the run does: a plugin that leaves a (non-daemon) thread running does
not keep ``vime train`` alive after its last flush. :func:`leave` waits ``LINGER_S`` for such
threads, then names them in one warning and exits with the run's status (``os._exit``: Python
would wait for them forever); the run directory's lock was released when the run ended.

Example: ``vime train --num-rollout 50 --lr 3e-4 --run-dir runs/r1 --save ck --save-hf hf_out``.
"""

import argparse
import logging
import os
import sys
import threading
import time
import warnings

from vime_shell.cli.dry_run import dry_run_report
from vime_shell.cli.launch_verdict import (ReportedElsewhere, first_to_report, settle,
                                           speaks_for_job)
from vime_shell.cli.parser import REPORTED_ERRORS, VimeArgumentParser
from vime_shell.engines import engine_traits
from vime_shell.engines.reaper_mark import ENDS_PROCESS
from vime_shell.megatron.layout import sequence_parallel_on, transformer_engine_available
from vime_shell.run.checkpoint_index import loads_the_weights, resume_checkpoint
from vime_shell.run.interrupts import catch_interrupts, is_interrupt
from vime_shell.run.launch_checks import launch_checks, model_dir
from vime_shell.settings.flags import (absorb_engine_flags, add_train_arguments,
                                       config_from_args)
from vime_shell.settings.megatron_args import notes
from vime_shell.settings.slime_flags import unsupported_line


LINGER_S = 5.0  # how long the process waits for threads a plugin left running


def add_arguments(parser: VimeArgumentParser) -> None:
    """Every setting's flag; slime's engine flags absorbed and its unsupported flags explained
    (the hooks of ``VimeArgumentParser``)."""
    add_train_arguments(parser)
    parser.extras_hook = absorb_engine_flags
    parser.flag_table = unsupported_line
    parser.add_argument("--dry-run", action="store_true", default=argparse.SUPPRESS,
                        help="run every launch check, print the resolved configuration, the "
                        "layouts and one synthetic rollout's schedule, build nothing, exit 0")


def launch_notes(cfg, args: argparse.Namespace, plan) -> list[str]:
    """One line per accepted flag that vime treats differently (rank 0 prints them)."""
    out = [*notes(cfg), *getattr(args, "engine_warnings", ()), *getattr(args, "flag_notes", ())]
    needed_by = cfg.distributed_optimizer_needed_by(cfg.use_precision_aware_optimizer)
    if needed_by is not None:
        out.append(f"{needed_by}: turns on the distributed optimizer (Megatron needs it; slime "
                   "always runs it); pass --use-distributed-optimizer to say so")
    if cfg.use_precision_aware_optimizer and not transformer_engine_available():
        out.append("--use-precision-aware-optimizer: no TransformerEngine here, so Adam is "
                   "torch's, its state fp32, as the precision-aware optimizer keeps it at "
                   "Megatron's default state dtypes")
    if cfg.load is not None and resume_checkpoint(cfg.load, cfg.save,
                                                  weights=cfg.hf_checkpoint) is None:
        out.append(f"--load {cfg.load}: " + (
            "the --hf-checkpoint directory, HF weights without a checkpoint: starting from "
            "them, as miles' FSDP backend does" if loads_the_weights(cfg.load, cfg.hf_checkpoint)
            else
            "no checkpoint yet (it is the --save directory): starting fresh, as slime does"))
    if cfg.eval_prompt_data is not None and cfg.eval_interval is None:
        out.append("--eval-prompt-data without --eval-interval: evaluating "
                   + ("" if cfg.skip_eval_before_train else "before the first rollout and ")
                   + "after the last")
    if cfg.sequence_parallel:
        out.append(sequence_parallel_note(cfg.tensor_model_parallel_size,
                                          cfg.context_parallel_size, lora=cfg.lora_rank > 0))
    if cfg.kl_coef and not cfg.reward_kl:
        out.append(f"--kl-coef {cfg.kl_coef}: no effect with --advantage-estimator "
                   f"{cfg.advantage_estimator} (as in slime)")
    if cfg.vllm_engine_args and plan.engine_layout is not None:
        engine = engine_traits(plan.engine_layout.engine)
        if not engine.takes_engine_args:
            out.append(f"--vllm-engine-args {' '.join(cfg.vllm_engine_args)}: {engine.label} "
                       "takes no vLLM arguments; ignored")
    return out


def sequence_parallel_note(tp: int, cp: int, lora: bool = False) -> str:
    """What ``--sequence-parallel`` does on this machine (``layout.sequence_parallel_on``)."""
    te = transformer_engine_available() and not lora  # LoRA builds the local spec (lora.py)
    if sequence_parallel_on(True, tp=tp, cp=cp, transformer_engine=te):
        return (f"--sequence-parallel: on over the {tp} TP ranks (packed rows padded to a "
                f"multiple of {tp})")
    why = ("at --tensor-model-parallel-size 1 (as in Megatron)" if tp == 1 else
           "with --context-parallel-size > 1 (its row padding is not wired into the CP "
           "chunks yet)" if cp > 1 else "with LoRA (its adapters wrap the local layer "
           "spec, whose torch norms cannot run sequence-parallel)" if lora else "on the local "
           "layer spec (no TransformerEngine: torch norms cannot run sequence-parallel)")
    return f"--sequence-parallel: off {why}"


def checked_launch(args: argparse.Namespace):
    """``(cfg, plan)``: every setting and launch check on this rank, then the job's verdict
    (``launch_verdict.settle``: under torchrun a failure is reported by one rank, the others
    raise ``ReportedElsewhere``)."""
    try:
        cfg = config_from_args(args)
        plan = launch_checks(cfg, model_dir(cfg))
    except REPORTED_ERRORS as exc:
        settle(exc)
        raise  # settle raises on a failure; kept for readers and type checkers
    settle(None)
    return cfg, plan


def run(args: argparse.Namespace) -> int:
    """Validate every setting (no torch yet), then run the loop and print its summary."""
    cfg, plan = checked_launch(args)
    os.environ.update(cfg.train_env())  # --train-env-vars: before the trainer is built
    if speaks_for_job():
        for line in launch_notes(cfg, args, plan):
            print(f"vime train: note: {line}", file=sys.stderr)
    if getattr(args, "dry_run", False):
        if speaks_for_job():  # every rank resolved the same run: its report once
            print(dry_run_report(cfg, plan))
        return 0
    # Megatron and mbridge announce every missing optional kernel (TE, Apex) on CPU at import.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|mbridge)\.")
    from vime_shell.run.driver import run_training  # torch, Megatron: only for a valid run
    from vime_shell.run.rollout_only import run_rollouts_only

    try:
        with catch_interrupts():
            result = (run_rollouts_only(cfg, plan) if cfg.debug_rollout_only
                      else run_training(cfg, plan=plan))
    except REPORTED_ERRORS as exc:
        # another rank of the job printed its account of it (a Ctrl-C is rank 0's to report)
        if not is_interrupt(exc) and not first_to_report():
            raise ReportedElsewhere(2) from exc
        raise
    if speaks_for_job() and result.records:
        print(f"vime train: metrics in {cfg.run_dir}/metrics.jsonl", file=sys.stderr)
        for path in result.plots:
            print(f"vime train: plot {path}", file=sys.stderr)
    return 0


def leave(status: int) -> int:
    """``status``, once every thread but the main one has ended; when a plugin left threads
    running (not daemon threads, which Python would wait for forever), they get ``LINGER_S``
    seconds, then one warning names them and the process exits with ``status`` at once,
    its output flushed. Call it only where the process ends (``vime``'s own command line)."""
    lingering = _lingering()
    deadline = time.monotonic() + LINGER_S
    for thread in lingering:
        thread.join(timeout=max(deadline - time.monotonic(), 0.0))
    lingering = _lingering()
    if not lingering:
        return status
    names = ", ".join(f"{t.name!r}" for t in lingering)
    print(f"vime: warning: {len(lingering)} thread(s) still running after the run ended "
          f"(started by a plugin, and not daemon threads): {names}; exiting with status "
          f"{status} without waiting for them", file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _lingering() -> list[threading.Thread]:
    """Non-daemon threads still running, but vime's health reaper (marked ``ENDS_PROCESS``,
    ``engines.reaper_mark``: it ends the process itself, after the main thread, lingering so
    every rank reads the job's verdict)."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon
            and t.is_alive() and not getattr(t, ENDS_PROCESS, False)]
