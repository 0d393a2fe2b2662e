"""Generation makespan of contiguous prompt blocks vs the engines' work queue at 1, 2 and 4
claims per engine: a MODEL, not a measurement (no engine runs here; the claim order and the
chunks are the product's own: ``prompt_shares``, ``queue_chunk_size``, ``chunk_range``).

A chunk (or block) is one batched ``generate`` call, modelled two ways:

- ``tail`` (vLLM, any engine on a GPU: the batch decodes in parallel): ``response tokens /
  256 + longest response`` decode steps of 30 ms: throughput-bound while 256 sequences are in
  flight, then a tail while the longest responses finish;
- ``tokens`` (the HF engine on CPU: every step costs the whole padded batch): ``sequences x
  longest response`` token-steps of 30 ms / 256: a call's time grows with its work, so more
  calls cost nothing.

The queue: the engine that frees first claims the next chunk (``store.add`` order). Blocks:
engine ``e`` generates ``prompt_shares(P, E)[e]`` in one call. The makespan is the last
engine's finish. Scenarios (response lengths lognormal around 1k tokens, sigma 0.8, drawn per
sample): ``equal`` engines; ``straggler``: engine 0 at half speed (a slow node, a co-tenant);
``skewed``: later prompts' responses up to 3x longer (dataset order), which blocks hand to the
last engine alone.

``python -m benchmarks.work_queue`` prints, per model and scenario, the median makespan of the
blocks over 21 seeds and the ratio queue / blocks for 1, 2 and 4 claims per engine (below 1:
the queue is faster). It is why ``chunks_per_engine`` is 1 for tail-bound engines and 4 for
the HF engine on CPU (``vime_pure.data.work_queue``).
"""

import argparse
import heapq

import numpy as np

from vime_pure.data.shards import prompt_shares
from vime_pure.data.work_queue import chunk_range, queue_chunk_size

STEP_S = 0.03  # seconds per decode step of a full batch
BATCH = 256  # sequences decoded together


def call_seconds(lengths: np.ndarray, speed: float, model: str) -> float:
    """One batched ``generate`` call over responses ``lengths`` on an engine of ``speed``."""
    if not len(lengths):
        return 0.0
    if model == "tail":
        steps = float(lengths.sum()) / BATCH + float(lengths.max())
    else:
        steps = len(lengths) * float(lengths.max()) / BATCH
    return steps * STEP_S / speed


def blocks_makespan(lengths: np.ndarray, speeds: np.ndarray, model: str) -> float:
    shares = prompt_shares(len(lengths), len(speeds))
    return max(call_seconds(lengths[s.start:s.stop].ravel(), v, model)
               for s, v in zip(shares, speeds))


def queue_makespan(lengths: np.ndarray, speeds: np.ndarray, model: str, per_engine: int
                   ) -> tuple[float, np.ndarray]:
    """The makespan and the prompts each engine generated."""
    p, e = len(lengths), len(speeds)
    chunk = queue_chunk_size(p, e, per_engine=per_engine)
    free = [(0.0, k) for k in range(e)]  # (time the engine is free, engine)
    done = np.zeros(e, dtype=np.int64)
    claim, end = 0, 0.0
    while free:
        t, k = heapq.heappop(free)
        share = chunk_range(claim, chunk, p)
        claim += 1
        if not share:
            end = max(end, t)
            continue
        done[k] += len(share)
        heapq.heappush(free, (t + call_seconds(lengths[share.start:share.stop].ravel(),
                                               speeds[k], model), k))
    return end, done


def scenario(name: str, rng: np.random.Generator, engines: int, prompts: int, n: int
             ) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.minimum(rng.lognormal(np.log(1000), 0.8, size=(prompts, n)), 16384)
    speeds = np.ones(engines)
    if name == "straggler":
        speeds[0] = 0.5
    if name == "skewed":
        lengths *= np.linspace(1.0, 3.0, prompts)[:, None]
    return lengths.astype(np.int64), speeds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.work_queue")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=21)
    args = parser.parse_args(argv)
    out: dict = {}
    for model in ("tail", "tokens"):
        for name in ("equal", "straggler", "skewed"):
            blocks, queue = [], {k: [] for k in (1, 2, 4)}
            slow = []
            for seed in range(args.seeds):
                lengths, speeds = scenario(name, np.random.default_rng(seed), args.engines,
                                           args.prompts, args.n)
                blocks.append(blocks_makespan(lengths, speeds, model))
                for k in queue:
                    q, done = queue_makespan(lengths, speeds, model, k)
                    queue[k].append(q)
                    if k == 4:
                        slow.append(done[0] / (args.prompts / args.engines))
            b = float(np.median(blocks))
            ratios = {k: float(np.median(v)) / b for k, v in queue.items()}
            out[f"{model}/{name}"] = {"blocks_s": b, "ratio": ratios,
                                      "engine0_share_of_even_k4": float(np.median(slow))}
            print(f"{model:6s} {name:9s} E={args.engines} P={args.prompts} n={args.n}: blocks "
                  f"{b:6.1f} s; queue/blocks " + ", ".join(f"k={k} {r:.2f}"
                                                           for k, r in ratios.items())
                  + f" (median of {args.seeds} seeds; at k=4 engine 0 generated "
                  f"{np.median(slow):.2f}x an even share) [model]")
    return out


if __name__ == "__main__":
    main()
