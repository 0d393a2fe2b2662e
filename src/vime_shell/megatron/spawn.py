"""Start ``fn(rank, ...)`` in fresh processes with a torchrun-like environment (tests, tools).

The processes fork from a forkserver that imported torch, Megatron-core, transformers and the
trainer once (``PRELOAD``): importing them in every process was most of the multi-process
tests' time (a fresh clone's ``make test`` went from 865 s to 689 s of tests with this change
alone, docs/testing.md). The forkserver is this process's, started at the first call;
each child gets this process's environment as it is at the call (a forkserver child would
otherwise see the environment of the forkserver's start) and imports nothing else before
``fn``'s module. The forkserver only imports modules (no thread, no CUDA), so forking it is
safe. A child runs the ``atexit`` handlers when ``fn`` ends, as an interpreter's exit does;
C++ static destructors run only in a ``fresh`` child (vLLM's tests).

Each rank's return value comes back through a file in a private temporary directory that only
this helper writes and reads (pickle is its transport between our own processes; it never
reads a file it did not just write).

Example: ``spawn(worker, 2, hf_dir)`` runs ``worker(0, hf_dir)`` and ``worker(1, hf_dir)`` with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` set, and returns both results.
"""

import atexit
import os
import pickle
import random
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port ``bind(0)`` hands out is
    from that range, which every outgoing connection (another job's store client, say) may
    take before the rank-0 store binds it (seen: EADDRINUSE with two test jobs at once)."""
    low = _ephemeral_low()
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(max(1024, low - 16000), low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that whole span busy: any free port
        s.bind(("", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default is 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# What every child imports anyway; the forkserver imports them once (a missing one is skipped).
PRELOAD = ["torch", "torch.distributed", "transformers", "megatron.core",
           "vime_shell.megatron.trainer", "vime_shell.run.driver"]


def _use_env(env: dict[str, str]) -> None:
    """The caller's environment at the call, not the forkserver's."""
    os.environ.clear()
    os.environ.update(env)


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple,
            env: dict[str, str]):
    _use_env(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        result = fn(rank, *args)
        with open(Path(out_dir) / f"{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        _exit_handlers()


def spawn(fn: Callable, world_size: int, *args, timeout: float = 600.0,
          fresh: bool = False) -> list:
    """Run ``fn(rank, *args)`` in ``world_size`` processes with a torchrun-like env.

    ``fn`` must be importable (module level). Returns each rank's return value, rank order.
    A failing rank raises ``RuntimeError`` carrying its traceback; ranks still running after
    ``timeout`` seconds are killed and raise ``TimeoutError`` (a hang fails, never blocks).
    ``fresh``: a new interpreter per rank (torch's ``spawn``) instead of a forkserver child:
    its exit runs C++ static destructors, which vLLM's CPU engines need to unlink their
    shared memory (a forkserver child's ``os._exit`` leaves it, and the next tensor-parallel
    engine fails with ``create shm ... errno: 17``).
    """
    with tempfile.TemporaryDirectory(prefix="vime-spawn-") as out_dir:
        ctx = start(fn, world_size, out_dir, *args, fresh=fresh)
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


def start(fn: Callable, world_size: int, out_dir: str, *args, port: int | None = None,
          fresh: bool = False) -> Any:
    """The ranks of :func:`spawn` started, not waited for (a test that kills one); each
    writes its return value to ``out_dir/<rank>.pkl``. Returns torch's process context."""
    if not fresh:
        _forkserver()
    return mp.start_processes(_worker, args=(world_size, port or free_port(), out_dir, fn,
                                             args, dict(os.environ)),
                              nprocs=world_size, join=False,
                              start_method="spawn" if fresh else "forkserver")


def process(target: Callable, *args) -> Any:
    """One process (not started) that runs ``target(*args)``, forked from the forkserver with
    this process's environment (a test that kills it)."""
    return _forkserver().Process(target=_run_with_env, args=(dict(os.environ), target, args))


def _run_with_env(env: dict[str, str], target: Callable, args: tuple) -> None:
    _use_env(env)
    try:
        target(*args)
    finally:
        _exit_handlers()


def _exit_handlers() -> None:
    """What an interpreter's normal exit runs: ``atexit`` handlers (a health monitor marks its
    rank left, ``weakref.finalize``). A forkserver child ends with ``os._exit`` instead, which
    skips them, and C++ static destructors too: hence ``fresh`` for vLLM's CPU engines."""
    atexit._run_exitfuncs()  # CPython's own exit path; idempotent: handlers are popped


def _forkserver() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the forkserver starts (the first use)
    return context
