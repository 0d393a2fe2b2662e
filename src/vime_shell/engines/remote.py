"""Trainer and engine ranks of one ``torchrun`` job, talking over a *bridge* process group.

:func:`open_sides` (every rank, once per process) builds, from torchrun's own store:

- the side's **default** process group: trainer ranks ``[0, T)`` with world size ``T``
  (Megatron's parallel state is sized from it), engine ranks ``[T, W)`` with world size
  ``W - T`` (the colocated :class:`~vime_shell.engines.group.EngineGroup` then runs on it
  unchanged);
- the **bridge**: trainer rank 0 plus every engine rank (``RankRoles.bridge_rank``), one gloo
  group for commands and results (pickled between vime's own processes, as
  ``gather_object`` does) and one group for weights (NCCL on CUDA, the gloo one on CPU);
- the **span**: every rank of the job (member = global rank: the trainer ranks first), one gloo
  group on which the engine ranks that keep their parts send each trainer rank its share
  (``vime_shell.sources.exchange``): a rollout's samples never pass through trainer rank 0.

Weights (:meth:`Bridge.send_weights` / :meth:`Bridge.receive_weights`) go from trainer rank 0
to every engine rank in the layer-aligned buckets of :func:`vime_shell.engines.sync.buckets`
(``--update-weight-buffer-size``): per bucket one command broadcast with the names, dtypes and
shapes, then one broadcast of the bucket's bytes; the engine side yields ``(name, tensor)``
pairs into its own bucketed load. A peer that died makes the next bridge call raise
:class:`BridgeError` naming the peer (gloo sees the closed socket); a peer that stopped
answering (SIGSTOP, a hang) is found by the health checks, which end every wait here
(:mod:`vime_shell.engines.health`), so no rank waits forever.

Every message is counted where its bytes are built (``Bridge.bytes``, per kind: batch replies
and parts, weights, probes, control; :mod:`vime_shell.engines.byte_counts`): the trainer's
loop takes the counts after each rollout (``RolloutEvent.transfers``).

Example (W=2, 1 trainer, 1 engine)::

    sides = open_sides(roles, backend="gloo")      # rank 0: trainer; rank 1: engine
    rank 0: sides.bridge.command(("generate", 0)); batch = sides.bridge.recv(src=1)
    rank 1: cmd = sides.bridge.command(); sides.bridge.send(("batch", ...), dst=0)
"""

import os
import pickle
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from vime_pure.errors import VimeError
from vime_shell.engines.byte_counts import LENGTH_BYTES, ByteCounts, message_kind
from vime_shell.engines.health import (PG_BACKSTOP_S, WaitBound, collective_done, current,
                                       ensure_monitor, polled_done, thread_done, wait_until)
from vime_shell.engines.roles import RankRoles
from vime_shell.engines.sync import SyncReport, stream_weights

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                               torch.int64, torch.int32, torch.uint8, torch.bool)}


class BridgeError(VimeError):
    """A trainer or engine rank on the other side of the bridge failed or went away."""


