"""vime schedule: plan the steps of one rollout batch and print a per-step table.

Input is one of:
  --input FILE.jsonl   one JSON object per sample: {"length": <int>, "group_id": <int|str>}
  --input DUMP         a rollout dump written by save_rollout_batch / --save-rollout-data
  --synthetic          a seeded long-tailed workload (see vime_pure.scheduling.workloads): prompt
                       lognormal(median 500, sigma 0.4), response lognormal(median 2000) with
                       per-prompt and per-sample spread, fan-out grpo8 | grpo16 | agentic8
                       (agentic8: 1-4 samples per group with p = .4/.3/.2/.1)

Layout and policy flags are named as in slime and mean what they mean in `vime train`
(vime_pure.policy_from_flags): --balance-data balances micro-batches over DP ranks by tokens,
--balance-by-flops by estimated FLOPs; --packing and --balance pick any algorithm
(--balance straggler included). The table shows, per step: groups, samples, micro-batches per rank (and the aligned
lower bound), max and mean rank tokens, token and FLOPs imbalance (max/mean), cap use (mean
micro-batch fill) and the largest micro-batch. Below it: samples over the cap (each alone in a
micro-batch, the out-of-memory risk) and the largest micro-batch against the cap, the pipeline
bubble at --pp/--vpp, and with --peak-tflops a step-time estimate per step
(vime_pure.scheduling.step_time). --hf-config DIR measures FLOPs with that model's config
(what `vime train` uses) instead of the fixed 8B-shaped proxy ratio. Dropped trailing groups
are reported last.
"""

import argparse
import json
import zipfile
from pathlib import Path

import attrs
import numpy as np

from vime_pure.config import (BALANCES, PACKINGS, BatchingPolicy, ParallelLayout,
                              policy_from_flags)
from vime_pure.errors import VimeError, field_error
from vime_pure.grouping import plain_key
from vime_pure.scheduling.inputs import MAX_LENGTH
from vime_pure.scheduling.planner import build_schedule
from vime_pure.scheduling.flops import FlopsModel
from vime_pure.scheduling.report import PolicySummary, StepStats, step_stats, summarize
from vime_pure.scheduling.step_time import bubble_fraction, step_times
from vime_pure.scheduling.workloads import FANOUTS, synthetic_workload
from vime_shell.storage.dump import workload_from_dump
from vime_shell.storage.files import require_regular_file, writable_target, write_atomic


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("workload")
    src.add_argument("--input", type=Path, help="JSONL workload file or rollout dump")
    src.add_argument("--synthetic", action="store_true", help="use a seeded synthetic workload")
    src.add_argument("--num-groups", type=int, default=1024, help="synthetic: rollout groups")
    src.add_argument("--fanout", choices=sorted(FANOUTS), default="agentic8",
                     help="synthetic: samples per prompt/group pattern")
    src.add_argument("--seed", type=int, default=0, help="synthetic: RNG seed")
    lay = p.add_argument_group("parallel layout")
    lay.add_argument("--dp", type=int, default=1, help="data-parallel size")
    lay.add_argument("--cp", type=int, default=1, help="context-parallel size")
    lay.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    lay.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per rank")
    lay.add_argument("--microbatch-group-size-per-vp-stage", type=int, default=None,
                     help="Megatron's microbatch group size (required with --vpp > 1)")
    pol = p.add_argument_group("batching policy")
    pol.add_argument("--global-batch-size", type=int, required=False, default=None,
                     help="groups (rollout executions) per optimizer step")
    pol.add_argument("--max-tokens-per-gpu", type=int, default=None,
                     help="token budget per micro-batch per GPU (dynamic packing)")
    pol.add_argument("--micro-batch-size", type=int, default=None,
                     help="samples per static micro-batch (when --max-tokens-per-gpu is unset)")
    pol.add_argument("--packing", choices=PACKINGS, default=None,
                     help="bin-packing algorithm (default ffd)")
    pol.add_argument("--balance", choices=BALANCES, default=None,
                     help="DP balance mode; overrides --balance-data / --balance-by-flops. "
                     "Default as in vime train (not slime's round-robin 'strided'): "
                     "'straggler' with --max-tokens-per-gpu and neither of those, else "
                     "'strided'")
    pol.add_argument("--balance-data", action="store_true",
                     help="balance DP ranks by tokens (--balance tokens)")
    pol.add_argument("--balance-by-flops", action="store_true",
                     help="balance DP ranks by estimated FLOPs (--balance flops)")
    pol.add_argument("--allow-partial-train-step", action="store_true",
                     help="train trailing groups as one smaller final step when feasible")
    model = p.add_argument_group("model")
    model.add_argument("--hf-config", type=Path, default=None,
                       help="HF model directory (or config.json) whose FLOPs model balances and "
                            "measures (default: a fixed 8B-shaped ratio)")
    model.add_argument("--peak-tflops", type=float, default=None,
                       help="peak TFLOP/s per GPU: print a step-time estimate per step")
    model.add_argument("--mfu", type=float, default=0.4,
                       help="achieved share of --peak-tflops for the estimate (default 0.4)")
    rep = p.add_argument_group("reports")
    rep.add_argument("--json", type=Path, default=None, help="also write per-step stats as JSON")
    rep.add_argument("--compare", action="store_true",
                     help="run every packing x balance policy side by side and print a summary")
    rep.add_argument("--plot", type=Path, default=None,
                     help="PNG of one step's per-rank loads, stacked by micro-batch")
    rep.add_argument("--plot-step", type=int, default=0, help="step drawn by --plot")
    p.set_defaults(handler=run)


