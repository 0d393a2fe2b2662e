"""Start ``fn(rank, ...)`` in fresh processes with a torchrun-like environment (tests, tools).

Each rank's return value comes back through a file in a private temporary directory that only
this helper writes and reads (pickle is its transport between our own processes; it never
reads a file it did not just write).

Example: ``spawn(worker, 2, hf_dir)`` runs ``worker(0, hf_dir)`` and ``worker(1, hf_dir)`` with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` set, and returns both results.
"""

import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = fn(rank, *args)
    with open(Path(out_dir) / f"{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def spawn(fn: Callable, world_size: int, *args, timeout: float = 600.0) -> list:
    """Run ``fn(rank, *args)`` in ``world_size`` fresh processes with a torchrun-like env.

    ``fn`` must be importable (module level). Returns each rank's return value, rank order.
    A failing rank raises ``RuntimeError`` carrying its traceback; ranks still running after
    ``timeout`` seconds are killed and raise ``TimeoutError`` (a hang fails, never blocks).
    """
    with tempfile.TemporaryDirectory(prefix="vime-spawn-") as out_dir:
        ctx = mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:  # a hung rank fails the caller, never blocks it
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"spawn: ranks {alive} still running after {timeout:g} s "
                                   "(killed)")
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
