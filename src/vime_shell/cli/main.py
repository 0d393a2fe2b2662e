"""The ``vime`` command line: ``vime train`` (the RL loop), ``vime schedule`` (plan and report
steps), ``vime inspect`` (a rollout dump as readable text) and ``vime demo`` (``vime train`` with the embedded default, writing ``runs/demo/`` and
the rollout dumps ``runs/demo/rollouts/rollout_<k>.npz``).

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``.

Errors: a ``VimeError`` (bad input, an infeasible run), an ``OSError`` (disk full, permission,
not a directory) or a ``UnicodeDecodeError`` from any subcommand is one line on stderr and exit
status 2; its chained cause, when it adds something, is one more line (``caused by: ...``), and
the full traceback follows under ``--log-level debug``. Under torchrun one rank prints it
(:mod:`vime_shell.cli.launch_verdict`). Ctrl-C ends ``vime train`` with one line, ``interrupted
at rollout k; resume with --load DIR`` (or why there is nothing to resume), and status 130;
SIGTERM ends the process at once (:mod:`vime_shell.run.interrupts`). Messages name flags as typed
(``--allow-partial-train-step``), never the Python names the core uses
(:func:`vime_shell.cli.parser.as_flags`).
"""

import argparse
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs

from vime_shell.cli import async_demo
from vime_shell.cli import inspect as inspect_cmd
from vime_shell.cli import schedule as schedule_cmd
from vime_shell.cli import train as train_cmd
from vime_shell.cli.launch_verdict import ReportedElsewhere, speaks_for_job
from vime_shell.cli.parser import REPORTED_ERRORS, VimeArgumentParser, report_failure
from vime_shell.rollout.tasks import arithmetic_rows, write_jsonl
from vime_shell.run.interrupts import INTERRUPTED, interrupt_line, is_interrupt
from vime_shell.settings.train_config import TrainConfig, field_type


