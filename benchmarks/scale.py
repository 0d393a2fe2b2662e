"""What the rollout side costs at 8, 64 and 512 data-parallel ranks (``docs/scaling.md``).

Usage::

    python -m benchmarks.scale                 # 1M samples, dp 8 / 64 / 512 (a few minutes)
    python -m benchmarks.scale --quick         # CI smoke size, seconds
    python -m benchmarks.scale --samples 262144 --dps 64 --token-scale 4

Per data-parallel size, on one rollout batch of ``--samples`` samples (the ``grpo16`` synthetic
workload of ``vime_pure.scheduling.workloads``: 16 single-sample groups per prompt, ~3.8k
tokens per sample, long-tailed), it measures:

- **schedule**: ``build_schedule`` (what rank 0 runs once per rollout), median wall and CPU
  seconds of ``--repeats`` runs; 16 optimizer steps per batch, 32k tokens per micro-batch;
- **rank_batch**: the records of one DP rank (what every rank builds from the broadcast batch),
  median wall and CPU seconds, and the bytes of that rank's records;
- **gather**: the bytes of the batch's columns (``RolloutBatch`` nbytes: what a columnar gather
  moves) and of the pickled ``Sample`` objects the engine group gathers today, per token
  measured on a sample of the same workload and scaled up;
- **sync**: bytes of one weight sync (bf16 parameters) for named models, its layer-aligned
  buckets at slime's 512 MiB ``--update-weight-buffer-size`` and the largest one (the transient
  memory a sync needs on every engine rank).

The batch for ``rank_batch`` is built from columns directly (no ``Sample`` objects) with zero
token ids, masks and log-probs: their values do not change the work, and untouched zero pages
keep a 4-billion-token batch within a laptop's memory. ``--token-scale k`` divides every length
by ``k`` (and the micro-batch cap with it) when even that does not fit; the JSON records it.
Timings on the shared 2-core machine are noisy: read the CPU times.
"""

import argparse
import json
import os
import pickle
import platform
import time
from pathlib import Path

import attrs
import numpy as np

from benchmarks.batch_convert import median_s
from benchmarks.scale_batch import (PROMPT_TOKENS, columnar_batch, columns_bytes,
                                    response_lengths)
from benchmarks.scale_shares import (funnel_rates, gloo_check, holders_of, maxrss_bytes,
                                     share_row)
from vime_pure import (BatchingPolicy, ParallelLayout, Sample, build_schedule, rank_batch,
                       schedule_for)
from vime_pure.scheduling.workloads import synthetic_workload
from vime_shell.engines.layout import DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE
from vime_shell.engines.sync import buckets

STEPS_PER_BATCH = 16
MAX_TOKENS_PER_GPU = 32768
# Dense decoders from their HF configs: hidden, layers, q heads, kv heads, head_dim,
# intermediate, vocab, tied embeddings, q/k/v bias, q/k norms.
MODELS = {
    "Qwen2.5-0.5B": (896, 24, 14, 2, 64, 4864, 151936, True, True, False),
    "Qwen3-8B": (4096, 36, 32, 8, 128, 12288, 151936, False, False, True),
    "Qwen2.5-32B": (5120, 64, 40, 8, 128, 27648, 152064, False, True, False),
    "Llama-3.1-70B": (8192, 80, 64, 8, 128, 28672, 128256, False, False, False),
}
# (total parameters, layers, vocab x hidden of each of embed / lm_head): the MoE layers are
# taken as equal shares of the rest (DeepSeek-V3: 61 layers, 58 of them MoE, ~11B params each).
PUBLISHED = {"DeepSeek-V3 (MoE, 671B total)": (671e9, 61, 129280 * 7168)}


