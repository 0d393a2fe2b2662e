"""The same job three ways on separate ranks (rank 0 trains, rank 1 generates): synchronous,
one step off (``--train-async``) and fully async (``--fully-async --max-weight-staleness 2``),
with a rollout function whose per-request latency is heavy-tailed, measured in one invocation.

The rollout function (:func:`tail_rollout`) is the default single-turn rollout followed by a
seeded Pareto sleep per prompt group (``--scale-ms`` x (1 + Pareto(``--alpha``)), capped at
1 s, seeded by ``(seed, rollout, prompt)`` so every mode sees the same latencies): a batched
call of many prompts waits for its slowest one, as a round of concurrent agentic requests does;
the fully-async pool runs each prompt group on its own thread, so only the engine calls queue.
Job: the embedded model on reverse2 from scratch, 16 prompts x 8 samples per rollout, seed 0,
``vime train`` under ``torchrun --standalone --nproc-per-node 2``.

Modes: synchronous, one step off, and fully async under each sync policy
(``--pause-generation-mode`` in_place, vime's default; retract; abort), and in place with two and
four batches of samples in flight (``--async-max-concurrent-samples``). ``--scale-ms`` sets the
latency scale, so the job's trainer-to-generation time ratio (reported) can be moved into the
regime of a GPU job, where generation dominates and has a long tail.

Reported per mode: throughput, rollouts per second over the whole run (rollouts over the
summed trainer wall: batch wait + train + sync), and its ratio to the synchronous run's; the
mean and the median wall seconds per rollout (a heavy tail moves the mean, and the mean is
what the throughput pays: the median alone hides the synchronous loop's slow rollouts);
trained tokens per second; the idle fraction of each
rank (trainer: time not training; engine: time with no request in flight, from intervals the
rollout function logs, over the engine's own span, first request to last, since in the
asynchronous modes it runs ahead of the trainer's clock); the reward at equal rollouts
(10-rollout means ending at the middle and at the end of the run, and the first rollout whose 10-rollout mean reaches 0.8; the whole curve in the JSON);
the staleness distribution of the trained groups (fraction per staleness, median) and of the
trained tokens (in-flight updates); the groups recycled; the machine's load as each mode
ended. JSON:
``benchmarks/results/async_tail.json``.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.async_tail [--rollouts 60]
[--scale-ms 20] [--modes sync,fully_async] [--repeat 3]`` (``--repeat``: rounds of every mode,
then the medians: seconds per rollout, each round's throughput against its synchronous run,
the rollout reaching 0.8, and each round's load).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from vime_shell.rollout.functions import single_turn_rollout

MODES = {
    "sync": ["--no-colocate"],
    "one_step_off": ["--train-async"],
    # fully async under each sync policy (--pause-generation-mode): in_place is vime's default
    "fully_async": ["--fully-async", "--max-weight-staleness", "2"],
    "fully_async_retract": ["--fully-async", "--max-weight-staleness", "2",
                            "--pause-generation-mode", "retract"],
    "fully_async_abort": ["--fully-async", "--max-weight-staleness", "2",
                          "--pause-generation-mode", "abort"],
    # two batches in flight (miles' --async-max-concurrent-samples; the job's batch is 16 x 8)
    "fully_async_2x": ["--fully-async", "--max-weight-staleness", "2",
                       "--async-max-concurrent-samples", "256"],
    "fully_async_4x": ["--fully-async", "--max-weight-staleness", "2",
                       "--async-max-concurrent-samples", "512"],
}
# The latency scale sets the job's trainer-to-generation time ratio (a larger scale: a
# generation-dominant job with a long tail, the regime of a GPU job); the engine rank reads it
# from the environment, the runner sets it from --scale-ms.
SCALE_MS = float(os.environ.get("VIME_TAIL_SCALE_MS", "20"))
ALPHA = float(os.environ.get("VIME_TAIL_ALPHA", "1.5"))
MAX_SLEEP_S = 1.0
LOG = "VIME_TAIL_LOG"  # where the engine rank appends its busy intervals


def latency(seed: int, rollout: int, prompt: int) -> float:
    """Seconds of one prompt group's simulated request latency."""
    rng = np.random.default_rng([seed, rollout, prompt, 0x7A11])
    return min(SCALE_MS / 1000 * (1 + rng.pareto(ALPHA)), MAX_SLEEP_S)


def tail_rollout(ctx):
    """``single_turn_rollout`` then the slowest of its prompts' latencies (module docstring)."""
    start = time.time()
    out = single_turn_rollout(ctx)
    seed = ctx.sampling.seed or 0
    time.sleep(max(latency(seed, ctx.rollout_id, ctx.prompt_offset + p)
                   for p in range(len(ctx.prompts))))
    if os.environ.get(LOG):
        with open(os.environ[LOG], "a") as f:
            f.write(json.dumps([start, time.time()]) + "\n")
    return out


