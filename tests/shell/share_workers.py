"""Process bodies for the sharded-batch tests (``test_shares_gloo.py``): one short training,
its ``metrics.jsonl`` values, and what the rank's share exchange moved.

``FIXTURE`` holds the values main's funnel (leaders -> rank 0 -> broadcast) produced for the
same runs, recorded with ``python -m tests.shell.share_workers --record`` on main's sources
(``PYTHONPATH=<main>/src:.``, main at fcbbec7, before the sharded path merged, on another
machine): the sharded path must reproduce them as ``tests.metric_keys`` says (data keys
exactly, the trainer's floats to rounding, engine log-prob keys to their noise), with prompts
handed out by the engines' work queue (in ``dp2`` engine 1 is a straggler,
``recorded_rollout``; the fixture's blocks were contiguous, so its engines batched other
prompts together). Re-record it only from a funnel build (a change that moves the numbers,
e.g. a new scheduler, must move them on both paths).
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

from tests.metric_keys import without_timing

FIXTURE = Path(__file__).with_name("share_fixture.json")
# Engine 1 of the dp2 run generates a chunk only once engine 0 has generated every other
# prompt of the rollout: the work queue must hand engine 0 the rest and still give the
# contiguous blocks' batch (the fixture). A wait on the job's store, bounded, never a sleep.
STRAGGLER_WAIT_S = 300
QUEUED = {"rollout_function_path": "tests.shell.share_workers:recorded_rollout"}
RUNS = {  # name -> (world size, layout flags): DP at world 2, DP x PP at world 4
    "dp2": (2, QUEUED),
    "dp2_pp2": (4, {**QUEUED, "pipeline_model_parallel_size": 2}),
}
CLAIMS: list = []  # (rank, rollout, first prompt, prompts) of each chunk generated here
CONFIG = dict(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=8,
              max_tokens_per_gpu=24, lr=1e-3, seed=3, num_rollout=2,
              custom_rm_path="tests.shell.loop_workers:first_char_reward")


def recorded_rollout(ctx):
    """The built-in single-turn rollout, recording each chunk; at world 2 rank 1 (engine 1)
    is a straggler at any load: it starts a chunk only after rank 0 has generated all the
    rollout's other prompts (rank 0 counts them in the job's store), so it claims at most
    one chunk and rank 0 the rest."""
    import torch.distributed as dist

    from vime_shell.engines.work_queue import job_store
    from vime_shell.rollout.functions import single_turn_rollout

    rank, straggles = dist.get_rank(), dist.get_world_size() == 2
    CLAIMS.append((rank, ctx.rollout_id, ctx.prompt_offset, len(ctx.prompts)))
    done = f"tests/straggler/{ctx.rollout_id}"
    if straggles and rank == 1:
        others = CONFIG["rollout_batch_size"] - len(ctx.prompts)
        job_store().wait([f"{done}/{others}"], timedelta(seconds=STRAGGLER_WAIT_S))
    out = single_turn_rollout(ctx)
    if straggles and rank == 0:
        generated = job_store().add(done, len(ctx.prompts))
        job_store().set(f"{done}/{generated}", "1")
    return out


def metric_values(path: Path) -> list[dict]:
    """``metrics.jsonl`` without the wall-clock fields (``tests.metric_keys.TIMING_KEYS``)."""
    return [without_timing(json.loads(x)) for x in path.read_text().splitlines()]


def train_worker(rank: int, run_dir: str, cache: str, layout: dict) -> dict:
    """One run; rank 0 returns the metrics, every rank the bytes its exchange moved."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.run.driver import run_training
    from vime_shell.settings.train_config import TrainConfig

    moved: list = []

    def observe(event) -> None:
        stats = getattr(event, "exchange", None)
        if stats is not None:
            moved.append({"stats": stats.as_dict(), "share_bytes": event.share.nbytes,
                          "share_samples": event.share.num_samples})

    run_training(TrainConfig(run_dir=run_dir, **CONFIG, **layout), on_rollout=observe,
                 progress=False)
    metrics = metric_values(Path(run_dir) / "metrics.jsonl") if rank == 0 else None
    return {"metrics": metrics, "moved": moved, "claims": CLAIMS}


def run(name: str, root: str, cache: str) -> list[dict]:
    from vime_shell.megatron.spawn import spawn

    world, layout = RUNS[name]
    return spawn(train_worker, world, f"{root}/{name}", cache, layout)


if __name__ == "__main__" and sys.argv[1:2] == ["--record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = {name: run(name, tmp, f"{tmp}/cache")[0]["metrics"] for name in RUNS}
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
