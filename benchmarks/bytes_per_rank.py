"""Bytes of each rollout batch every rank receives and sends, per mode, against the core's
bound (metadata plus the rank's own share; issue 32's "one batch shape: parts everywhere").

Modes (``MODES``), each a short run of the embedded model (``JOB``: ``TINY`` of
``tests.shell.loop_workers`` with 16 prompts of ~30 tokens x 4 samples, responses up to 24
tokens, 2 optimizer steps per rollout) on gloo, 2 trainer ranks (DP 2) in all:

- ``colocated``: world 2, an engine on each rank; each leader keeps its part (the sharded
  exchange);
- ``colocated_dumps``: the same with ``--save-rollout-data``: each leader writes its part
  beside rank 0's index (metadata), so the dumps move no sample;
- ``colocated_log``: the same with slime's rollout-log hook
  (``--custom-rollout-log-function-path``), whose contract hands it the samples: rank 0 holds
  the whole batch (the leaders gather their outputs there; engine 1 generates all but one
  chunk, ``straggling_rank0_rollout``, so the funnel's width does not depend on the load);
- ``colocated_filter``: a dynamic-sampling filter over 24 prompts per round: each leader
  judges the groups it holds, the leaders exchange verdicts (counted as batch bytes) and cut
  the batch's 16 groups where they are;
- ``sync`` / ``one_step_off`` / ``fully_async``: world 4, ranks 0-1 train, ranks 2-3 run one
  engine each (``--no-colocate --rollout-num-gpus 2``; ``--train-async``; ``--fully-async
  --max-weight-staleness 1``): the engine leaders (the pools) keep their parts and send
  rank 0 metadata and each trainer rank its share over the span.

Per trainer rank and rollout (``rank_bytes``): **received** = the exchange's metadata (rank
0), plan (other ranks) and share bytes (``ExchangeStats``; a rank's share counts its own
piece too) + the rollout's batch bytes from the bridge or the leaders' gather
(``RolloutEvent.transfers``, kind ``batch``); **sent** alike. Weights, probes and commands are
counted apart (``transfers``, other kinds) and are not the batch. The **bound** is
``vime_pure.data.share_bytes.rank_bound`` of the rollout (its plan and the gathered batch's
metadata); ``batch`` is every share together (``batch_bytes``). One step off receives batch
``k + 1`` while rollout ``k`` trains, so the table gives means over rollouts (equal sums), not
medians.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src:. python -m benchmarks.bytes_per_rank [--rollouts 3]``
(about 30 s on 2 cores); JSON: ``benchmarks/results/bytes_per_rank.json``.
"""

import argparse
import json
import os
import statistics
import tempfile
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from tests.shell.loop_workers import TINY
from vime_pure.data.share_bytes import batch_bytes, metadata_bytes, rank_bound, share_bytes
from vime_shell.engines.work_queue import job_store
from vime_shell.megatron.spawn import spawn
from vime_shell.rollout.functions import single_turn_rollout
from vime_shell.rollout.tasks import arithmetic_rows, write_jsonl
from vime_shell.models.embedded import build_embedded

# ``TINY`` with 16 prompts of ~30 tokens (``long_prompts``) and responses up to 24 tokens (the
# embedded model's context is 64): 64 samples whose tokens outweigh their metadata, so a rank
# receiving more than its share shows (reverse2's 2-token prompts and answers would leave every
# batch below the metadata's fixed costs).
JOB = {**TINY, "rollout_batch_size": 16, "global_batch_size": 32, "rollout_max_response_len": 24,
       "rollout_max_context_len": 64, "max_tokens_per_gpu": 128}
SEPARATE: dict[str, object] = dict(colocate=False, rollout_num_gpus=2)
# name -> (world size, settings); every mode trains on 2 ranks (DP 2)
MODES: dict[str, tuple[int, dict[str, object]]] = {
    "colocated": (2, {}),
    "colocated_dumps": (2, {"save_rollout_data": "{root}/dumps/r{{rollout_id}}.npz"}),
    "colocated_log": (2, {"custom_rollout_log_function_path":
                          "benchmarks.bytes_per_rank:quiet_rollout_log",
                          "rollout_function_path":
                          "benchmarks.bytes_per_rank:straggling_rank0_rollout"}),
    "colocated_filter": (2, {"dynamic_sampling_filter_path": "benchmarks.bytes_per_rank:keep_all",
                             "over_sampling_batch_size": 24}),
    "sync": (4, SEPARATE),
    "one_step_off": (4, {**SEPARATE, "train_async": True}),
    "fully_async": (4, {**SEPARATE, "fully_async": True, "max_weight_staleness": 1}),
}
STRAGGLER_WAIT_S = 300
PROMPT_REPEATS = 10  # "3+5 3+5 ...": ~30 tokens of the embedded tokenizer
RESULT = Path(__file__).with_name("results") / "bytes_per_rank.json"


def quiet_rollout_log(rollout_id, args, samples, extra_metrics, rollout_time) -> bool:
    """slime's rollout-log hook, logging nothing: it receives every sample (``colocated_log``)."""
    return False


def keep_all(samples) -> bool:
    """A dynamic-sampling filter that keeps every group: with ``--over-sampling-batch-size 24``
    each rollout judges 24 groups on their holders and cuts 8 there (``colocated_filter``)."""
    return True