def busy_seconds(intervals: list[list[float]]) -> float:
    """Length of the union of ``[start, end]`` intervals. Example: [[0, 2], [1, 3]] -> 3."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def engine_span(intervals: list[list[float]]) -> float:
    """From the engine's first busy interval's start to its last one's end. Example:
    [[1, 2], [4, 6]] -> 5."""
    return max(b for _, b in intervals) - min(a for a, _ in intervals) or 1e-9


def window_mean(rewards: list[float], end: int, width: int = 10) -> float:
    """Mean reward of the ``width`` rollouts ending at rollout ``end`` (exclusive): the modes'
    reward at equal rollouts. Example: ``window_mean([0, 1, 1], 3, width=2) == 1.0``."""
    return statistics.mean(rewards[max(end - width, 0):end])


def first_reaching(rewards: list[float], level: float = 0.8, width: int = 10) -> int | None:
    """The first rollout whose ``width``-rollout mean reward reaches ``level`` (None: never).
    Example: ``first_reaching([0, 1, 1], 0.9, width=2) == 2``."""
    for end in range(width, len(rewards) + 1):
        if window_mean(rewards, end, width) >= level:
            return end - 1
    return None


def distribution(records: list[dict], prefix: str, count: str) -> dict[int, float]:
    """The run's shares per staleness from each record's ``<prefix><s>`` shares, weighted by
    the record's ``count`` (groups or tokens). Example: shares 0.5/0.5 of 2 groups and 1.0 at
    0 of 2 groups give ``{0: 0.75, 1: 0.25}``."""
    totals: dict[int, float] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith(prefix):
                k = int(key[len(prefix):])
                totals[k] = totals.get(k, 0.0) + value * r[count]
    weight = sum(totals.values()) or 1.0
    return {k: v / weight for k, v in sorted(totals.items())}


def summarize(records: list[dict], intervals: list[list[float]]) -> dict:
    walls = [r["rollout_s"] + r["train_s"] + r["sync_s"] for r in records]
    wall = sum(walls)
    rewards = [r["reward_mean"] for r in records]
    stale = distribution(records, "staleness/", "num_groups")
    cumulative, median = 0.0, 0
    for k, share in stale.items():
        cumulative += share
        if cumulative >= 0.5:
            median = k
            break
    return {"rollouts": len(records), "rollouts_per_s": len(records) / wall,
            "wall_per_rollout_s_mean": wall / len(records),
            "wall_per_rollout_s_median": statistics.median(walls),
            "tokens_per_s": sum(r["tokens"] for r in records) / wall,
            "train_to_generation": statistics.median(r["train_s"] for r in records)
            / max(busy_seconds(intervals) / len(records), 1e-9) if intervals else None,
            # trained tokens per token staleness (in-flight updates)
            "token_staleness_frac": distribution(records, "token_staleness/", "tokens"),
            "recycled_groups": records[-1].get("pool_recycled", 0),
            "trainer_idle_frac": 1 - sum(r["train_s"] for r in records) / wall,
            # over the engine's own span (it runs ahead of the trainer's clock in async modes)
            "engine_idle_frac": 1 - busy_seconds(intervals) / engine_span(intervals)
            if intervals else None,
            "reward_first10": statistics.mean(rewards[:10]),
            "reward_last10": statistics.mean(rewards[-10:]),
            "reward_half10": window_mean(rewards, len(rewards) // 2),
            "reaches_0.8_at": first_reaching(rewards),
            "staleness_frac": stale,
            "staleness_median": median, "reward_curve": rewards,
            "probe_gap_max": max((r["probe_gap"] for r in records  # NaN is null in JSON
                                  if r.get("probe_gap") is not None), default=None)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.async_tail")
    parser.add_argument("--rollouts", type=int, default=60)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    parser.add_argument("--scale-ms", type=float, default=SCALE_MS,
                        help="the latency scale: the trainer-to-generation time ratio's knob")
    parser.add_argument("--alpha", type=float, default=ALPHA, help="the Pareto tail index")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of every mode; with more than one, medians over them")
    parser.add_argument("--root", default="runs/bench-async")
    parser.add_argument("--out", default="benchmarks/results/async_tail.json")
    args = parser.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               VIME_TAIL_SCALE_MS=str(args.scale_ms), VIME_TAIL_ALPHA=str(args.alpha))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, ["src", ".", env.get("PYTHONPATH")]))
    rounds = []
    for k in range(args.repeat):  # every mode once per round: the load hits them alike
        results = {name: run_mode(name, args, env, Path(args.root) / f"round{k}" / name)
                   for name in args.modes.split(",")}
        print_table(results, args.rollouts, f"round {k + 1} of {args.repeat}")
        rounds.append(results)
    medians = median_rows(rounds)
    if args.repeat > 1:
        print_medians(medians)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"scale_ms": args.scale_ms, "alpha": args.alpha,
                                          "rollouts": args.rollouts, "load": os.getloadavg(),
                                          "modes": rounds[-1], "rounds": rounds,
                                          "medians": medians}, indent=1))
    return rounds[-1]


def run_mode(name: str, args: argparse.Namespace, env: dict, run_dir: Path) -> dict:
    """One ``vime train`` of mode ``name`` on 2 ranks, summarized."""
    from vime_shell.run.run_log import read_metrics

    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "engine_busy.jsonl"
    log.unlink(missing_ok=True)  # ours: written by the previous run of this benchmark
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", "-m", "vime_shell.cli", "train",
                    "--run-dir", str(run_dir), "--overwrite-run-dir",
                    "--num-rollout", str(args.rollouts), "--rollout-num-gpus", "1",
                    "--rollout-function-path", "benchmarks.async_tail:tail_rollout",
                    *MODES[name]], check=True, env={**env, LOG: str(log)})
    intervals = [json.loads(line) for line in log.read_text().splitlines()]
    out = summarize(read_metrics(run_dir), intervals)
    out["load"] = os.getloadavg()[0]  # the machine's, as the mode ended
    return out


def median_rows(rounds: list[dict]) -> dict:
    """Per mode over the rounds: the median throughput (rollouts per second), the median of
    each round's throughput against that round's synchronous run, the median of the mean and
    the median seconds per rollout, the median rollout reaching 0.8 (None where a round never
    reached it) and every round's load. Example: one round with sync at 5 rollouts/s and a
    mode at 10 gives that mode ``throughput_x_sync 2.0``."""
    out = {}
    for name in rounds[0]:
        ratios = [r[name]["rollouts_per_s"] / r["sync"]["rollouts_per_s"]
                  for r in rounds if "sync" in r]
        reached = [r[name]["reaches_0.8_at"] for r in rounds]
        out[name] = {"rollouts_per_s": statistics.median(r[name]["rollouts_per_s"]
                                                         for r in rounds),
                     "throughput_x_sync": statistics.median(ratios) if ratios else None,
                     "throughput_x_sync_rounds": [round(x, 3) for x in ratios],
                     "wall_per_rollout_s_mean": statistics.median(
                         r[name]["wall_per_rollout_s_mean"] for r in rounds),
                     "wall_per_rollout_s_median": statistics.median(
                         r[name]["wall_per_rollout_s_median"] for r in rounds),
                     "reaches_0.8_at": (statistics.median(reached)
                                        if None not in reached else None),
                     "loads": [round(r[name]["load"], 2) for r in rounds]}
    return out


def print_table(results: dict, rollouts: int, title: str) -> None:
    base = results.get("sync", {}).get("rollouts_per_s")
    half = rollouts // 2
    print(f"{title}\n{'mode':19s} {'rollout/s':>9s} {'x sync':>6s} {'s/r mean':>8s} "
          f"{'s/r med':>7s} {'tok/s':>6s} {'trainer idle':>12s} {'engine idle':>11s} "
          f"{f'reward@{half}':>10s} {f'reward@{rollouts}':>10s} {'0.8 at':>6s} "
          f"{'recycled':>8s} {'load':>5s}  staleness (groups | tokens)")
    for name, r in results.items():
        ratio = r["rollouts_per_s"] / base if base else float("nan")
        dist = " ".join(f"{k}:{v:.2f}" for k, v in r["staleness_frac"].items())
        tokens = " ".join(f"{k}:{v:.2f}" for k, v in r["token_staleness_frac"].items()) or "-"
        reached = r["reaches_0.8_at"]
        print(f"{name:19s} {r['rollouts_per_s']:9.2f} {ratio:6.2f} "
              f"{r['wall_per_rollout_s_mean']:8.3f} {r['wall_per_rollout_s_median']:7.3f} "
              f"{r['tokens_per_s']:6.0f} {r['trainer_idle_frac']:12.2f} "
              f"{r['engine_idle_frac'] or 0:11.2f} {r['reward_half10']:10.3f} "
              f"{r['reward_last10']:10.3f} {'-' if reached is None else reached:>6} "
              f"{r['recycled_groups']:8d} {r['load']:5.1f}  {dist} | {tokens}")


def print_medians(medians: dict) -> None:
    print(f"medians over the rounds\n{'mode':19s} {'rollout/s':>9s} "
          f"{'throughput x sync':>17s} {'s/r mean':>8s} {'s/r med':>7s} {'0.8 at':>6s}  "
          "x sync per round | loads")
    for name, m in medians.items():
        ratio = m["throughput_x_sync"]
        reached = m["reaches_0.8_at"]
        print(f"{name:19s} {m['rollouts_per_s']:9.2f} "
              f"{'-' if ratio is None else f'{ratio:.2f}':>17s} "
              f"{m['wall_per_rollout_s_mean']:8.3f} {m['wall_per_rollout_s_median']:7.3f} "
              f"{'-' if reached is None else reached:>6}  {m['throughput_x_sync_rounds']} | "
              f"{m['loads']}")


if __name__ == "__main__":
    main()
