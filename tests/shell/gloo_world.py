"""A spawned gloo world for the collectives' tests: ``spawn_world`` starts ``world`` processes
of ``worker(rank, world, init_file, out_dir)`` and returns each rank's JSON result, failing the
test past a deadline (a deadlock); ``worker_body`` is the worker's frame: the process group,
the result written even when the body raised, then a barrier."""

import json
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_world(worker: Callable, world: int, out: Path, what: str,
                deadline_s: float = 240) -> list[dict]:
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.start_processes(worker, args=(world, str(out / "init"), str(out)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"{what} workers did not finish within {deadline_s:g} s (deadlock?)")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def worker_body(rank: int, world: int, init_file: str, out_dir: str,
                body: Callable[[int, dict], None]) -> None:
    """Run ``body(rank, result)`` in a gloo world; what it put in ``result`` (with the
    traceback under ``"error"`` when it raised) goes to ``out_dir/rank<r>.json``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    result: dict = {}
    try:
        body(rank, result)
    except Exception:  # noqa: BLE001 - reported to the parent test, then re-raised
        result["error"] = traceback.format_exc()
        raise
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
