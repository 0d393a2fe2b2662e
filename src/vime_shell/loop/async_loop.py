"""Training on separate rollout ranks: the trainer's client (:class:`RemoteRollouts`) and the
engine ranks' server (:func:`serve_rollouts`), in the synchronous and one-step-off modes; the
fully-async pool is :mod:`vime_shell.loop.fully_async`.

The trainer drives, over the bridge (:mod:`vime_shell.engines.remote`), with commands the
engine ranks execute in order:

- ``("generate", rid, source)``: the engine ranks' own :class:`RolloutProducer` (prompts,
  dynamic-sampling rounds, rewards, the ``RolloutBatch``, on the engines' default group) makes
  rollout ``rid``; engine rank 0 sends ``("batch", rid, batch, record, source)`` back;
- ``("weights", version)`` then the buckets: every engine rank loads them;
- ``("evaluate", rid)``: the eval sets on the current weights; ``("stop",)``.

Order per rollout ``k`` on trainer rank 0 (``L`` = :func:`vime_pure.async_pool.generation_lag`):
synchronous (``L = 0``): generate ``k``, receive it, train, sync; one step off (``L = 1``):
receive ``k`` (requested during rollout ``k - 1``), request ``k + 1`` (generated with the
weights that trained nothing of ``k``: one version old when trained), train ``k``, receive
``k + 1``, sync. Every reply is received before the next command that expects one, so the two
sides never wait on each other. Each batch's record carries the engine's weight version;
``weight_staleness`` is the core's :func:`group_staleness` of it at the trainer's version
(= rollouts trained).

A failure on an engine rank comes back as ``("error", text)`` and is raised on trainer rank 0
as :class:`EngineGroupError` naming the engine rank (the loop's ``rank0_result`` then stops
every trainer rank); the engine ranks re-raise their own error. A rank that died makes the next
bridge call raise :class:`BridgeError` on the other side.
"""

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import torch

from vime_pure.async_pool import generation_lag, group_staleness
from vime_pure.data.batch import RolloutBatch
from vime_shell.engines.group import EngineGroup, EngineGroupError, EngineOptions
from vime_shell.engines.remote import BridgeError, Sides
from vime_shell.engines.sync import stream_weights
from vime_shell.loop.config import TrainConfig
from vime_shell.loop.fully_async import GroupPool
from vime_shell.loop.launch_checks import LaunchPlan
from vime_shell.loop.rollouts import RolloutProducer
from vime_shell.megatron.collectives import rank0_result

log = logging.getLogger("vime.train")


@attrs.define
class SourceState:
    """Where the engines' prompt source stands after the last trained rollout (checkpoints)."""

    offset: int = 0
    draws: int = 0


@attrs.frozen
class RemoteGeneration:
    """A rollout's statistics as the engine side reported them (``as_record`` for the log)."""

    record: dict

    def as_record(self) -> dict:
        return dict(self.record)