class Bridge:
    """Trainer rank 0 (bridge rank 0) and the engine ranks (1..): commands, results, weights.

    Every wait runs in slices (:func:`vime_shell.engines.health.wait_until`): the job's health
    verdict ends it, and a ``bound`` (a :class:`~vime_shell.engines.health.WaitBound`, given by
    the trainer's side for the replies it waits for) ends it with a
    :class:`~vime_shell.engines.health.HealthCheckError` naming the rank waited on."""

    def __init__(self, rank: int, size: int, control: Any, weights: Any, device: torch.device,
                 first_engine_rank: int = 1, store: Any = None):
        self.rank, self.size = rank, size
        self.control, self.weights, self.device = control, weights, device
        self.first_engine_rank = first_engine_rank  # the global rank of bridge rank 1
        self.engines = 1 if size == 2 else None  # who a failed broadcast names (peer)
        self.bytes = ByteCounts()  # what this rank sent and received, per kind (byte_counts)
        # The job's store (the fully-async pools claim draws in it) and the commands taken
        # so far: the same count on every engine rank at any command, so a run's store keys
        # can be named by it without asking another rank.
        self.store, self.commands = store, 0

    def peer(self, rank: int | None) -> str:
        """How messages name bridge rank ``rank``. Example: ``peer(2)`` with one trainer rank:
        ``"engine rank 1 (global rank 2)"``."""
        if rank is None:  # a broadcast to several engine ranks: gloo does not say which one
            return "an engine rank"
        if rank == 0:
            return "trainer rank 0 (global rank 0)"
        return f"engine rank {rank - 1} (global rank {self.first_engine_rank + rank - 1})"

    def _wait(self, work: Any, what: str, peer: int | None, *, bound: WaitBound | None = None,
              collective: bool = True, nccl: bool = False) -> None:
        """Wait for ``work``; ``what`` names what is awaited, ``{peer}`` standing for the
        peer (``"{peer}'s reply to rollout 3"``)."""
        done = (polled_done(work) if nccl else collective_done(work) if collective
                else thread_done(work.wait))
        name = self.peer(peer)
        try:
            wait_until(done, what.format(peer=name), bound)
        except RuntimeError as exc:  # gloo: connection closed / timed out
            raise BridgeError(f"waiting for {what.format(peer=name)}: {name} is gone "
                              f"({str(exc)[:160]}). Fix: see that rank's error; the run stops "
                              "on every rank.") from exc

    # -- commands: bridge rank 0 to every other bridge rank ------------------------------------
    def command(self, obj: Any = None, *, bound: WaitBound | None = None,
                kind: str = "control") -> Any:
        """Collective over the bridge: rank 0's ``obj`` on every bridge rank (``bound``: rank
        0's limit on every engine rank taking it; ``kind``: what its bytes count as)."""
        return self.finish_command(self.post_command(), obj, bound=bound, kind=kind)

    def post_command(self) -> Any:
        """Start receiving the next command's length (engine side: poll ``is_completed``)."""
        current().check()  # no new operation on a job that is ending
        size = torch.zeros(1, dtype=torch.int64)
        return size, (None if self.rank == 0 else self.control.broadcast(size, 0))

    def finish_command(self, posted: Any, obj: Any = None, *, bound: WaitBound | None = None,
                       kind: str = "control") -> Any:
        size, work = posted
        self.commands += 1
        if self.rank == 0:
            data = pickle.dumps(obj)
            size[0] = len(data)
            self.bytes.add_sent(kind, (len(data) + LENGTH_BYTES) * (self.size - 1))
            what = "{peer} to take a command"
            self._wait(self.control.broadcast(size, 0), what, self.engines, bound=bound)
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._wait(self.control.broadcast(payload, 0), what, self.engines, bound=bound)
            return obj
        self._wait(work, "the next command from {peer}", 0)  # it trains in between: no bound
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
        self._wait(self.control.broadcast(payload, 0), "the rest of a command from {peer}", 0)
        self.bytes.add_received(kind, int(size[0]) + LENGTH_BYTES)
        return pickle.loads(payload.numpy().tobytes())

    # -- results: an engine rank to trainer rank 0 ---------------------------------------------
    def send(self, obj: Any, dst: int = 0) -> None:
        data = pickle.dumps(obj)
        current().check()
        self.bytes.add_sent(message_kind(obj), len(data) + LENGTH_BYTES)
        self._wait(self.control.send([torch.tensor([len(data)], dtype=torch.int64)], dst, 0),
                   "{peer} to take a result", dst, collective=False)
        self._wait(self.control.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)],
                                     dst, 1), "{peer} to take a result", dst, collective=False)

    def recv(self, src: int = 1, *, what: str = "a result from {peer}",
             bound: WaitBound | None = None) -> Any:
        """Bridge rank ``src``'s next result (``what`` names it in messages, ``{peer}``
        standing for that rank)."""
        current().check()
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(self.control.recv([size], src, 0), what, src, bound=bound, collective=False)
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
        self._wait(self.control.recv([payload], src, 1), what, src, bound=bound,
                   collective=False)
        obj = pickle.loads(payload.numpy().tobytes())
        self.bytes.add_received(message_kind(obj), int(size[0]) + LENGTH_BYTES)
        return obj

    # -- weights ---------------------------------------------------------------------------------
    def send_weights(self, named: Iterable[tuple[str, torch.Tensor]], cap_bytes: int, *,
                     bound: WaitBound | None = None) -> SyncReport:
        """Trainer rank 0: every bucket of ``named`` to every engine rank (after a
        ``("weights", version)`` command), within ``bound``."""
        def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            meta = [(n, str(t.dtype), tuple(t.shape)) for n, t in bucket]
            self.command(meta, bound=bound, kind="weights")
            offsets, total = _layout(meta)
            flat = torch.zeros(total, dtype=torch.uint8, device=self.device)
            for (_, t), offset in zip(bucket, offsets):
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
                flat[offset:offset + raw.numel()].copy_(raw)
            self._wait(self.weights.broadcast(flat, 0), "{peer} to take weights",
                       self.engines, bound=bound, nccl=self.weights is not self.control)
            self.bytes.add_sent("weights", total * (self.size - 1))

        report = stream_weights(named, cap_bytes, load)
        self.command(None, bound=bound, kind="weights")  # end of the weights
        return report

    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Engine rank: the ``(name, tensor)`` pairs of one :meth:`send_weights`, bucket by
        bucket (drain it fully, even after a failed load, to stay in step)."""
        while (meta := self.command(kind="weights")) is not None:
            offsets, total = _layout(meta)
            flat = torch.empty(total, dtype=torch.uint8, device=self.device)
            self._wait(self.weights.broadcast(flat, 0), "the weights from {peer}", 0,
                       nccl=self.weights is not self.control)
            self.bytes.add_received("weights", total)
            for (name, dtype, shape), offset in zip(meta, offsets):
                size = torch.Size(shape).numel() * _DTYPES[dtype].itemsize
                yield name, flat[offset:offset + size].view(_DTYPES[dtype]).reshape(shape)


_ALIGN = 16  # bytes: every tensor of a bucket starts aligned, whatever precedes it


def _layout(meta: list[tuple[str, str, tuple]]) -> tuple[list[int], int]:
    """Byte offsets of a bucket's tensors in its flat buffer, each rounded up to ``_ALIGN``
    (a view as float32 needs a 4-byte-aligned start: a bf16 tensor of 3 elements would leave
    the next one at byte 6), and the buffer's size. Both sides compute it from the same meta.
    Example: bf16 (3,) then float32 (2,) -> offsets [0, 16], size 24."""
    offsets, end = [], 0
    for _, dtype, shape in meta:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + torch.Size(shape).numel() * _DTYPES[dtype].itemsize
    return offsets, end


@attrs.frozen
class Sides:
    """This rank's role, its global rank, the bridge (None on trainer ranks other than 0) and
    the span (every rank: the share exchange's group where engine ranks hold parts)."""

    roles: RankRoles
    rank: int
    bridge: Bridge | None
    span: Any = None

    @property
    def is_trainer(self) -> bool:
        return self.roles.is_trainer(self.rank)

    def name_of(self, rank: int) -> str:
        """How messages name global rank ``rank``, by role. Example (1 trainer rank):
        ``name_of(2)`` -> ``"engine rank 1 (global rank 2)"``."""
        role = "trainer" if self.roles.is_trainer(rank) else "engine"
        return f"{role} rank {self.roles.side_rank(rank)} (global rank {rank})"


_OPEN: dict[tuple[int, int], Sides] = {}  # (world size, trainer ranks) -> this rank's sides


def open_sides(roles: RankRoles, *, backend: str, timeout_s: float = PG_BACKSTOP_S) -> Sides:
    """Collective over the job (see the module docstring); once per process and roles, later
    calls return the same groups (a process may run several trainings in turn). This rank's
    heartbeat starts here, before anything slow is built (:mod:`vime_shell.engines.health`;
    ``timeout_s``, the groups' own timeout, is a backstop the bounded waits preempt)."""
    key = (roles.world_size, roles.num_trainers)
    if key in _OPEN:  # the same split again (another mode, another run): the same groups
        return attrs.evolve(_OPEN[key], roles=roles)
    if dist.is_initialized():
        raise BridgeError("a default process group exists already; separate trainer and "
                          "engine ranks need their own. Fix: let vime create the groups (do not "
                          "call init_process_group before run_training).")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    if world != roles.world_size:
        raise BridgeError(f"the job has {world} ranks, but its trainer and engine ranks were "
                          f"split for {roles.world_size}. Fix: split them for this job (vime "
                          "train does at launch, from --rollout-num-gpus).")
    ensure_monitor(store, rank, world)
    trainer = roles.is_trainer(rank)
    if backend == "nccl":  # before NCCL initialises, so each rank binds its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    side = "trainer" if trainer else "engine"
    dist.init_process_group(
        backend=backend, store=dist.PrefixStore(f"vime/{side}", store),
        rank=roles.side_rank(rank), world_size=roles.num_trainers if trainer
        else roles.num_engine_ranks, timeout=timeout)
    bridge = None
    b = roles.bridge_rank(rank)
    if b is not None:
        control = dist.ProcessGroupGloo(dist.PrefixStore("vime/bridge", store), b,
                                        roles.bridge_size, timeout)
        weights: dist.ProcessGroupGloo | dist.ProcessGroupNCCL = control
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            # torch's stubs make ``options`` required; the binding defaults it
            weights = dist.ProcessGroupNCCL(  # type: ignore[call-arg]
                dist.PrefixStore("vime/bridge-nccl", store), b, roles.bridge_size)
        bridge = Bridge(b, roles.bridge_size, control, weights, device,
                        first_engine_rank=roles.num_trainers, store=store)
    span = dist.ProcessGroupGloo(dist.PrefixStore("vime/span", store), rank, world, timeout)
    _OPEN[key] = Sides(roles=roles, rank=rank, bridge=bridge, span=span)
    return _OPEN[key]
