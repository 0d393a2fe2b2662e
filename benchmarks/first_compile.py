"""The compiled scheduler's first compile: CPU seconds of the first schedule of each policy on
a fresh numba cache, then of the next process that loads that cache.

Usage::

    python -m benchmarks.first_compile                     # every policy (~2-3 min of CPU)
    python -m benchmarks.first_compile --policies straggler

Per policy it runs two child processes with ``NUMBA_CACHE_DIR`` set to a new temporary
directory and ``VIME_KERNELS=compiled``: the first compiles that policy's step loop and its
kernels (``compiled_steps``: one loop per packing and kind of balance, so no other policy's
kernels), the second loads them from the cache. Each child plans one 2048-sample batch of
layout A's shape (``benchmarks.schedule``, dp 8) and reports its CPU time around
``build_schedule``: numba's import and the compile (or the cache load) included, the
process's own imports not. Timings are noisy on a shared machine; the load average is printed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.schedule import POLICIES

_CHILD = """
import json, time
from vime_pure import BatchingPolicy, ParallelLayout, build_schedule
from benchmarks.schedule import DENSE_8B, POLICIES, workload
packing, balance, _ = POLICIES[{policy!r}]
lengths, group_ids = workload(2048, "grpo8")
policy = BatchingPolicy(global_batch_size=64, max_tokens_per_gpu=16384, packing=packing,
                        balance=balance, allow_partial_step=True)
c0 = time.process_time()
build_schedule(lengths, group_ids, ParallelLayout(dp=8), policy, DENSE_8B.per_sample(lengths))
print(json.dumps(time.process_time() - c0))
"""


def first_schedule_cpu(policy: str, cache: str) -> float:
    """CPU seconds of one child's first compiled schedule of ``policy`` with ``cache``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "VIME_KERNELS": "compiled"}
    out = subprocess.run([sys.executable, "-c", _CHILD.format(policy=policy)], env=env,
                         check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, of {list(POLICIES)}")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'policy':<14}{'first (fresh cache) s':>24}{'next (cached) s':>18}")
    for policy in args.policies.split(","):
        with tempfile.TemporaryDirectory(prefix="vime-numba-") as cache:
            first = first_schedule_cpu(policy, cache)
            cached = first_schedule_cpu(policy, cache)
        print(f"{policy:<14}{first:>24.1f}{cached:>18.2f}")


if __name__ == "__main__":
    main()
