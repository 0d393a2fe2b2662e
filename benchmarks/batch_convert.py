"""64k-sample rollout batch: ``RolloutBatch.from_samples`` + ``build_schedule`` + ``rank_batch``.

Two seeded workloads of 8192 prompts x 8 samples (depth-1 output), float rewards, rollout
log-probs on every sample, dp=8, FFD packing under 16k tokens per GPU, one step per batch:

- ``short``: prompt 16-64 tokens, response 16-128 (about 110 tokens per sample);
- ``long``: prompt 32-256 tokens, response 16-768 (about 540 tokens per sample).

Per-sample work (validation, ids, rewards) is Python; per-token work (copying tokens, masks,
log-probs into columns, building each rank's micro-batch records) is numpy and grows with the token count,
so both are printed, with ns per token. Tokens and log-probs are numpy arrays, as a shell
should build them when each sample arrives; ``--lists`` also times plain Python lists, whose
int conversion costs tens of ns per token. Baseline measured in the same run: one
``np.concatenate`` of every sample's token array (the copy any columnar conversion must make);
ratios are median / baseline median. ``build_schedule`` (the scheduler, not this module) is
timed once.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.batch_convert`` (``--quick`` for
a 2k-sample smoke run, ``--repeats N``, ``--lists``).
"""

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from vime_pure import (BatchingPolicy, ParallelLayout, RolloutBatch, Sample, rank_batch,
                       schedule_for)


WORKLOADS = {"short": ((16, 65), (16, 129)), "long": ((32, 257), (16, 769))}


def make_output(num_prompts: int, per_prompt: int, as_lists: bool, workload: str = "long",
                seed: int = 0) -> list:
    (p_lo, p_hi), (r_lo, r_hi) = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_prompts):
        prompt = rng.integers(0, 150_000, rng.integers(p_lo, p_hi), dtype=np.int32)
        group = []
        for _ in range(per_prompt):
            resp = int(rng.integers(r_lo, r_hi))
            tokens = np.concatenate([prompt, rng.integers(0, 150_000, resp, dtype=np.int32)])
            log_probs = -rng.random(resp, dtype=np.float32)
            group.append(Sample(
                tokens=tokens.tolist() if as_lists else tokens, response_length=resp,
                reward=float(rng.integers(0, 2)), rollout_log_probs=(
                    log_probs.tolist() if as_lists else log_probs)))
        out.append(group)
    return out


def median_s(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and CPU (process) seconds. On a shared machine the CPU time is the stable
    one: wall time also counts waiting for a core."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def run(num_prompts: int, repeats: int, workload: str, with_lists: bool) -> float:
    layout = ParallelLayout(dp=8)
    policy = BatchingPolicy(global_batch_size=num_prompts * 8, max_tokens_per_gpu=16384)
    output = make_output(num_prompts, 8, as_lists=False, workload=workload)
    token_parts = [s.tokens for group in output for s in group]
    n, total = len(token_parts), sum(len(t) for t in token_parts)
    print(f"[{workload}] {n} samples, {total / 1e6:.1f}M tokens ({total / n:.0f} per sample), "
          f"dp={layout.dp}, medians of {repeats}")
    baseline = median_s(lambda: np.concatenate(token_parts), repeats)
    floor = baseline[1]
    batch = RolloutBatch.from_samples(output)
    sched = schedule_for(batch, layout, policy)
    convert = median_s(lambda: RolloutBatch.from_samples(output), repeats)
    records = median_s(lambda: [rank_batch(batch, sched, dp_rank=r) for r in range(layout.dp)],
                       repeats)
    both = (convert[0] + records[0], convert[1] + records[1])
    rows = [("baseline: concatenate tokens", baseline), ("from_samples", convert),
            ("rank_batch, all 8 ranks", records), ("convert + records", both),
            ("build_schedule (once)", median_s(lambda: schedule_for(batch, layout, policy), 1))]
    if with_lists:
        listed = make_output(num_prompts, 8, as_lists=True, workload=workload)
        rows.append(("from_samples, Python-list tokens",
                     median_s(lambda: RolloutBatch.from_samples(listed), max(1, repeats // 2))))
    print(f"  {'':34s} {'wall ms':>8s} {'cpu ms':>8s} {'cpu/baseline':>12s} "
          f"{'cpu ns/token':>12s}")
    for name, (wall, cpu) in rows:
        print(f"  {name:34s} {wall * 1e3:8.1f} {cpu * 1e3:8.1f} {cpu / floor:12.1f} "
              f"{cpu / total * 1e9:12.1f}")
    print(f"[{workload}] convert+records of {n} samples: {both[1]:.3f} s CPU, {both[0]:.3f} s "
          "wall (medians)")
    return both[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2k samples, 2 repeats (smoke)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lists", action="store_true", help="also time Python-list tokens")
    args = parser.parse_args(argv)
    if args.quick:
        run(num_prompts=256, repeats=2, workload="short", with_lists=True)
        return
    for workload in WORKLOADS:
        run(num_prompts=8192, repeats=args.repeats, workload=workload, with_lists=args.lists)


if __name__ == "__main__":
    main()