class RemoteRollouts:
    """The trainer ranks' view of separate engine ranks: ``produce``, ``evaluate``,
    ``sync_weights``, ``close``, as the colocated producer and engine group offer them.
    Collective over the trainer ranks; only trainer rank 0 holds the bridge."""

    engine = None  # no engine on a trainer rank

    def __init__(self, cfg: TrainConfig, sides: Sides, total: int):
        self.cfg, self.bridge, self.total = cfg, sides.bridge, total
        self.mode = sides.roles.mode
        self.first_engine_rank = sides.roles.num_trainers
        self.lag = generation_lag(self.mode, cfg.max_weight_staleness)
        self.source = SourceState()
        self._restore: tuple[int, int] | None = None
        self._requested: list[int] = []  # asked for, reply not yet received
        self._received: dict[int, tuple] = {}
        self._closed = False

    # -- generation ----------------------------------------------------------------------------
    def produce(self, rid: int) -> tuple[RolloutBatch, RemoteGeneration] | None:
        """Rollout ``rid``'s batch and statistics on trainer rank 0, None elsewhere."""
        if self.bridge is None:
            return None
        if self.mode == "fully_async":
            self._ask(("batch", rid, self._take_restore()), rid)
        elif rid not in self._requested and rid not in self._received:
            self._ask(("generate", rid, self._take_restore()), rid)
        reply = self._reply(rid)
        if self.lag and rid + 1 < self.total and self.mode != "fully_async":
            self._ask(("generate", rid + 1, None), rid + 1)
        _, _, batch, record, source = reply
        if source is not None:
            self.source = SourceState(*source)
        version = record["weight_version"]
        record = {**record, "weight_staleness": group_staleness(rid, version)}
        return batch, RemoteGeneration(record)

    def _take_restore(self) -> tuple[int, int] | None:
        restore, self._restore = self._restore, None
        return restore

    def _ask(self, command: tuple, rid: int) -> None:
        self.bridge.command(command)
        self._requested.append(rid)

    def _reply(self, rid: int) -> tuple:
        while rid not in self._received:
            self._collect_one()
        return self._received.pop(rid)

    def _collect_one(self) -> None:
        """Receive the oldest outstanding reply; an engine's failure is raised here."""
        expected = self._requested.pop(0)
        reply = self.bridge.recv(src=1)
        if reply[0] == "error":
            raise EngineGroupError(f"rollout generation failed on engine rank 0 (global rank "
                                   f"{self.first_engine_rank}): {reply[1]}. Fix: see that "
                                   "rank's traceback.")
        self._received[expected] = reply

    def _drain(self) -> None:
        """Every outstanding reply, received now: the next command expects none before its
        own (so the engine is never blocked sending while the trainer broadcasts)."""
        while self._requested:
            self._collect_one()

    def evaluate(self, rid: int) -> dict[str, float]:
        """Collective over the trainer ranks: the eval metrics on the engines' weights."""
        def ask() -> dict[str, float]:
            self._drain()
            self.bridge.command(("evaluate", rid))
            reply = self.bridge.recv(src=1)
            if reply[0] == "error":
                raise EngineGroupError(f"evaluation failed on engine rank 0 (global rank "
                                       f"{self.first_engine_rank}): {reply[1]}")
            return reply[1]

        return rank0_result(f"evaluation at rollout {rid}", ask)

    # -- weights ---------------------------------------------------------------------------------
    def sync_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None):
        """Collective over the trainer ranks (the export is): rank 0 sends every bucket to the
        engine ranks, the others drain the export."""
        cap = self.cfg.update_weight_buffer_size
        if self.bridge is None:
            return stream_weights(named, cap, None)
        self._drain()
        self.bridge.command(("weights", version))
        return self.bridge.send_weights(named, cap)

    def restore(self, offset: int, draws: int) -> None:
        """Resume: the engines' prompt source continues from here (sent with the next
        request)."""
        self.source = SourceState(offset, draws)
        self._restore = (offset, draws)

    def sleep(self) -> None:
        """Engines on ranks of their own never give memory back to the trainer."""

    def close(self) -> None:
        """Tell the engine ranks to stop (once; a gone engine rank is not waited for)."""
        if self.bridge is None or self._closed:
            return
        self._closed = True
        try:
            self.bridge.command(("stop",))
        except BridgeError:
            pass  # the engine side already stopped (its failure was raised where it occurred)


def serve_rollouts(cfg: TrainConfig, plan: LaunchPlan, options: EngineOptions,
                   sides: Sides) -> None:
    """Engine ranks: build the engines on the engine ranks' own group, then execute the
    trainer's commands until ``("stop",)``."""
    engines = EngineGroup.build(plan.hf_dir, plan.engine_layout, options)
    try:
        producer = RolloutProducer(cfg, plan, engines)
        if sides.roles.mode == "fully_async":
            GroupPool(cfg, producer, sides.bridge).run()
        else:
            _Server(producer, sides.bridge).run()
    finally:
        engines.close()


class _Server:
    """One engine rank's command loop (synchronous and one-step-off modes)."""

    def __init__(self, producer: RolloutProducer, bridge: Any):
        self.producer, self.bridge = producer, bridge
        self.lead = bridge.rank == 1
        self.version = 0
        self.failure: str | None = None  # a failed weight load, reported with the next reply

    def run(self) -> None:
        while True:
            command = self.bridge.command()
            kind = command[0]
            if kind == "stop":
                return
            if kind == "weights":
                self._load(command[1])
            elif kind == "generate":
                self._reply(lambda: self._generate(command[1], command[2]))
            elif kind == "evaluate":
                self._reply(lambda: ("eval", self.producer.evaluate(command[1])))

    def _reply(self, work) -> None:
        try:
            if self.failure is not None:
                raise EngineGroupError(self.failure)
            reply = work()
        except Exception as exc:
            if self.lead:
                self.bridge.send(("error", f"{type(exc).__name__}: {exc}"))
            wait_for_stop(self.bridge)  # the trainer raises, then says stop: leave in step
            raise
        if self.lead:
            self.bridge.send(reply)

    def _generate(self, rid: int, restore: tuple[int, int] | None) -> tuple:
        source = self.producer.source
        if restore is not None:
            source.offset, source.draws = restore
        out = self.producer.produce(rid)  # collective over the engine ranks
        if out is None:
            return ("batch", rid, None, None, None)
        batch, stats = out
        record = {**stats.as_record(), "weight_version": self.version}
        return ("batch", rid, batch, record, (source.offset, source.draws))

    def _load(self, version: int) -> None:
        received = self.bridge.receive_weights()
        try:
            self.producer.engines.sync_weights(received)
            self.version = version
        except Exception as exc:  # noqa: BLE001 - reported with the next reply
            self.failure = f"weight load of version {version} failed: {type(exc).__name__}: {exc}"
            _exhaust(received)


def wait_for_stop(bridge: Any) -> None:
    """After a failure: take (and discard) the trainer's commands until its ``("stop",)``."""
    while (command := bridge.command())[0] != "stop":
        if command[0] == "weights":
            _exhaust(bridge.receive_weights())


def _exhaust(items: Iterator) -> None:
    for _ in items:
        pass
