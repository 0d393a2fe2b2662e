"""Partial rollouts on the embedded demo with a long-tailed rollout function, against the plain
run of the same function, measured in the same invocation.

The rollout function (:func:`long_tail_generate`) is per-sample: each of the answer's tokens is
one engine call preceded by a Pareto-distributed sleep (``--scale`` ms x Pareto(``--alpha``),
seeded by the request's sampling seed and the token), so a rollout's wall time is set by its
slowest execution, as with long-tailed agentic rollouts. Runs (``vime train`` subprocesses,
reverse2 from scratch, 16 prompt groups x 8 per rollout, seed 0):

- ``plain``: per-sample generation, every group waits for its slowest sample;
- ``partial``: ``--partial-rollout --over-sampling-batch-size 24
  --mask-offpolicy-in-partial-rollout``: 24 groups in flight, the first 16 to finish train,
  the rest is aborted and continues under the next weights (tokens from older weights masked);
- ``partial_nomask``: the same without the masking (off-policy tokens train, TIS-free).

Reported per run: median rollout (generation) seconds and its ratio to ``plain``; the loop's
seconds (generation + training + sync, startup excluded) in all and until the trailing-10 mean
reward reaches 0.5; reward of the last 10 rollouts and the first rollout whose trailing-10
mean reaches 0.8; the share of
trained response tokens generated under older weights (``partial/offpolicy_token_frac``), the
staleness and the behaviour-vs-old log-prob mismatch (``mismatch_abs``, ``mismatch_kl``) means;
the reward curve in the JSON (``benchmarks/results/partial_rollout.json``).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.partial_rollout [--rollouts 150]``
(about 8 minutes on 2 busy cores; ``--summarize-only --root DIR`` re-reads earlier runs).
"""

import argparse
import asyncio
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.demo_curve import WINDOW, learned_at
from vime_pure.data.sample import Status
from vime_shell.rollout.generate import generate

RUNS = {
    "plain": [],
    "partial": ["--partial-rollout", "--over-sampling-batch-size", "24",
                "--mask-offpolicy-in-partial-rollout"],
    "partial_nomask": ["--partial-rollout", "--over-sampling-batch-size", "24"],
}
SCALE_MS = float(os.environ.get("VIME_TAIL_SCALE_MS", "10"))
ALPHA = float(os.environ.get("VIME_TAIL_ALPHA", "1.2"))
MAX_SLEEP_S = 1.0


async def long_tail_generate(args, sample, sampling_params):
    """One token per engine call, each after a seeded Pareto sleep (see the module docstring)."""
    total = sampling_params["max_new_tokens"]
    while sample.response_length < total:
        rng = np.random.default_rng([sampling_params["sampling_seed"] or 0,
                                     len(sample.weight_versions)])
        await asyncio.sleep(min(SCALE_MS / 1000 * (1 + rng.pareto(ALPHA)), MAX_SLEEP_S))
        sample = await generate(args, sample, {**sampling_params,
                                               "max_new_tokens": sample.response_length + 1})
        if sample.status is not Status.TRUNCATED:  # stopped, or aborted by the partial rollout
            return sample
    return sample


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r and not math.isnan(r[key])]
    return statistics.mean(values) if values else None


def summarize(records: list[dict]) -> dict:
    rewards = [r["reward_mean"] for r in records]
    elapsed = list(itertools.accumulate(r["rollout_s"] + r["train_s"] + r["sync_s"]
                                        for r in records))
    half = learned_at(rewards, 0.5)
    return {"rollouts": len(records),
            "rollout_s_median": statistics.median(r["rollout_s"] for r in records),
            "loop_s": elapsed[-1],
            "reward_first10": statistics.mean(rewards[:WINDOW]),
            "reward_last10": statistics.mean(rewards[-WINDOW:]),
            "learned_at_rollout": learned_at(rewards, 0.8),
            "seconds_to_0.5": None if half is None else elapsed[half],
            **{k: _mean(records, k) for k in ("partial/offpolicy_token_frac", "staleness_mean",
                                              "mismatch_abs", "mismatch_kl")},
            "reward_curve": rewards}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.partial_rollout")
    parser.add_argument("--rollouts", type=int, default=150)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset")
    parser.add_argument("--root", default="runs/bench-partial")
    parser.add_argument("--out", default="benchmarks/results/partial_rollout.json")
    parser.add_argument("--summarize-only", action="store_true",
                        help="re-read the runs under --root instead of training")
    args = parser.parse_args(argv)
    from vime_shell.run.run_log import read_metrics

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, ["src", ".", env.get("PYTHONPATH")]))
    results = {}
    for name in args.runs.split(","):
        run_dir = f"{args.root}/{name}"
        start = time.perf_counter()
        if not args.summarize_only:
            subprocess.run([sys.executable, "-m", "vime_shell.cli", "train", "--run-dir",
                            run_dir, "--overwrite-run-dir", "--num-rollout", str(args.rollouts),
                            "--custom-generate-function-path",
                            "benchmarks.partial_rollout:long_tail_generate", *RUNS[name]],
                           check=True, env=env)
        results[name] = {**summarize(read_metrics(run_dir)),
                         "wall_s": time.perf_counter() - start}
    base = results.get("plain", {}).get("rollout_s_median")
    print(f"{'run':16s} {'rollout s':>9s} {'x plain':>7s} {'loop s':>7s} {'s to 0.5':>8s} "
          f"{'last 10':>7s} {'0.8 at':>6s} {'old tok':>7s} {'stale':>5s} {'|d|':>8s}")
    for name, r in results.items():
        ratio = r["rollout_s_median"] / base if base else float("nan")
        to_half = r["seconds_to_0.5"]
        print(f"{name:16s} {r['rollout_s_median']:9.3f} {ratio:7.2f} {r['loop_s']:7.1f} "
              f"{'-' if to_half is None else f'{to_half:.1f}':>8s} {r['reward_last10']:7.3f} "
              f"{str(r['learned_at_rollout']):>6s} {r['partial/offpolicy_token_frac'] or 0:7.3f} "
              f"{r['staleness_mean'] or 0:5.2f} {r['mismatch_abs'] or 0:8.2e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"scale_ms": SCALE_MS, "alpha": ALPHA,
                                          "load": os.getloadavg(), "runs": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
