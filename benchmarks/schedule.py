"""Scheduler benchmark: ``build_schedule`` vs a naive anchor-style reference, same run.

Usage::

    python -m benchmarks.schedule            # full run (a few minutes), updates README table
    python -m benchmarks.schedule --quick    # CI smoke size, seconds

Per layout (A-G of the issue), policy and size it measures the median wall time and median
CPU time of ``build_schedule`` (schedule construction and its invariant checks included), the
speed-up against ``benchmarks.reference.reference_schedule`` timed once in the same run, and the
schedule's quality (``benchmarks.metrics``). With numba installed (``vime[fast]``) it times the
compiled kernels and, in the same run, the pure-Python ones (``pure``: their time and the
compiled speed-up over them), and checks both give the same schedule. Workloads come from
``vime_pure.scheduling.workloads.synthetic_workload`` (seeded); FLOPs from ``FlopsModel`` of the dense 8B
decoder. Sizes smaller than one step run as one partial step (``allow_partial_step=True``).
The reference runs only while its previous size finished within ``--ref-budget`` seconds (it is
quadratic; each size is 4x the last), and on the single-step sizes only with ``--ref-steps``. Timings on a shared machine are noisy: compare the ratios
and CPU times, and read the load average recorded with the results.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.metrics import step_metrics
from benchmarks.reference import reference_schedule
from vime_pure import BatchingPolicy, ParallelLayout, build_schedule
from vime_pure.scheduling.flops import FlopsModel
from vime_pure.scheduling.registry import kernel_set, numba_available
from vime_pure.scheduling.workloads import synthetic_workload

# name: (dp, cp, max_tokens_per_gpu, vpp, microbatch_group, groups per step, fan-out)
LAYOUTS = {
    "A": (8, 1, 16384, 1, None, 256, "grpo8"),
    "B": (64, 1, 32768, 1, None, 1024, "grpo16"),
    "C": (64, 2, 32768, 2, 4, 1024, "grpo16"),
    "D": (256, 2, 65536, 1, None, 4096, "grpo16"),
    "E": (256, 1, 16384, 2, 4, 4096, "grpo16"),
    "F": (64, 1, 32768, 1, None, 512, "agentic8"),
    "G": (256, 2, 32768, 2, 4, 2048, "agentic8"),
}
# policy label: (packing, balance, reference mode)
POLICIES = {
    "ffd/strided": ("ffd", "strided", "strided"),
    "ffd/tokens": ("ffd", "tokens", "tokens"),
    "flops/flops": ("flops", "flops", "flops"),
    "straggler": ("ffd", "straggler", "flops"),
}
SIZES = {"1k": 1024, "4k": 4096, "16k": 16384, "64k": 65536, "256k": 262144,
         "step16k": 16384, "step64k": 65536}
QUICK = {"layouts": ["A", "C"], "sizes": ["1k"]}
DENSE_8B = FlopsModel.from_hf_config({
    "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
    "vocab_size": 151936})
README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


def workload(num_samples: int, fanout: str, seed: int = 0):
    """Whole groups totalling at most ``num_samples`` samples."""
    groups = num_samples if fanout != "agentic8" else num_samples * 6 // 10
    w = synthetic_workload(num_groups=groups, fanout=fanout, seed=seed)
    per_group = np.bincount(w.group_ids)
    keep = int(np.searchsorted(np.cumsum(per_group), num_samples, side="right"))
    n = int(per_group[:keep].sum())
    return w.lengths[:n], w.group_ids[:n]


def _timed(fn, repeats: int):
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - w0)
    return out, statistics.median(walls), statistics.median(cpus)


def run_case(layout_name: str, size: str, policy_name: str, repeats: int, reference: bool):
    dp, cp, mtpg, vpp, mbg, gbs, fanout = LAYOUTS[layout_name]
    lengths, group_ids = workload(SIZES[size], fanout)
    flops = DENSE_8B.per_sample(lengths)
    if size.startswith("step"):
        gbs = int(np.unique(group_ids).size)
    layout = ParallelLayout(dp=dp, cp=cp, vpp=vpp, microbatch_group=mbg)
    packing, balance, ref_mode = POLICIES[policy_name]
    policy = BatchingPolicy(global_batch_size=gbs, max_tokens_per_gpu=mtpg, packing=packing,
                            balance=balance, allow_partial_step=True)
    build = lambda: build_schedule(lengths, group_ids, layout, policy, flops)  # noqa: E731
    sched, wall, cpu = _timed(build, repeats)  # the default set: by size (registry)
    pure = None
    if numba_available():  # the pure-Python fallback, same run, for the kernels' own speed-up
        os.environ["VIME_KERNELS"] = "pure"
        try:
            pure_sched, pure_wall, pure_cpu = _timed(build, repeats)
        finally:
            del os.environ["VIME_KERNELS"]
        if pure_sched != sched:
            raise AssertionError(f"{layout_name}/{size}/{policy_name}: kernel sets disagree")
        pure = {"wall_ms": 1e3 * pure_wall, "cpu_ms": 1e3 * pure_cpu, "speedup": pure_wall / wall}
    cap, multiple = mtpg * cp, layout.align_multiple
    row = {"layout": layout_name, "size": size, "policy": policy_name, "samples": len(lengths),
           "wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu, "repeats": repeats,
           "kernels": kernel_set(num_samples=len(lengths)).name, "pure": pure,
           **step_metrics([s.microbatches for s in sched.steps], lengths, flops, cap, dp, multiple)}
    if reference:
        ref, ref_wall, ref_cpu = _timed(lambda: reference_schedule(
            lengths, group_ids.tolist(), dp, multiple, gbs, cap, ref_mode, flops), 1)
        quality = step_metrics(ref, lengths, flops, cap, dp, multiple)
        row["reference"] = {"mode": ref_mode, "wall_ms": 1e3 * ref_wall, "cpu_ms": 1e3 * ref_cpu,
                            **{k: v for k, v in quality.items() if k != "mb_per_rank"}}
        row["speedup"] = ref_wall / wall
        row["cpu_speedup"] = ref_cpu / cpu
    return row


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "load_avg_start": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run(layouts, sizes, policies, ref_budget_s: float, ref_steps: bool = False,
        log=print) -> dict:
    info, rows = machine(), []
    for name in layouts:
        for policy in policies:
            ref_ok = ref_budget_s > 0
            for size in sizes:
                repeats = 3 if SIZES[size] >= 65536 else 5
                single_step = size.startswith("step")
                row = run_case(name, size, policy, repeats,
                               reference=ref_steps and ref_ok if single_step else ref_ok)
                rows.append(row)
                ref = row.get("reference")
                if ref is not None and ref["wall_ms"] > 1e3 * ref_budget_s and not single_step:
                    ref_ok = False  # the next, 4x larger size would take minutes
                log(_line(row))
    info["load_avg_end"] = os.getloadavg()
    return {"machine": info, "rows": rows}


def _line(r: dict) -> str:
    speed = f"x{r['speedup']:.0f}" if "speedup" in r else "-"
    pure = f"pure {r['pure']['wall_ms']:7.1f} ms x{r['pure']['speedup']:4.1f}" if r["pure"] else ""
    return (f"{r['layout']} {r['size']:>7} {r['policy']:<12} {r['wall_ms']:8.1f} ms "
            f"(cpu {r['cpu_ms']:7.1f}) {speed:>6} {pure} mb+{r['mb_over_aligned_pct']:.2f}% "
            f"tok {r['tok_imb_mean']:.3f}/{r['tok_imb_worst']:.3f} "
            f"flops {r['flops_imb_mean']:.3f}/{r['flops_imb_worst']:.3f} "
            f"viol {r['cap_violations']}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke size (seconds)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/schedule.json"))
    parser.add_argument("--readme", type=Path, default=None,
                        help="update this README's table (default: benchmarks/README.md on a "
                             "full run; nothing with --quick, --layouts, --sizes or "
                             "--no-reference, whose partial table would replace the full one)")
    parser.add_argument("--layouts", default=None, help="comma-separated subset, e.g. A,D")
    parser.add_argument("--sizes", default=None, help="comma-separated subset of " + ",".join(SIZES))
    parser.add_argument("--ref-budget", type=float, default=1.0,
                        help="stop running the reference for larger sizes after a run this long")
    parser.add_argument("--ref-steps", action="store_true",
                        help="also time the reference on single big steps (minutes: it is "
                             "quadratic within a step)")
    parser.add_argument("--no-reference", action="store_true", help="time vime only")
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",") if args.layouts else (
        QUICK["layouts"] if args.quick else list(LAYOUTS))
    sizes = args.sizes.split(",") if args.sizes else (QUICK["sizes"] if args.quick else list(SIZES))
    budget = 0.0 if args.no_reference else 0.5 if args.quick else args.ref_budget
    result = run(layouts, sizes, list(POLICIES), budget, args.ref_steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    partial = args.quick or args.layouts or args.sizes or args.no_reference
    readme = args.readme or (None if partial else Path("benchmarks/README.md"))
    if readme is not None:
        from benchmarks.table import update_readme

        update_readme(readme, result, README_START, README_END)
    return result


if __name__ == "__main__":
    main()
