"""Work stealing in the fully-async pools against static slices, with a straggler engine rank.

One 3-process gloo job (rank 0 trains, ranks 1 and 2 each run an HF engine and a pool,
``--fully-async --max-weight-staleness 1``) on the embedded model, reverse2, 8 prompts x 4
samples per rollout. Engine rank 1 is a straggler: every prompt group it generates also waits
``--straggle-s`` seconds under a lock of its process (:func:`straggler_rollout`: a slow engine
that serves one group at a time). Two ways, alternating in one invocation so both see the same
machine load:

- ``static``: each pool over its static contiguous half of every prompt block
  (``GroupPool.static_slices``, the old design): every batch waits for the straggler's half;
- ``stealing``: the pools share one queue of draws (the default): engine rank 0 takes what
  engine rank 1 has not started, and regenerates its groups that went stale.

Reported per way: the median makespan (seconds from the first rollout's request to the last
rollout's end, the sum of the trainer's per-rollout rollout + train + sync seconds), the
groups each engine rank gave to the trained batches, the recycled groups; then the ratio of
the medians (stealing / static, lower is better) and the load average. JSON:
``benchmarks/results/work_stealing.json``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.work_stealing [--repeats 3]``
"""

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from vime_shell.megatron.spawn import spawn
from vime_shell.models.embedded import build_embedded
from vime_shell.rollout.functions import single_turn_rollout

WAYS = ("static", "stealing")
STRAGGLE = "VIME_STRAGGLE_S"  # seconds per group on the straggler
_LOCK = threading.Lock()  # the straggler's one group at a time


def straggler_rollout(ctx):
    """The default rollout; on the job's last rank (engine rank 1) each group also holds the
    process's lock for ``$VIME_STRAGGLE_S`` seconds (a slow engine serving one at a time)."""
    out = single_turn_rollout(ctx)
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        with _LOCK:
            time.sleep(float(os.environ[STRAGGLE]))
    return out


def worker(rank: int, root: str, cache: str, static: bool, rollouts: int,
           straggle_s: float) -> dict | None:
    """One job, static slices or work stealing; the trainer returns its per-rollout records."""
    os.environ["VIME_CACHE_DIR"] = cache
    os.environ[STRAGGLE] = str(straggle_s)
    from vime_shell.settings.train_config import TrainConfig
    from vime_shell.sources.pool import GroupPool
    from vime_shell.run.driver import run_training

    GroupPool.static_slices = static
    cfg = TrainConfig(rollout_batch_size=8, n_samples_per_prompt=4, global_batch_size=32,
                      lr=5e-4, seed=0, num_rollout=rollouts, rollout_num_gpus=2,
                      colocate=False, fully_async=True, max_weight_staleness=1,
                      rollout_function_path="benchmarks.work_stealing:straggler_rollout",
                      run_dir=f"{root}/{'static' if static else 'stealing'}")
    result = run_training(cfg, progress=False)
    return {"records": result.records} if rank == 0 else None


def summarize(records: list[dict]) -> dict:
    last = records[-1]
    return {"makespan_s": sum(r["rollout_s"] + r["train_s"] + r["sync_s"] for r in records),
            "groups_engine_rank_0": sum(r["pool_part_engine_rank_0"] for r in records),
            "groups_engine_rank_1": sum(r["pool_part_engine_rank_1"] for r in records),
            "recycled": last["pool_recycled"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.work_stealing")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per way (alternating)")
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--straggle-s", type=float, default=0.25,
                        help="seconds each group of engine rank 1 waits, one at a time")
    parser.add_argument("--out", default="benchmarks/results/work_stealing.json")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="vime-steal-") as root:
        cache = Path(root, "embedded")
        build_embedded(cache)
        for i in range(args.repeats):
            for way in WAYS:
                trainer, *_ = spawn(worker, 3, f"{root}/{i}", str(cache), way == "static",
                                    args.rollouts, args.straggle_s, timeout=900)
                runs[way].append(summarize(trainer["records"]))
    medians = {way: statistics.median(r["makespan_s"] for r in runs[way]) for way in WAYS}
    ratio = medians["stealing"] / medians["static"]
    load = os.getloadavg()
    print(f"{args.rollouts} rollouts x 8 prompts, K = 1, engine rank 1 +{args.straggle_s} s "
          f"per group (one at a time), {args.repeats} jobs per way")
    print(f"{'way':9s} {'makespan s (median)':>20s} {'runs':>22s} {'groups r0/r1':>14s} "
          f"{'recycled':>8s}")
    for way in WAYS:
        r = runs[way]
        spans = " ".join(f"{x['makespan_s']:.1f}" for x in r)
        groups = f"{r[-1]['groups_engine_rank_0']}/{r[-1]['groups_engine_rank_1']}"
        print(f"{way:9s} {medians[way]:20.2f} {spans:>22s} {groups:>14s} "
              f"{r[-1]['recycled']:8d}")
    print(f"stealing / static makespan: {ratio:.2f}   load average {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f}")
    out = {"rollouts": args.rollouts, "straggle_s": args.straggle_s, "repeats": args.repeats,
           "load": load, "median_makespan_s": medians, "ratio_stealing_to_static": ratio,
           "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