class InputError(VimeError):
    """A ``vime schedule`` input file or output path that cannot be used."""


def load_jsonl(path: Path) -> tuple[np.ndarray, list]:
    """Read ``{"length", "group_id"}`` rows; every error names the line (``file:7``)."""
    lengths, groups = [], []
    try:
        with path.open("rb") as fh:
            for n, raw in enumerate(fh, 1):
                length, group = _jsonl_row(path, n, raw)
                if length is not None:
                    lengths.append(length)
                    groups.append(group)
    except OSError as exc:
        raise field_error(InputError, "--input", str(path), f"cannot be read ({exc})",
                          "pass a readable JSONL file or rollout dump") from None
    return np.asarray(lengths, dtype=np.int64), groups


def _jsonl_row(path: Path, n: int, raw: bytes) -> tuple[int | None, object]:
    """One line's ``(length, group_id)``, or ``(None, None)`` for a blank line."""
    where = f"{path}:{n}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{where}: is not UTF-8 text, so neither a JSONL workload nor a rollout "
                         "dump (.npz). Fix: pass a JSONL file or a dump written by "
                         "--save-rollout-data.") from None
    if not line.strip():
        return None, None
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{where}: not JSON ({type(exc).__name__}: {str(exc)[:80]}). Fix: each "
                         'line must be a JSON object with "length" and "group_id".') from None
    if not isinstance(row, dict) or "length" not in row or "group_id" not in row:
        raise InputError(f"{where}: {line.strip()[:80]} lacks \"length\" or \"group_id\". "
                         'Fix: each line must be a JSON object with "length" and "group_id".')
    length = row["length"]
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= MAX_LENGTH:
        raise InputError(f"{where}: length={length!r} is not an integer in [1, {MAX_LENGTH}]. "
                         "Fix: give the sample's total token count (prompt + response).")
    try:
        group = plain_key(row["group_id"])
    except TypeError as exc:
        raise InputError(f"{where}: group_id={row['group_id']!r} {exc}. Fix: use an int or "
                         "str group id (null: the sample is its own group).") from None
    return length, group


def policy_from_args(args: argparse.Namespace) -> tuple[ParallelLayout, BatchingPolicy]:
    """The layout, and the policy from ``vime_pure.policy_from_flags`` (what ``vime train``
    uses too, so a flag means the same thing in both commands)."""
    if args.global_batch_size is None:
        raise InputError("--global-batch-size is missing. Fix: pass the number of groups per "
                         "step.")
    layout = ParallelLayout(dp=args.dp, cp=args.cp, pp=args.pp, vpp=args.vpp,
                            microbatch_group=args.microbatch_group_size_per_vp_stage)
    policy = policy_from_flags(
        global_batch_size=args.global_batch_size, max_tokens_per_gpu=args.max_tokens_per_gpu,
        micro_batch_size=args.micro_batch_size, packing=args.packing, balance=args.balance,
        balance_data=args.balance_data, balance_by_flops=args.balance_by_flops,
        allow_partial_train_step=args.allow_partial_train_step)
    return layout, policy