def build_parser() -> argparse.ArgumentParser:
    """Every parser and subparser refuses flag abbreviations and reports errors in one line
    (``VimeArgumentParser``; subparsers inherit the class)."""
    parser = VimeArgumentParser(prog="vime", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="run the RL loop (generate, reward, schedule, train, sync)",
        usage="vime train [--config FILE] [--flag VALUE ...]",
        description=plain_text(train_cmd.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train_cmd.add_arguments(train)
    train.set_defaults(handler=train_cmd.run)
    schedule_cmd.add_arguments(sub.add_parser(
        "schedule", help="plan the steps of a workload and print a per-step table",
        description=plain_text(schedule_cmd.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter))
    inspect_cmd.add_arguments(sub.add_parser(
        "inspect", help="print a rollout dump as text: decoded prompts and responses, labels, "
        "rewards, metadata", description=plain_text(inspect_cmd.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter))
    demo = sub.add_parser(
        "demo", help="the embedded CPU demo (what `make demo` runs): `vime train` with the "
        "default config and a 96-token micro-batch budget, writing runs/demo/ and its rollout "
        "dumps runs/demo/rollouts/; an earlier demo run there is moved aside first; --math: the "
        "arithmetic dataset demo (make demo-math)")
    demo.add_argument("--math", action="store_true",
                      help="learn single-digit sums from a JSONL dataset through the chat "
                      "template, the math reward, dynamic sampling and evaluation")
    demo.add_argument("--async", dest="async_demo", action="store_true",
                      help="on 2 ranks, 1 trainer and 1 engine: one step off (--train-async) "
                      "unless --fully-async; writes runs/demo-async/")
    train_cmd.add_arguments(demo)  # same flags, e.g. `vime demo --seed 1`
    demo.set_defaults(handler=_demo)
    return parser


def plain_text(doc: str | None) -> str:
    """A module docstring as help text: without reST markup (double backquotes, roles).
    Example: ``":mod:`a.b` and ``--lr``"`` -> ``"a.b and --lr"``."""
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", (doc or "").replace("``", ""))


def train_command(args: argparse.Namespace) -> str:
    """The ``vime train`` command line a demo amounts to: every setting it was given.

    Example: ``--max-tokens-per-gpu 96 --save-rollout-data 'runs/demo/rollouts/...'``."""
    parts = ["vime", "train"]
    for f in attrs.fields(TrainConfig):
        if not hasattr(args, f.name):
            continue
        value, flag = getattr(args, f.name), "--" + f.name.replace("_", "-")
        if field_type(f)[0] is bool:
            parts.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, (list, tuple)):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, "none" if value is None else str(value)]
    return " ".join(shlex.quote(p) for p in parts)


DEMO_MAX_TOKENS_PER_GPU = 96
# What `vime demo --math` adds to `vime train` (each can be overridden by the same flag).
MATH_DEMO = dict(apply_chat_template=True, rm_type="math", rollout_max_response_len=1,
                 rollout_shuffle=True, eval_interval=10, n_samples_per_eval_prompt=4,
                 dynamic_sampling_filter_path="vime_shell.rollout.filters:nonzero_reward_std",
                 over_sampling_batch_size=32, allow_partial_train_step=True, num_rollout=150,
                 run_dir="runs/demo-math")


def _demo(args: argparse.Namespace) -> int:
    if not hasattr(args, "overwrite_run_dir") and getattr(args, "load", None) is None:
        # Users rerun the demo: its earlier run (metrics, plots, dumps) is moved aside to
        # <run dir>/previous-<timestamp>/ and the loop prints where; `vime train` refuses.
        args.overwrite_run_dir = True
    if args.math:
        return _math_demo(args)
    if args.async_demo:
        async_demo.apply_defaults(args)
        if "WORLD_SIZE" not in os.environ:  # the parent: relaunch on 2 ranks
            return async_demo.launch(args, args.argv)
    run_dir = getattr(args, "run_dir", "runs/demo")
    args.run_dir = run_dir
    if getattr(args, "save_rollout_data", None) is None:  # for `vime schedule --input` later
        args.save_rollout_data = f"{run_dir}/rollouts/rollout_{{rollout_id}}.npz"
    if not hasattr(args, "max_tokens_per_gpu") and not getattr(args, "config", None):
        # A small token budget packs each step into 7 micro-batches, so the demo exercises
        # packing and the per-group loss: the reward curve equals the 1-micro-batch run's
        # rollout for rollout until float rounding flips a sampled token (rollout 184).
        args.max_tokens_per_gpu = DEMO_MAX_TOKENS_PER_GPU
    if speaks_for_job():  # once, not per rank of `vime demo --async`
        print(f"vime demo: RL from scratch on the embedded tiny Qwen2 (reverse two digits, "
              f"exact-match reward), HF engine + Megatron-core on CPU; writing {run_dir}/ "
              f"(`vime train` defaults, plus rollout dumps and --max-tokens-per-gpu "
              f"{args.max_tokens_per_gpu})", file=sys.stderr)
        print(f"vime demo: the same as {train_command(args)}", file=sys.stderr)
    return train_cmd.run(args)


def _math_demo(args: argparse.Namespace) -> int:
    """Write the arithmetic dataset into the run directory, then train on it as a user would:
    ``--prompt-data`` with the chat template, ``--rm-type math``, dynamic sampling, eval."""
    for name, value in MATH_DEMO.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    train, held_out = arithmetic_rows(seed=0)
    data = Path(args.run_dir) / "data"
    if not hasattr(args, "prompt_data"):
        args.prompt_data = str(write_jsonl(data / "train.jsonl", train))
    if not hasattr(args, "eval_prompt_data"):
        args.eval_prompt_data = ["arith", str(write_jsonl(data / "eval.jsonl", held_out))]
    print(f"vime demo --math: the embedded model learns single-digit sums ({len(train)} train, "
          f"{len(held_out)} eval prompts in {data}/) through its chat template, the math reward "
          f"and dynamic sampling; writing {args.run_dir}/", file=sys.stderr)
    print(f"vime demo --math: the same as {train_command(args)}", file=sys.stderr)
    return train_cmd.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the process's own command line: it ends with the command (no thread
        return train_cmd.leave(main(sys.argv[1:]))  # a plugin left running keeps it alive)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `vime demo --async` relaunches
    try:
        return int(args.handler(args) or 0)
    except ReportedElsewhere as exc:  # another rank of the job printed the error
        return exc.status
    except KeyboardInterrupt as exc:
        return report_interrupt(args, exc)
    except REPORTED_ERRORS as exc:
        if is_interrupt(exc):  # a Ctrl-C some wrapper turned into an error on its way up
            return report_interrupt(args, exc)
        report_error(parser, args, exc)
        return 2


def report_interrupt(args: argparse.Namespace, exc: BaseException) -> int:
    """Ctrl-C: one line from rank 0 (every rank of a job gets the signal), where the run
    stopped and how to resume (``run.interrupts``); status 130."""
    if speaks_for_job():
        line = interrupt_line(exc) if args.command in ("train", "demo") else "interrupted"
        print(f"vime {args.command}: {line}", file=sys.stderr)
    return INTERRUPTED


def report_error(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 exc: BaseException) -> None:
    """The failure as one line in the command's flag spelling (``report_failure``).

    Example: ``vime train: error: --seed=18446744073709551616: must be below 2**63. Fix: ...``.
    """
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for action in sub.choices[args.command]._actions for s in action.option_strings
             if s.startswith("--")}
    report_failure(args.command, exc, flags=flags,
                   debug=getattr(args, "log_level", None) == "debug")


if __name__ == "__main__":
    sys.exit(main())
