"""The colocated rollout source: the trainer ranks' own engines (:class:`EngineGroup`) and the
prompts, rounds and rewards of :class:`RolloutProducer`, behind :class:`RolloutSource`.

Data flow of ``next(k, v)``::

    every engine ─ claims chunks of the round's prompts ─▶ rollout function ─▶ rewards
      parts (no rollout-log hook): each leader judges its groups (dynamic
        sampling: verdicts only travel) and keeps its part
      otherwise: rank 0 merges, judges and holds the whole batch
    ─▶ Produced(part, meta, stats) on every rank (empty where nothing is held)

Synchronous by construction: rollout ``k`` is generated right after the sync that ended
``k - 1``, so the batch is fresh and the step's own forward checks the sync (no probe).

Example: ``ColocatedSource(cfg, plan, EngineGroup.build(...)).next(0, 0)`` on a world of 2
with one engine per rank: each rank holds the part its engine generated.
"""

from typing import Any

from vime_shell.engines.byte_counts import ByteCounts
from vime_shell.engines.group import EngineGroup
from vime_shell.megatron.collectives import rank0_result
from vime_shell.settings.launch_plan import LaunchPlan
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.base import Produced, SyncReport, Weights
from vime_shell.sources.rollouts import RolloutProducer


class ColocatedSource:
    """Engines inside the trainer ranks (the module docstring)."""

    generates = True
    exchange_group = None  # every part sits on a trainer rank

    def __init__(self, cfg: TrainConfig, plan: LaunchPlan, engines: EngineGroup):
        self.engines = engines
        # the SFT rollout generates nothing: its engines are NoEngines and take no weights
        self.takes_weights = cfg.generates
        self.producer = RolloutProducer(cfg, plan, engines)
        self.normalization = self.producer.normalization

    @property
    def engine(self) -> Any:
        return self.engines.engine

    def next(self, rollout_id: int, trainer_version: int) -> Produced:
        if self.producer.sharded:
            return self.producer.produce_part(rollout_id)
        generated = self.producer.produce(rollout_id)
        return Produced() if generated is None else Produced.whole(*generated)

    def sync(self, weights: Weights, version: int) -> SyncReport:
        if not self.takes_weights:  # every rank alike: none exports
            return SyncReport()
        return SyncReport(moved=self.engines.sync_weights(weights(), version=version))

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        return self.producer.evaluate(rollout_id)

    def holder_name(self, rank: int) -> str:
        return self.engines.engine_name(rank)

    def state(self) -> dict | None:
        producer = self.producer
        held = producer.partial_state()  # collective: every engine's buffered groups
        return rank0_result("data state", lambda: {
            "offset": producer.source.offset, "draws": producer.source.draws, **held})

    def restore(self, state: dict | None) -> None:
        if state:
            self.producer.source.offset = int(state["offset"])
            self.producer.source.draws = int(state["draws"])
            self.producer.restore_partial_state(state)

    def take_bytes(self) -> ByteCounts | None:
        return self.engines.take_bytes()

    def close(self) -> None:
        self.engines.close()
