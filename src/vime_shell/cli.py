"""The ``vime`` command line: ``vime schedule`` (plan and report steps) and ``vime demo``.

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``.
"""

import argparse
import sys
from collections.abc import Sequence

from vime_pure.errors import VimeError


def build_parser() -> argparse.ArgumentParser:
    from vime_shell import schedule_cmd

    parser = argparse.ArgumentParser(prog="vime", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    schedule_cmd.add_arguments(sub.add_parser(
        "schedule", help="plan the steps of a workload and print a per-step table",
        description=schedule_cmd.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    demo = sub.add_parser("demo", help="run the embedded CPU demo (what `make demo` runs)")
    demo.set_defaults(handler=_demo)
    return parser


def _demo(args: argparse.Namespace) -> int:
    from vime_shell import schedule_cmd

    print("vime demo: scheduling a synthetic agentic rollout batch "
          "(2048 groups of 1-4 samples, dp=8, vpp=2, 32k tokens/GPU, FLOPs balancing)\n")
    argv = ["--synthetic", "--num-groups", "2048", "--fanout", "agentic8",
            "--global-batch-size", "512", "--dp", "8", "--vpp", "2",
            "--microbatch-group-size-per-vp-stage", "2", "--max-tokens-per-gpu", "32768",
            "--balance-by-flops", "--allow-partial-train-step"]
    parser = argparse.ArgumentParser()
    schedule_cmd.add_arguments(parser)
    return schedule_cmd.run(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except VimeError as exc:
        print(f"vime {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