def load_workload(args: argparse.Namespace) -> tuple[np.ndarray, list]:
    if (args.input is None) == (not args.synthetic):
        raise InputError("pass exactly one of --input FILE or --synthetic. Fix: e.g. "
                         "`vime schedule --synthetic --global-batch-size 64 --dp 8 "
                         "--max-tokens-per-gpu 16384`.")
    if args.synthetic:
        w = synthetic_workload(num_groups=args.num_groups, fanout=args.fanout, seed=args.seed)
        return w.lengths, w.group_ids.tolist()
    path = args.input
    if not path.exists():
        raise field_error(InputError, "--input", str(path), "does not exist",
                          "pass an existing JSONL file or rollout dump")
    if path.is_dir():
        raise field_error(InputError, "--input", str(path), "is a directory",
                          "pass one JSONL file or one rollout dump (.npz) inside it")
    require_regular_file(path, "--input")  # a FIFO would block forever, a device never ends
    # Rollout dumps are versioned .npz (zip) files: a .npz that is not a readable zip is a
    # damaged dump (DumpFormatError), never JSONL.
    if path.suffix == ".npz" or zipfile.is_zipfile(path):
        lengths, group_ids = workload_from_dump(path)
        return np.asarray(lengths), list(group_ids)
    return load_jsonl(path)


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse unusable output paths before any work (one line, exit 2), never after it."""
    for flag, path, suffix in (("--json", args.json, None), ("--plot", args.plot, ".png")):
        if path is None:
            continue
        if suffix is not None and path.suffix.lower() != suffix:
            raise field_error(InputError, flag, str(path), f"does not end in {suffix}",
                              f"name the image e.g. step0{suffix} (it is written as PNG)")
        if path.is_dir():
            raise field_error(InputError, flag, str(path), "is a directory",
                              "pass a file path")
        if not path.parent.is_dir():
            raise field_error(InputError, flag, str(path), f"is in {path.parent}/, which does "
                              "not exist", "create the directory first, or pass another path")
        writable_target(path, flag)  # a device, FIFO or socket is refused, never replaced


def format_table(stats: tuple[StepStats, ...]) -> str:
    head = (f"{'step':>4} {'groups':>6} {'samples':>7} {'mb/rank':>7} {'bound':>5} "
            f"{'max rank tok':>12} {'mean rank tok':>13} {'tok imb':>7} {'flops imb':>9} "
            f"{'cap use':>7} {'max mb tok':>10}")
    rows = [head, "-" * len(head)]
    for s in stats:
        cap = "static" if s.cap_use is None else f"{s.cap_use:7.1%}"
        rows.append(f"{s.step:>4} {s.num_groups:>6} {s.num_samples:>7} "
                    f"{s.microbatches_per_rank:>7} {s.microbatch_lower_bound:>5} "
                    f"{s.max_rank_tokens:>12,} {s.mean_rank_tokens:>13,.0f} "
                    f"{s.token_imbalance:>7.3f} {s.flops_imbalance:>9.3f} {cap:>7} "
                    f"{s.max_microbatch_tokens:>10,}")
    return "\n".join(rows)


def format_compare(rows: list[tuple[str, str, PolicySummary]]) -> str:
    head = (f"{'packing':>9} {'balance':>9} {'mbs':>6} {'bound':>6} {'aligned':>7} {'tok imb mean/worst':>18} "
            f"{'tok LB':>6} {'flops imb mean/worst':>20} {'flops LB':>8} {'pad waste':>9} "
            f"{'oversize':>8} {'max mb tok':>10} {'dropped':>7}")
    out = [head, "-" * len(head)]
    for packing, balance, s in rows:
        out.append(
            f"{packing:>9} {balance:>9} {s.microbatches:>6} {s.microbatch_bound:>6} "
            f"{s.microbatch_bound_aligned:>7} "
            f"{s.token_imbalance_mean:>8.3f} / {s.token_imbalance_worst:<7.3f} "
            f"{s.token_imbalance_bound:>6.3f} {s.flops_imbalance_mean:>9.3f} / "
            f"{s.flops_imbalance_worst:<8.3f} {s.flops_imbalance_bound:>8.3f} "
            f"{s.pad_waste:>9.1%} {s.oversize_samples:>8} {s.max_microbatch_tokens:>10,} "
            f"{s.dropped_groups:>7}")
    return "\n".join(out)


def compare(lengths, groups, layout: ParallelLayout, policy: BatchingPolicy,
            flops: FlopsModel | None = None):
    """Summaries of every packing x balance combination under ``policy``'s other settings."""
    rows = []
    work = None if flops is None else flops.per_sample(lengths)
    for packing in PACKINGS:
        for balance in BALANCES:
            variant = attrs.evolve(policy, packing=packing, balance=balance)
            rows.append((packing, balance,
                         summarize(build_schedule(lengths, groups, layout, variant, work),
                                   work)))
    return rows


def load_flops_model(path: Path | None) -> FlopsModel | None:
    """``--hf-config``: the FLOPs model of a model directory's (or a file's) config.json."""
    if path is None:
        return None
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise field_error(InputError, "--hf-config", str(path), f"cannot be read ({exc})",
                          "pass an HF model directory or its config.json") from None
    return FlopsModel.from_hf_config(config)


