"""Quality metrics of a schedule given as nested lists: ``steps[k][rank]`` = micro-batches.

Works on both ``Schedule.steps`` (tuples) and the naive reference's output (lists), so both are
judged by the same code. Per step:

- micro-batch lower bound ``oversize + ceil(tokens of the other samples / cap)`` (a sample over
  the cap needs a micro-batch of its own, so plain ``ceil(step tokens / cap)`` would overstate
  the bound when such samples exist) and its aligned version (rounded up to a multiple of
  ``dp * microbatch_group``);
- imbalance ``max rank load / mean rank load`` in tokens and FLOPs, and its lower bound
  ``max(max item, total / dp) / (total / dp)``;
- cap violations: multi-sample micro-batches over the cap.

Example: a step with rank token loads 1000 and 600 has imbalance 1000 / 800 = 1.25.
"""

from itertools import chain

import numpy as np


def step_metrics(steps, lengths: np.ndarray, flops: np.ndarray, cap: int, dp: int,
                 multiple: int) -> dict:
    """Aggregate metrics over all steps (means, worsts, totals)."""
    rows = [_one_step(step, lengths, flops, cap, dp, multiple) for step in steps]
    col = {key: np.array([r[key] for r in rows]) for key in rows[0]}
    return {
        "steps": len(rows),
        "microbatches": int(col["microbatches"].sum()),
        "mb_lower_bound": int(col["lb"].sum()),
        "mb_aligned_bound": int(col["aligned_lb"].sum()),
        "mb_over_aligned_pct": 100.0 * (col["microbatches"].sum() / col["aligned_lb"].sum() - 1),
        "mb_per_rank": col["per_rank"].tolist(),
        "tok_imb_mean": float(col["tok_imb"].mean()), "tok_imb_worst": float(col["tok_imb"].max()),
        "tok_bound_mean": float(col["tok_lb"].mean()),
        "flops_imb_mean": float(col["flops_imb"].mean()),
        "flops_imb_worst": float(col["flops_imb"].max()),
        "flops_bound_mean": float(col["flops_lb"].mean()),
        "flops_bound_worst": float(col["flops_lb"].max()),
        "below_bound_steps": int((col["flops_imb"] < col["flops_lb"] * (1 - 1e-9)).sum()
                                 + (col["tok_imb"] < col["tok_lb"] * (1 - 1e-9)).sum()),
        "cap_violations": int(col["violations"].sum()),
    }


def _one_step(step, lengths: np.ndarray, flops: np.ndarray, cap: int, dp: int,
              multiple: int) -> dict:
    mbs = list(chain.from_iterable(step))
    sizes = np.fromiter(map(len, mbs), dtype=np.int64, count=len(mbs))
    ids = np.fromiter(chain.from_iterable(mbs), dtype=np.int64, count=int(sizes.sum()))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    mb_tokens = np.add.reduceat(lengths[ids], starts)
    mb_flops = np.add.reduceat(flops[ids], starts)
    rank_of_mb = np.repeat(np.arange(dp), [len(rank) for rank in step])
    rank_tokens = np.bincount(rank_of_mb, weights=mb_tokens, minlength=dp)
    rank_flops = np.bincount(rank_of_mb, weights=mb_flops, minlength=dp)
    step_lengths = lengths[ids]
    over = step_lengths > cap
    lb = int(over.sum()) + -(-int(step_lengths[~over].sum()) // cap)
    return {
        "microbatches": len(mbs),
        "per_rank": max(len(rank) for rank in step),
        "lb": lb,
        "aligned_lb": -(-lb // multiple) * multiple,
        "tok_imb": _imbalance(rank_tokens), "tok_lb": _bound(lengths[ids].astype(float), dp),
        "flops_imb": _imbalance(rank_flops), "flops_lb": _bound(flops[ids], dp),
        "violations": int(((sizes > 1) & (mb_tokens > cap)).sum()),
    }


def _imbalance(loads: np.ndarray) -> float:
    return float(loads.max() / loads.mean())


def _bound(items: np.ndarray, dp: int) -> float:
    mean = float(items.sum()) / dp
    return max(float(items.max()), mean) / mean
