"""FLOPs imbalance of ``--balance straggler`` planned with the fixed 8B-shaped proxy ratio
vs the run's own model (what ``vime train`` now passes), measured in the model's true FLOPs.

A 0.5B model (Qwen2.5-0.5B's shape: hidden 896, 24 layers, vocab 151936) has a much larger
attention share per token than an 8B one, so the proxy's quadratic/linear ratio misweighs long
samples. Prints the median and worst per-step imbalance (max rank / mean rank FLOPs) over
seeds of the synthetic long-tailed workload, for both FLOPs models and their ratio.
Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.flops_model_balance``
(``--quick``: fewer seeds).
"""

import argparse
import statistics

from vime_pure.config import ParallelLayout, policy_from_flags
from vime_pure.scheduling.flops import FlopsModel
from vime_pure.scheduling.planner import build_schedule
from vime_pure.scheduling.report import step_stats
from vime_pure.scheduling.workloads import synthetic_workload

QWEN_0_5B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936}


def imbalances(seed: int, model: FlopsModel, *, dp: int, own: bool) -> list[float]:
    w = synthetic_workload(num_groups=256, fanout="grpo8", seed=seed)
    true = model.per_sample(w.lengths)
    policy = policy_from_flags(global_batch_size=64, max_tokens_per_gpu=16384,
                               balance="straggler")
    schedule = build_schedule(w.lengths, w.group_ids.tolist(), ParallelLayout(dp=dp), policy,
                              true if own else None)
    return [s.flops_imbalance for s in step_stats(schedule, true)]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dp", type=int, default=8)
    args = parser.parse_args(argv)
    model = FlopsModel.from_hf_config(QWEN_0_5B)
    seeds = range(2 if args.quick else 10)
    out = {}
    for name, own in (("fixed 8B proxy ratio", False), ("the run's model", True)):
        values = [v for seed in seeds for v in imbalances(seed, model, dp=args.dp, own=own)]
        out[name] = statistics.median(values)
        print(f"  {name:22s} median FLOPs imbalance {100 * (out[name] - 1):.2f}%, worst "
              f"{100 * (max(values) - 1):.2f}% ({len(values)} steps, dp {args.dp})")
    own = out["the run's model"]
    ratio = (out["fixed 8B proxy ratio"] - 1) / max(own - 1, 1e-12)
    print(f"  excess imbalance, proxy / own model: {ratio:.1f}x")
    return out


if __name__ == "__main__":
    main()