class _Sized:
    """Stands in for a tensor of ``nbytes`` bytes in the bucketer."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def dense_groups(h, layers, nq, nkv, d, inter, vocab, tied, qkv_bias, qk_norm):
    """``(hf name, params)`` in export order, one entry per layer (what a bucket never splits)."""
    attn = h * nq * d + 2 * h * nkv * d + nq * d * h
    attn += (nq + 2 * nkv) * d if qkv_bias else 0
    attn += 2 * d if qk_norm else 0
    layer = attn + 3 * h * inter + 2 * h
    out = [("model.embed_tokens.weight", vocab * h)]
    out += [(f"model.layers.{i}.all", layer) for i in range(layers)]
    out += [("model.norm.weight", h)] + ([] if tied else [("lm_head.weight", vocab * h)])
    return out


def dense_params(*config) -> int:
    """Parameter count of a Llama/Qwen-style decoder. ``Qwen3-8B`` -> 8.19e9."""
    return sum(n for _, n in dense_groups(*config))


def sync_table() -> list[dict]:
    """Bytes of one bf16 weight sync and its layer-aligned buckets (``engines.sync.buckets``)."""
    models = [(name, dense_groups(*cfg)) for name, cfg in MODELS.items()]
    for name, (total, layers, embed) in PUBLISHED.items():
        per_layer = int((total - 2 * embed) / layers)
        models.append((name, [("model.embed_tokens.weight", embed)]
                       + [(f"model.layers.{i}.all", per_layer) for i in range(layers)]
                       + [("lm_head.weight", embed)]))
    rows = []
    for name, groups in models:
        params = sum(n for _, n in groups)
        sized = [(g, _Sized(2 * n)) for g, n in groups]
        out = list(buckets(sized, DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE))
        rows.append({"model": name, "params": int(params), "bf16_bytes": int(2 * params),
                     "buckets": len(out), "largest_bucket_bytes": max(
                         sum(t.nbytes for _, t in b) for b in out)})
    return rows


def pickled_bytes_per_token(lengths: np.ndarray, count: int = 512, seed: int = 0) -> float:
    """Pickle size of ``Sample`` objects as the engines build them (Python lists of token ids
    and float log-probs) per token, on ``count`` samples of the workload."""
    rng = np.random.default_rng(seed)
    samples, tokens = [], 0
    for n in lengths[:count]:
        resp = int(max(1, n - PROMPT_TOKENS))
        samples.append(Sample(tokens=rng.integers(0, 150_000, int(n)).tolist(),
                              response_length=resp, loss_mask=[1] * resp,
                              rollout_log_probs=(-rng.random(resp)).tolist(), reward=1.0))
        tokens += int(n)
    return len(pickle.dumps(samples, protocol=pickle.HIGHEST_PROTOCOL)) / tokens


def records_nbytes(records) -> int:
    return sum(v.nbytes for step in records.steps for mb in step.microbatches
               for v in attrs.asdict(mb, recurse=False).values() if isinstance(v, np.ndarray))


def run(samples: int, dps: list[int], token_scale: int, repeats: int,
        shares: bool = True) -> dict:
    work = synthetic_workload(num_groups=samples, fanout="grpo16", seed=0)
    lengths = np.maximum(work.lengths // token_scale, 2)
    cap = MAX_TOKENS_PER_GPU // token_scale
    groups = len(np.unique(work.group_ids))
    policy = BatchingPolicy(global_batch_size=max(1, groups // STEPS_PER_BATCH),
                            max_tokens_per_gpu=cap, allow_partial_step=True)
    t0 = time.perf_counter()
    batch = columnar_batch(lengths, work.group_ids, work.prompt_ids)
    build_s = time.perf_counter() - t0
    columns = {k: int(v.nbytes) for k, v in batch.columns().items() if v is not None}
    per_token = pickled_bytes_per_token(work.lengths)
    rows = []
    for dp in dps:
        layout = ParallelLayout(dp=dp)
        wall, cpu = median_s(lambda: build_schedule(lengths, work.group_ids, layout, policy),
                             repeats)
        schedule = schedule_for(batch, layout, policy)
        r_wall, r_cpu = median_s(lambda: rank_batch(batch, schedule, dp_rank=0), repeats)
        mine = rank_batch(batch, schedule, dp_rank=0)
        row_shares = None
        if shares:
            holders = holders_of(lengths, work.group_ids, work.prompt_ids, dp, columnar_batch)
            row_shares = share_row(holders, layout, policy, work.lengths, response_lengths)
            del holders
            worst = row_shares["ranks"][-1]
            print(f"dp={dp:4d} sharded (simulated in one process, {dp} holders, "
                  f"{row_shares['chunks']} chunks): rank 0 "
                  f"gather {row_shares['rank0_gather_cpu_s']:.2f} s + schedule "
                  f"{row_shares['rank0_schedule_cpu_s']:.2f} s CPU, receives "
                  f"{row_shares['rank0_gather_bytes_received'] / 1e6:.1f} MB, peak "
                  f"{row_shares['rank0_gather_schedule_peak_bytes'] / 1e9:.2f} GB; every rank "
                  f"receives the plan {row_shares['plan_bytes_every_rank'] / 1e6:.1f} MB; "
                  f"DP rank {worst['dp_rank']}: share {worst['share_bytes_received_unscaled'] / 1e6:.1f} MB "
                  f"received (unscaled), {worst['received_over_share_unscaled']:.2f}x its share, "
                  f"all-to-all {worst['all_to_all_cpu_s']:.3f} s, rank_batch "
                  f"{worst['rank_batch_cpu_s']:.3f} s CPU", flush=True)
        rows.append({"dp": dp, "shares": row_shares,
                     "schedule_wall_s": wall, "schedule_cpu_s": cpu,
                     "steps": len(schedule.steps),
                     "microbatches_per_rank_step0": schedule.steps[0].num_microbatches,
                     "rank_batch_wall_s": r_wall, "rank_batch_cpu_s": r_cpu,
                     "rank_records_bytes": records_nbytes(mine)})
        print(f"dp={dp:4d}: schedule {wall:6.2f} s (CPU {cpu:5.2f}), rank_batch {r_wall:6.2f} s "
              f"(CPU {r_cpu:5.2f}), {len(schedule.steps)} steps, "
              f"{schedule.steps[0].num_microbatches} micro-batches per rank in step 0, "
              f"rank records {records_nbytes(mine) / 1e9:.2f} GB", flush=True)
    real_tokens = int(work.lengths.sum())
    rates = funnel_rates(work.lengths)
    funnel = {"rates_s_per_token": rates,
              "rank0_cpu_s_unscaled": real_tokens * (rates["unpickle_samples"] + rates["convert"]
                                                     + rates["pickle_batch"]),
              "every_rank_unpickle_cpu_s_unscaled": real_tokens * rates["unpickle_batch"],
              "rank0_bytes_received_unscaled": int(rates["pickled_samples_bytes"] * real_tokens),
              "every_rank_bytes_received_unscaled": columns_bytes(work.lengths)}
    print(f"funnel (before, per-token costs measured on 512 samples): rank 0 "
          f"{funnel['rank0_cpu_s_unscaled']:.1f} s CPU, receives "
          f"{funnel['rank0_bytes_received_unscaled'] / 1e9:.2f} GB; every rank receives "
          f"{funnel['every_rank_bytes_received_unscaled'] / 1e9:.2f} GB and unpickles it in "
          f"{funnel['every_rank_unpickle_cpu_s_unscaled']:.1f} s", flush=True)
    return {"funnel": funnel, "maxrss_bytes": maxrss_bytes(),
        "samples": int(len(lengths)), "groups": groups, "token_scale": token_scale,
        "tokens": int(lengths.sum()), "tokens_unscaled": real_tokens,
        "mean_tokens_per_sample": float(work.lengths.mean()), "batch_build_s": build_s,
        "columns_bytes": columns, "columns_bytes_total": sum(columns.values()),
        "columns_bytes_unscaled": columns_bytes(work.lengths),
        "pickled_samples_bytes_per_token": per_token,
        "pickled_samples_bytes_unscaled": int(per_token * real_tokens),
        "rows": rows, "sync": sync_table(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg": os.getloadavg()},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale")
    parser.add_argument("--samples", type=int, default=1 << 20)
    parser.add_argument("--dps", default="8,64,512")
    parser.add_argument("--token-scale", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8k samples, dp 8 and 64, 1 run")
    parser.add_argument("--gloo", action="store_true",
                        help="also run the exchange for real: 4 gloo ranks on CPU, 16k samples")
    parser.add_argument("--no-shares", action="store_true",
                        help="skip the sharded path (the funnel's rank_batch only)")
    parser.add_argument("--out", default="benchmarks/results/scale.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.dps, args.repeats = 8192, "8,64", 1
    result = run(args.samples, [int(d) for d in args.dps.split(",")], args.token_scale,
                 args.repeats, shares=not args.no_shares)
    if args.gloo:
        result["gloo_world4"] = gloo_check()
        for r in result["gloo_world4"]:
            print(f"gloo world 4 (real), rank {r['rank']}: share received {r['share_received']} B "
                  f"(predicted {r['predicted_share_bytes']} B), plan {r['plan_bytes']} B, "
                  f"metadata sent {r['meta_sent']} B, received {r['meta_received']} B",
                  flush=True)
    for row in result["sync"]:
        print(f"sync {row['model']:30s} {row['params'] / 1e9:7.2f} B params, "
              f"{row['bf16_bytes'] / 1e9:8.1f} GB bf16, {row['buckets']} buckets, largest "
              f"{row['largest_bucket_bytes'] / 1e9:.2f} GB")
    print(f"gather: columns {result['columns_bytes_unscaled'] / 1e9:.2f} GB, pickled samples "
          f"{result['pickled_samples_bytes_unscaled'] / 1e9:.2f} GB "
          f"({result['pickled_samples_bytes_per_token']:.2f} B/token)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