def straggling_rank0_rollout(ctx):
    """The built-in single-turn rollout; engine 0 (rank 0) starts a chunk only once engine 1
    has generated every other prompt of the rollout (counted in the job's store: a bounded
    wait, never a sleep), so engine 1 generates all but one chunk, at any load, and rank 0
    receives them in the leaders' gather: the whole-batch funnel at its widest, the same in
    every run."""
    rank, done = dist.get_rank(), f"bytes/straggler/{ctx.rollout_id}"
    if rank == 0:
        others = JOB["rollout_batch_size"] - len(ctx.prompts)
        job_store().wait([f"{done}/{others}"], timedelta(seconds=STRAGGLER_WAIT_S))
    out = single_turn_rollout(ctx)
    if rank == 1:
        generated = job_store().add(done, len(ctx.prompts))
        job_store().set(f"{done}/{generated}", "1")
    return out


def long_prompts(path: str) -> str:
    """The arithmetic rows with each prompt repeated ``PROMPT_REPEATS`` times (same labels)."""
    rows = [{**r, "prompt": " ".join([r["prompt"]] * PROMPT_REPEATS)}
            for r in arithmetic_rows()[0]]
    return str(write_jsonl(path, rows))


def bytes_worker(rank: int, root: str, cache: str, names: tuple[str, ...],
                 rollouts: int) -> dict:
    """Each named mode in turn on this job; per trainer rank and rollout what its exchange
    and its transfers moved and the core's bound; engine ranks return {}."""
    os.environ["VIME_CACHE_DIR"] = cache  # before the loop's modules read it
    from vime_shell.run.driver import run_training
    from vime_shell.settings.train_config import TrainConfig

    out: dict = {}
    for name in names:
        seen: list = []

        def observe(e, seen=seen) -> None:
            meta = e.meta  # the planned metadata: no part is gathered for this hook
            dp = e.trainer.dp_rank
            seen.append({"rollout": e.rollout_id, "dp_rank": dp,
                         "exchange": e.exchange.as_dict(),
                         "transfers": None if e.transfers is None else e.transfers.as_dict(),
                         "bound": rank_bound(meta, e.plan, dp),
                         "metadata": metadata_bytes(meta, e.plan),
                         "share": share_bytes(meta, e.plan, dp),
                         "batch": batch_bytes(meta, e.plan)})

        settings = {k: v.format(root=root) if isinstance(v, str) else v
                    for k, v in MODES[name][1].items()}
        data = long_prompts(f"{root}/{name}-rank{rank}/prompts.jsonl")
        cfg = TrainConfig(**{**JOB, "num_rollout": rollouts, "run_dir": f"{root}/{name}",
                             "prompt_data": data, **settings})
        run_training(cfg, progress=False, on_rollout=observe, gather_batches=False)
        out[name] = seen
    return out


def rank_bytes(record: dict, rank: int) -> dict[str, int]:
    """One trainer rank's batch bytes of one rollout: received, sent, and the bound."""
    ex, moved = record["exchange"], record["transfers"]
    plan_in = ex["plan_bytes"] if rank else 0
    received = ex["meta_received"] + plan_in + ex["share_received"]
    sent = ex["meta_sent"] + ex["share_sent"]
    if moved is not None:
        received += moved["received"]["batch"]
        sent += moved["sent"]["batch"]
    return {"received": received, "sent": sent, "bound": record["bound"],
            "batch": record["batch"], "metadata": record["metadata"]}


def measure(names: tuple[str, ...], root: str, cache: str, rollouts: int = 3,
            timeout: float = 600) -> dict[str, list[list[dict]]]:
    """Mode -> trainer rank -> what ``bytes_worker`` recorded per rollout; one job per
    world size."""
    by_world: dict[int, list[str]] = {}
    for name in names:
        by_world.setdefault(MODES[name][0], []).append(name)
    table: dict[str, list[list[dict]]] = {}
    for world, group in by_world.items():
        ranks = spawn(bytes_worker, world, root, cache, tuple(group), rollouts, timeout=timeout)
        for name in group:
            table[name] = [out[name] for out in ranks if out.get(name)]
    return {name: table[name] for name in names}


def summary(table: dict) -> list[dict]:
    """Rows of mode x trainer rank: mean bytes per rollout received and sent, the bound,
    the batch, and received / bound."""
    rows = []
    for name, ranks in table.items():
        for rank, raw in enumerate(ranks):
            records = [rank_bytes(r, rank) for r in raw]
            mean = {k: statistics.fmean(r[k] for r in records) for k in records[0]}
            rows.append({"mode": name, "rank": rank, **{k: round(v) for k, v in mean.items()},
                         "received_over_bound": round(mean["received"] / mean["bound"], 2)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| mode | trainer rank | received B/rollout | sent B/rollout | bound B | "
             "batch B | received / bound |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['rank']} | {r['received']:,} | {r['sent']:,} | "
                     f"{r['bound']:,} | {r['batch']:,} | {r['received_over_bound']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vime-bytes-") as tmp:
        build_embedded(f"{tmp}/cache")
        table = measure(tuple(args.modes.split(",")), tmp, f"{tmp}/cache", args.rollouts)
    rows = summary(table)
    print(markdown(rows))
    Path(args.out).write_text(json.dumps({"rollouts": args.rollouts, "rows": rows,
                                          "per_rollout": table}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