def format_extras(schedule, stats: tuple[StepStats, ...], policy: BatchingPolicy,
                  layout: ParallelLayout, flops: FlopsModel | None, args) -> list[str]:
    """The lines under the table: oversize singletons and the largest micro-batch, the
    pipeline bubble, and the step-time estimate."""
    out = []
    cap = policy.token_cap(layout)
    if stats:
        largest = max(s.max_microbatch_tokens for s in stats)
        oversize = sum(s.oversize_samples for s in stats)
        ratio = f" = {largest / cap:.2f} x the cap" if cap else ""
        out.append(f"oversize samples (alone in a micro-batch, over the cap): {oversize}; "
                   f"largest micro-batch {largest:,} tokens{ratio}")
        mbs = max(s.microbatches_per_rank for s in stats)
        out.append(f"pipeline: pp={layout.pp} vpp={layout.vpp}, bubble "
                   f"{bubble_fraction(layout.pp, layout.vpp, mbs):.1%} of a step at {mbs} "
                   "micro-batches per rank")
    if args.peak_tflops is not None:
        model = flops or FlopsModel.from_hf_config(_PROXY_8B)
        times = step_times(schedule, model, peak_tflops=args.peak_tflops, mfu=args.mfu)
        source = "the --hf-config model" if flops else "an 8B-shaped dense model"
        out.append(f"step time estimate ({source}, {args.peak_tflops:g} TFLOP/s x mfu "
                   f"{args.mfu:g}): " + ", ".join(f"step {t.step} {t.seconds:.3g} s"
                                                 for t in times[:8])
                   + (" ..." if len(times) > 8 else "")
                   + f"; total {sum(t.seconds for t in times):.3g} s")
    return out


# The dense 8B decoder whose ratio ``proxy_flops`` uses (Llama-3-8B's shape).
_PROXY_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}


def run(args: argparse.Namespace) -> int:
    check_outputs(args)
    lengths, groups = load_workload(args)
    layout, policy = policy_from_args(args)
    flops = load_flops_model(args.hf_config)
    if args.compare:
        if not policy.dynamic:
            raise InputError("--compare needs dynamic packing. Fix: set --max-tokens-per-gpu.")
        print(f"compare: {len(lengths)} samples in {len(set(groups))} groups, dp={layout.dp} "
              f"cp={layout.cp} vpp={layout.vpp}, cap={policy.token_cap(layout):,} tokens; "
              "bound = sum over steps of (oversize samples + ceil(other tokens / cap)), aligned = "
              f"each step's bound rounded up to a multiple of {layout.align_multiple}; LB = mean "
              "per-step "
              "imbalance lower bound max(max item, total/dp)/(total/dp)")
        print(format_compare(compare(lengths, groups, layout, policy, flops)))
        return 0
    work = None if flops is None else flops.per_sample(lengths)
    schedule = build_schedule(lengths, groups, layout, policy, work)
    stats = step_stats(schedule, work)
    cap = policy.token_cap(layout)
    print(f"workload: {len(lengths)} samples in {len(set(groups))} groups; layout dp={layout.dp} "
          f"cp={layout.cp} pp={layout.pp} vpp={layout.vpp} (align multiple "
          f"{layout.align_multiple}); "
          f"packing={policy.packing if policy.dynamic else 'static'} balance={policy.balance} "
          + (f"cap={cap:,} tokens" if cap else f"micro_batch_size={policy.micro_batch_size}"))
    print(format_table(stats))
    for line in format_extras(schedule, stats, policy, layout, flops, args):
        print(line)
    kept = sum(s.num_groups for s in stats)
    print(f"trained: {kept} groups in {len(stats)} steps; dropped: "
          f"{len(schedule.dropped_groups)} groups / {len(schedule.dropped_samples)} samples"
          + (" (set --allow-partial-train-step to train them when feasible)"
             if schedule.dropped_groups and not policy.allow_partial_step else ""))
    if args.plot is not None:
        if not 0 <= args.plot_step < schedule.num_steps:
            raise InputError(f"--plot-step {args.plot_step} is out of range. Fix: pass a step "
                             f"in 0..{schedule.num_steps - 1}.")
        from vime_shell.run.plots import plot_step_loads  # matplotlib: only for --plot

        _written(args.plot, lambda: plot_step_loads(schedule, args.plot, args.plot_step))
        print(f"plot: {args.plot}")
    if args.json is not None:
        text = json.dumps([attrs.asdict(s) for s in stats], indent=1)
        _written(args.json, lambda: write_atomic(args.json, text))
    return 0


def _written(path: Path, write) -> Path:
    """Run ``write``; a failing file system is one line naming the path, not a traceback."""
    try:
        write()
    except OSError as exc:
        raise field_error(InputError, "output", str(path), f"cannot be written ({exc})",
                          "pass a writable path") from None
    return path
