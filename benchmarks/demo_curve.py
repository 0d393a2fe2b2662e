"""The embedded demo's learning curve: reward from scratch to learned, in wall-clock minutes.

Runs ``vime demo`` (``vime train`` with the default configuration, what ``make demo`` runs) in
a subprocess, exactly as a user would, then reads its ``metrics.jsonl`` and reports:

- **start** / **end**: mean reward of the first / last 10 rollouts;
- **learned at**: the first rollout whose trailing 10-rollout mean reward reaches ``--target``
  (0.8), and the wall-clock minutes to it (process start included: imports, model build);
- **minutes**: the whole run; **tokens/s**: median over rollouts of trained tokens per second
  of rollout time (generation + training + weight sync);
- the machine's load average before and after (the 2-core machine is shared: compare runs only
  at similar load).

``--math`` measures ``vime demo --math`` (the dataset path: JSONL prompts, chat template, math
reward, dynamic sampling) and adds the eval reward (start, end, curve) and the share of prompt
groups the dynamic-sampling filter dropped per rollout.

The curve is a measurement, not a test: the seed fixes the data, but the time depends on the
machine. Result JSON: ``--out`` (default ``benchmarks/results/demo_curve.json``, or
``demo_math_curve.json``); the run's ``curves.png`` is copied next to it as
``demo_curves.png`` / ``demo_math_curves.png`` (for the README).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.demo_curve [--math]``
(``--run-dir``, ``--target``, and any ``vime train`` flag after ``--``, e.g. ``-- --seed 1``).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

WINDOW = 10


def learned_at(rewards: list[float], target: float, window: int = WINDOW) -> int | None:
    """First step whose trailing ``window``-step mean reward reaches ``target``, or None.

    Example: ``learned_at([0.0] * 5 + [1.0] * 10, 0.8)`` is 12 (steps 3..12 average 0.8).
    """
    for k in range(window - 1, len(rewards)):
        if sum(rewards[k - window + 1:k + 1]) / window >= target:
            return k
    return None


def summarize(records: list[dict], wall_s: float, target: float) -> dict:
    """Curve summary from metrics records and the run's wall time (see the module docstring).

    Example: rewards ``[0, 0, ..., 0.9, 0.9]`` reaching a trailing mean of 0.8 at rollout 140
    give ``learned_at_rollout == 140``.
    """
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    records = [r for r in records if not r.get("eval_only")]
    rewards = [r["reward_mean"] for r in records]
    seconds = [r["rollout_s"] + r["train_s"] + r["sync_s"] + r.get("eval_s", 0.0)
               for r in records]
    startup = max(wall_s - sum(seconds), 0.0)
    learned = learned_at(rewards, target)
    learned_min = None if learned is None else (startup + sum(seconds[:learned + 1])) / 60
    head, tail = rewards[:WINDOW], rewards[-WINDOW:]
    return {
        "rollouts": len(records),
        "reward_start": sum(head) / len(head), "reward_end": sum(tail) / len(tail),
        "target": target, "learned_at_rollout": learned, "learned_at_minutes": learned_min,
        "minutes": wall_s / 60, "startup_s": startup,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in records),
        "seconds_per_rollout_median": statistics.median(seconds),
        "reward_curve": rewards,
        **_eval_summary(evals), **_filter_summary(records),
    }


def _eval_summary(evals: list[dict]) -> dict:
    """Per eval set: reward before training, after the last rollout, and the curve."""
    names = sorted({k.split("/")[1] for r in evals for k in r if k.endswith("/reward_mean")})
    out = {}
    for name in names:
        points = [(r["rollout"], r[f"eval/{name}/reward_mean"]) for r in evals
                  if f"eval/{name}/reward_mean" in r]
        out[f"eval_{name}"] = {"start": points[0][1], "end": points[-1][1], "curve": points}
    return out


def _filter_summary(records: list[dict]) -> dict:
    """Share of prompt groups the dynamic-sampling filter dropped, per rollout."""
    shares = [r["filtered_frac"] for r in records if "filtered_frac" in r
              and r.get("prompts_generated", 0) != r.get("prompts_kept", 0)]
    if not shares:
        return {}
    return {"filtered_frac_mean": statistics.mean(shares), "filtered_frac_min": min(shares),
            "filtered_frac_max": max(shares), "filtered_frac_curve": shares,
            "kept_groups_curve": [r["num_groups"] for r in records]}


def compare_runs(a: list[dict], b: list[dict]) -> dict:
    """Where two runs' reward curves first differ, and their largest loss difference before."""
    pairs = list(zip(a, b))
    first = next((i for i, (x, y) in enumerate(pairs) if x["reward_mean"] != y["reward_mean"]),
                 None)
    same = pairs[:first] if first is not None else pairs
    return {"identical_reward_rollouts": len(same), "first_reward_difference": first,
            "max_loss_difference_before": max((abs(x["loss"] - y["loss"]) for x, y in same),
                                              default=0.0),
            "microbatches": [a[0]["num_microbatches"], b[0]["num_microbatches"]]}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo_curve")
    parser.add_argument("--math", action="store_true", help="measure `vime demo --math`")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--compare-run-dir", default=None,
                        help="an earlier run of the same seed (e.g. with another "
                             "--max-tokens-per-gpu): report where the reward curves first differ")
    args = parser.parse_args(own)
    name = "demo_math" if args.math else "demo"
    args.run_dir = args.run_dir or f"runs/{name.replace('_', '-')}"
    args.out = args.out or f"benchmarks/results/{name}_curve.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, ["src", env.get("PYTHONPATH")]))
    load_before = os.getloadavg()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vime_shell.cli", "demo", "--run-dir", args.run_dir,
                    *(["--math"] if args.math else []), *extra], check=True, env=env)
    wall = time.perf_counter() - start
    from vime_shell.run.run_log import read_metrics

    result = summarize(read_metrics(args.run_dir), wall, args.target)
    result.update(load_before=load_before, load_after=os.getloadavg(), cpus=os.cpu_count(),
                  run_dir=args.run_dir, flags=extra,
                  plots=[str(Path(args.run_dir) / n) for n in ("curves.png", "schedule.png")])
    if args.compare_run_dir:
        result["compare"] = compare_runs(read_metrics(args.run_dir),
                                         read_metrics(args.compare_run_dir))
        print(f"compare with {args.compare_run_dir}: {result['compare']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    curves = Path(args.run_dir) / "curves.png"
    if curves.is_file():
        shutil.copyfile(curves, out.with_name(f"{name}_curves.png"))
    learned = (f"reached {args.target} (10-rollout mean) at rollout {result['learned_at_rollout']}"
               f" after {result['learned_at_minutes']:.1f} min" if result["learned_at_rollout"]
               is not None else f"never reached {args.target}")
    print(f"demo curve: reward {result['reward_start']:.3f} -> {result['reward_end']:.3f} over "
          f"{result['rollouts']} rollouts in {result['minutes']:.1f} min; {learned}; "
          f"{result['tokens_per_s_median']:.0f} tokens/s (median), "
          f"{result['seconds_per_rollout_median']:.2f} s/rollout; load {load_before[0]:.1f} -> "
          f"{result['load_after'][0]:.1f} on {result['cpus']} CPUs; {args.out}")
    for key, value in result.items():
        if key.startswith("eval_"):
            print(f"  {key}: reward {value['start']:.3f} -> {value['end']:.3f}")
    if "filtered_frac_mean" in result:
        print(f"  dynamic sampling dropped {result['filtered_frac_mean']:.0%} of prompt groups "
              f"per rollout (min {result['filtered_frac_min']:.0%}, max "
              f"{result['filtered_frac_max']:.0%})")
    return result


if __name__ == "__main__":
    main()
