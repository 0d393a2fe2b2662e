"""Quality metrics of a schedule given as nested lists: ``steps[k][rank]`` = micro-batches.

Works on both ``Schedule.steps`` (tuples) and the naive reference's output (lists), so both are
judged by the same code: each step is measured by ``vime_pure.scheduling.report.measure_step``
(what ``vime schedule`` reports too: the oversize-aware micro-batch lower bound and its aligned
version, token and FLOPs imbalance against ``max(max item, total / dp) / (total / dp)``, cap
violations); this module only aggregates over steps.

Example: a step with rank token loads 1000 and 600 has imbalance 1000 / 800 = 1.25.
"""

import numpy as np

from vime_pure.scheduling.report import measure_step


def step_metrics(steps, lengths: np.ndarray, flops: np.ndarray, cap: int, dp: int,
                 multiple: int) -> dict:
    """Aggregate metrics over all steps (means, worsts, totals)."""
    stats = [measure_step(step, lengths, flops, cap, dp, multiple, index=k)
             for k, step in enumerate(steps)]

    def col(name: str) -> np.ndarray:
        return np.array([getattr(s, name) for s in stats])

    used, aligned = col("num_microbatches"), col("microbatch_bound_aligned")
    tok, tok_lb = col("token_imbalance"), col("token_imbalance_bound")
    fl, fl_lb = col("flops_imbalance"), col("flops_imbalance_bound")
    return {
        "steps": len(stats),
        "microbatches": int(used.sum()),
        "mb_lower_bound": int(col("microbatch_bound").sum()),
        "mb_aligned_bound": int(aligned.sum()),
        "mb_over_aligned_pct": 100.0 * (used.sum() / aligned.sum() - 1),
        "mb_per_rank": col("microbatches_per_rank").tolist(),
        "tok_imb_mean": float(tok.mean()), "tok_imb_worst": float(tok.max()),
        "tok_bound_mean": float(tok_lb.mean()),
        "flops_imb_mean": float(fl.mean()), "flops_imb_worst": float(fl.max()),
        "flops_bound_mean": float(fl_lb.mean()), "flops_bound_worst": float(fl_lb.max()),
        "below_bound_steps": int((fl < fl_lb * (1 - 1e-9)).sum()
                                 + (tok < tok_lb * (1 - 1e-9)).sum()),
        "cap_violations": int(col("over_cap_multi").sum()),
    }
