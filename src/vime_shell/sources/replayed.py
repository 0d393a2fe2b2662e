"""Replayed dumps as the run's rollout source (``--load-rollout-data``; the dumps themselves:
:mod:`vime_shell.sources.replay`)::

    next(k): rank 0 loads dump k ─▶ Produced(whole batch) ─▶ the step (no staleness bound, no
             log-prob check: another run's engine generated it)
    sync(weights, v): the engine, if any (``--load-rollout-data-mode forge``), takes the
             weights and never generates; a train-only replay has none and syncs nothing

Example: ``ReplayedRollouts(ReplaySource("d/r{rollout_id}.npz")).next(3, 3)`` on rank 0 is
``Produced.whole`` of ``d/r3.npz``.
"""

import torch.distributed as dist

from vime_pure.data.rewards import RewardNormalization
from vime_shell.engines.byte_counts import ByteCounts
from vime_shell.engines.group import EngineGroup
from vime_shell.sources.base import Produced, SyncReport, Weights, rank_name
from vime_shell.sources.replay import ReplaySource


class ReplayedRollouts:
    """Replayed dumps as the run's rollout source (module docstring); ``engines``: the forge
    mode's engine, kept for syncs only (its KV cache is freed now), or None."""

    generates = False
    exchange_group = None  # rank 0 holds every batch
    normalization = RewardNormalization()  # a dump's own advantages are kept

    def __init__(self, replay: ReplaySource, engines: EngineGroup | None = None):
        self.replay, self.engines = replay, engines
        if engines is not None:
            engines.sleep()

    @property
    def engine(self):
        return None if self.engines is None else self.engines.engine

    def next(self, rollout_id: int, trainer_version: int) -> Produced:
        if dist.get_rank() != 0:
            return Produced()
        return Produced.whole(self.replay.load(rollout_id), None,
                              origin=f"replayed from {self.replay.path(rollout_id)}")

    def sync(self, weights: Weights, version: int) -> SyncReport:
        if self.engines is None:
            return SyncReport()
        return SyncReport(moved=self.engines.sync_weights(weights(), version=version))

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        return {}  # never asked: the step evaluates generating sources only

    holder_name = staticmethod(rank_name)

    def state(self) -> dict | None:
        return None

    def restore(self, state: dict | None) -> None:
        """Nothing to restore: dump ``k`` is replayed for rollout ``k``."""

    def take_bytes(self) -> ByteCounts | None:
        return None if self.engines is None else self.engines.take_bytes()

    def close(self) -> None:
        if self.engines is not None:
            self.engines.close()
