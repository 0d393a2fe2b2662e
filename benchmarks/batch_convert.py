"""64k-sample rollout batch: ``RolloutBatch.from_samples`` + ``build_schedule`` + ``shard``.

Workload: 8192 prompts x 8 samples (depth-1 output), prompt 32-256 tokens, response 16-768
tokens (uniform, seeded), float rewards, rollout log-probs on every sample, dp=8, FFD packing
under 16k tokens per GPU, ``global_batch_size`` = all groups (one step per batch).

Token storage matters: converting Python ints costs tens of ns per token, so the benchmark
times samples whose tokens/log-probs are numpy arrays (what a shell should build as each
sample arrives) and, separately, plain Python lists. Baseline measured in the same run: one
``np.concatenate`` of every sample's token array (the copy any columnar conversion must make);
ratios are median / baseline median.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.batch_convert`` (``--quick`` for
a 2k-sample smoke run, ``--repeats N``).
"""

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from vime_pure import BatchingPolicy, ParallelLayout, RolloutBatch, Sample, schedule_for, shard


def make_output(num_prompts: int, per_prompt: int, as_lists: bool, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for p in range(num_prompts):
        prompt = rng.integers(0, 150_000, rng.integers(32, 257), dtype=np.int32)
        group = []
        for _ in range(per_prompt):
            resp = int(rng.integers(16, 769))
            tokens = np.concatenate([prompt, rng.integers(0, 150_000, resp, dtype=np.int32)])
            log_probs = -rng.random(resp, dtype=np.float32)
            group.append(Sample(
                tokens=tokens.tolist() if as_lists else tokens, response_length=resp,
                reward=float(rng.integers(0, 2)), rollout_log_probs=(
                    log_probs.tolist() if as_lists else log_probs)))
        out.append(group)
    return out


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(num_prompts: int, repeats: int, with_lists: bool) -> None:
    layout = ParallelLayout(dp=8)
    policy = BatchingPolicy(global_batch_size=num_prompts * 8, max_tokens_per_gpu=16384)
    output = make_output(num_prompts, 8, as_lists=False)
    token_parts = [s.tokens for group in output for s in group]
    n, total = len(token_parts), sum(len(t) for t in token_parts)
    print(f"{n} samples, {total / 1e6:.1f}M tokens, dp={layout.dp}, repeats={repeats}")
    floor = median_s(lambda: np.concatenate(token_parts), repeats)
    batch = RolloutBatch.from_samples(output)
    sched = schedule_for(batch, layout, policy)
    rows = [("baseline: concatenate tokens", floor),
            ("from_samples (array tokens)", median_s(lambda: RolloutBatch.from_samples(output),
                                                     repeats)),
            ("build_schedule", median_s(lambda: schedule_for(batch, layout, policy), repeats)),
            ("shard (8 ranks)", median_s(lambda: shard(batch, sched), repeats))]
    convert_shard = rows[1][1] + rows[3][1]
    rows.append(("convert + shard", convert_shard))
    rows.append(("convert + schedule + shard", convert_shard + rows[2][1]))
    if with_lists:
        listed = make_output(num_prompts, 8, as_lists=True)
        rows.append(("from_samples (Python-list tokens)",
                     median_s(lambda: RolloutBatch.from_samples(listed), max(1, repeats // 2))))
    for name, secs in rows:
        print(f"  {name:36s} {secs * 1e3:9.1f} ms   x{secs / floor:6.1f} baseline")
    print(f"convert+shard of {n} samples: {convert_shard:.3f} s (median)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2k samples, 2 repeats (smoke)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-lists", action="store_true", help="skip the Python-list variant")
    args = parser.parse_args(argv)
    if args.quick:
        run(num_prompts=256, repeats=2, with_lists=True)
    else:
        run(num_prompts=8192, repeats=args.repeats, with_lists=not args.no_lists)


if __name__ == "__main__":
    main()
