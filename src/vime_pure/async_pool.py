"""Asynchronous training decisions: when weights sync, which groups a pool may start, which
completed groups a trainer step takes and which it recycles (pure, torch-free).

Versions: the trainer's weights after training ``v`` rollout batches are version ``v``; an
engine holds the version of its last weight sync; a group's version is the engine version
its generation started with (the oldest of its samples' ``weight_versions``). When the trainer
trains batch ``k`` (having trained ``k`` batches since version 0) a group of version ``g`` is
``k - g`` versions stale (``vime_pure.staleness``, the one definition of staleness).

Modes (slime / miles flags):

- synchronous: rollout ``k`` is generated with version ``k`` (lag 0);
- ``--train-async`` (one step off): rollout ``k + 1`` is generated while the trainer trains
  rollout ``k``, so with version ``k`` (lag 1); ``--max-weight-staleness 0`` makes it
  synchronous again (:func:`generation_lag`);
- ``--fully-async``: a pool keeps ``--rollout-batch-size`` groups in flight; a trainer step
  takes the first ``B`` completed groups whose staleness is at most ``K``
  (``--max-weight-staleness``) and sends every staler group back to be generated again
  (:func:`drain`); the pool starts a group only if it can still be fresh enough for the
  batch it would land in (:func:`admits`), so with ``K = 0`` nothing is ever generated twice.

``--update-weights-interval I`` syncs after rollout ``k`` only when ``(k + 1) % I == 0``
(:func:`weights_sync_due`); staleness then reaches ``I - 1`` plus the lag, so
:func:`check_staleness_bound` asks for ``K >= I - 1`` (else no group could ever be trained).

Example: ``drain(versions=(3, 1, 4, 4), trainer_version=4, max_staleness=1, batch_size=2)``
takes groups 0 and 2, recycles group 1 (3 versions old) and leaves group 3 for the next step.
"""

import enum
from typing import Any

import attrs
import numpy as np

from vime_pure.config import as_int
from vime_pure.errors import VimeError, field_error
from vime_pure.staleness import sample_staleness



class SyncMode(enum.StrEnum):
    """The one enum of asynchronous modes (a new mode is a member here and a rollout source in
    ``vime_shell.sources``). A ``StrEnum``: its members are the plain strings that checkpoints
    and records hold."""

    SYNC = "sync"  # colocated or not: rollout k is generated with version k
    ONE_STEP_OFF = "one_step_off"  # --train-async: rollout k+1 generated while k trains
    FULLY_ASYNC = "fully_async"  # --fully-async: pools judge every group's staleness


SYNC_MODES: tuple[str, ...] = tuple(m.value for m in SyncMode)
_FIX = "pass a whole number (the flags --rollout-batch-size, --max-weight-staleness, " \
    "--update-weights-interval are integers)"


class AsyncPoolError(VimeError):
    """An asynchronous-training setting that cannot run, or a group past its staleness bound."""


def weights_sync_due(rollout_id: Any, interval: Any) -> bool:
    """Whether the trainer syncs the engines after training rollout ``rollout_id`` (inputs
    are typed loosely: a user boundary, checked here).

    Example: interval 2 syncs after rollouts 1, 3, 5 (``weights_sync_due(1, 2) is True``).
    """
    rollout_id = as_int("rollout_id", rollout_id, 0, AsyncPoolError, _FIX)
    return (rollout_id + 1) % as_int("update_weights_interval", interval, 1, AsyncPoolError,
                                     _FIX) == 0


def generation_lag(mode: Any, max_staleness: Any) -> int:
    """Rollouts the engines run ahead of the trainer: 0 synchronous, 1 one step off (0 when
    ``--max-weight-staleness 0``); the fully-async pool decides per group instead (0 here).

    Example: ``generation_lag("one_step_off", None) == 1``.
    """
    if not isinstance(mode, str) or mode not in SYNC_MODES:
        raise field_error(AsyncPoolError, "mode", mode, "is not a training mode",
                          f"use one of {SYNC_MODES}")
    if mode != "one_step_off":
        return 0
    if max_staleness is None:
        return 1
    return min(1, as_int("max_weight_staleness", max_staleness, 0, AsyncPoolError, _FIX))


def check_staleness_bound(*, max_staleness: Any, update_weights_interval: Any,
                          lag: Any = 0) -> None:
    """``K >= lag + I - 1``: a group generated right after a sync is ``I - 1`` versions old by
    the last batch before the next sync, plus the lag of one step off. Example: ``K=0, I=2`` is
    an error naming both flags; one step off (lag 1) with ``I=2`` needs ``K >= 2``."""
    max_staleness = as_int("max_weight_staleness", max_staleness, 0, AsyncPoolError, _FIX)
    need = (as_int("lag", lag, 0, AsyncPoolError, _FIX)
            + as_int("update_weights_interval", update_weights_interval, 1, AsyncPoolError,
                     _FIX) - 1)
    if max_staleness < need:
        raise field_error(AsyncPoolError, "--max-weight-staleness", max_staleness,
                          f"is below {need} (generation lag {lag} + --update-weights-interval "
                          f"{update_weights_interval} - 1): some batches would be staler",
                          f"pass --max-weight-staleness {need} or more, or a smaller "
                          "--update-weights-interval")


@attrs.frozen(kw_only=True)
class Asynchrony:
    """How far generation runs ahead of training, resolved once per job: the mode, ``K``
    (``--max-weight-staleness``, default 1) and ``I`` (``--update-weights-interval``). Built
    only when the bound holds (:func:`check_staleness_bound`), so every holder can trust it.
    The asynchrony as one number is :attr:`lag` for the step-wise modes and ``K`` for the pool
    (torchtitan's ``max_offpolicy_steps``, prime-rl's ``--max-async-level``): 0 is synchronous.

    Example: ``Asynchrony(mode=SyncMode.ONE_STEP_OFF, max_staleness=0).lag == 0`` (one step off
    made synchronous again); ``Asynchrony(mode=SyncMode.FULLY_ASYNC, max_staleness=0,
    update_weights_interval=2)`` raises, naming both flags.
    """

    mode: SyncMode = attrs.field(converter=SyncMode)
    max_staleness: int = 1
    update_weights_interval: int = 1

    def __attrs_post_init__(self) -> None:
        as_int("max_weight_staleness", self.max_staleness, 0, AsyncPoolError, _FIX)
        as_int("update_weights_interval", self.update_weights_interval, 1, AsyncPoolError, _FIX)
        if self.bounded:
            check_staleness_bound(max_staleness=self.max_staleness, lag=self.lag,
                                  update_weights_interval=self.update_weights_interval)

    @property
    def lag(self) -> int:
        """Rollouts the engines run ahead of the trainer (:func:`generation_lag`)."""
        return generation_lag(self.mode.value, self.max_staleness)

    @property
    def bounded(self) -> bool:
        """Batches may be generated by older weights, so every batch is checked against ``K``
        before it trains (:func:`enforce_staleness_bound`)."""
        return self.mode is not SyncMode.SYNC

    @property
    def pooled(self) -> bool:
        """Groups are started, judged and recycled one by one (:func:`admits`, :func:`drain`),
        by a pool on every engine rank, each answering its part of every batch."""
        return self.mode is SyncMode.FULLY_ASYNC

    def staleness_needed(self, *, carries_groups: bool) -> int:
        """The least ``K`` whose bound every batch meets: ``lag + I - 1``, plus one rollout
        when unfinished groups are carried into the next rollout (``--partial-rollout`` one
        step off: a carried group's first segment is one rollout older than the batch). The
        pool carries nothing across batches (its cuts continue at once): never more.
        Example: one step off with ``I = 1`` needs ``K >= 1``, and ``K >= 2`` when it carries."""
        extra = int(carries_groups and not self.pooled)
        return self.lag + self.update_weights_interval - 1 + extra

    @property
    def flag(self) -> str:
        """The flag that chose the mode, for messages (``""`` when synchronous)."""
        return {SyncMode.SYNC: "", SyncMode.ONE_STEP_OFF: "--train-async",
                SyncMode.FULLY_ASYNC: "--fully-async"}[self.mode]


def resolve_asynchrony(*, train_async: bool, fully_async: bool, max_weight_staleness: Any,
                       update_weights_interval: Any = 1) -> Asynchrony:
    """The flags as one :class:`Asynchrony`; ``--train-async`` and ``--fully-async`` exclude
    each other.

    Example: ``resolve_asynchrony(train_async=True, fully_async=False,
    max_weight_staleness=None).lag == 1``.
    """
    if train_async and fully_async:
        raise field_error(AsyncPoolError, "--fully-async", True, "excludes --train-async",
                          "pass one of them (--fully-async also overlaps generation)")
    mode = (SyncMode.FULLY_ASYNC if fully_async else SyncMode.ONE_STEP_OFF if train_async
            else SyncMode.SYNC)
    return Asynchrony(mode=mode, max_staleness=1 if max_weight_staleness is None
                      else max_weight_staleness,
                      update_weights_interval=update_weights_interval)


def enforce_staleness_bound(weight_version_min: Any, trainer_version: Any,
                            max_staleness: Any) -> None:
    """The bound as a check on a batch about to train: every sample's staleness (the core's
    ``sample_staleness``) is at most ``K``, else :class:`AsyncPoolError` naming the sample.
    Example: versions ``[3, 1]`` at trainer 3 with ``K=1`` raise for sample 1 (staleness 2).
    """
    max_staleness = as_int("max_weight_staleness", max_staleness, 0, AsyncPoolError, _FIX)
    stale = sample_staleness(weight_version_min, trainer_version)
    if stale.size and int(stale.max()) > max_staleness:
        i = int(np.argmax(stale))
        raise field_error(AsyncPoolError, f"staleness of sample {i}", int(stale[i]),
                          f"exceeds --max-weight-staleness {max_staleness}: it would train",
                          "report this: the engine side ran further ahead than the bound")


def admits(*, batches_sent: Any, start_version: Any, engine_version: Any, queued: Any,
           batch_size: Any, max_staleness: Any, in_flight: Any = None) -> bool:
    """Whether the pool may start one more group now.

    ``queued`` groups (in flight or completed, not yet sent) are ahead of it, so it lands in
    batch ``batches_sent + queued // batch_size`` at the earliest, trained by version
    ``start_version + that``; it is started only if its staleness there is at most ``K``, and
    while fewer than ``in_flight + B`` are queued: the groups allowed in flight
    (``--async-max-concurrent-samples``; default ``B``) plus one batch ready. A long tail
    overlaps more with more in flight; the staleness bound still caps the queue at about
    ``K + 1`` batches.
    Example: ``B=4, K=0``, nothing sent, 4 queued at version 0: the next group would land in
    batch 1 (version 1) with staleness 1, so ``admits(...) is False`` until the sync.
    """
    batches_sent, start_version, engine_version, queued, batch_size, max_staleness = (
        as_int(name, value, lo, AsyncPoolError, _FIX) for name, value, lo in (
            ("batches_sent", batches_sent, 0), ("start_version", start_version, 0),
            ("engine_version", engine_version, 0), ("queued", queued, 0),
            ("batch_size", batch_size, 1), ("max_staleness", max_staleness, 0)))
    in_flight = batch_size if in_flight is None else as_int("in_flight", in_flight, 1,
                                                            AsyncPoolError, _FIX)
    if queued >= in_flight + batch_size:
        return False
    lands_in = start_version + batches_sent + queued // batch_size
    return lands_in - engine_version <= max_staleness


@attrs.frozen(kw_only=True)
class Drain:
    """One trainer step's share of the completed groups (indices into the ready list)."""

    take: tuple[int, ...]
    recycle: tuple[int, ...]
    keep: tuple[int, ...]
    full: bool  # ``take`` holds a whole batch (else the trainer waits for more groups)


def drain(*, versions: Any, trainer_version: Any, max_staleness: Any, batch_size: Any) -> Drain:
    """Split completed groups (``versions`` in completion order) for the step trained by
    ``trainer_version``: the first ``batch_size`` with staleness <= ``max_staleness`` are
    taken, every staler one is recycled (generated again, counted), the rest wait.

    Every index lands in exactly one of ``take``, ``recycle`` and ``keep``; no taken group
    is staler than the bound. Example in the module docstring.
    """
    max_staleness = as_int("max_staleness", max_staleness, 0, AsyncPoolError, _FIX)
    batch_size = as_int("batch_size", batch_size, 1, AsyncPoolError, _FIX)
    if not isinstance(versions, (tuple, list)) or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
            for v in versions):
        raise field_error(AsyncPoolError, "versions", versions, "is not a sequence of integer "
                          "weight versions", "pass each completed group's engine version")
    take: list[int] = []
    recycle: list[int] = []
    keep: list[int] = []
    staleness = sample_staleness(np.asarray(versions, dtype=np.int64).reshape(-1),
                                 trainer_version)
    for i, stale in enumerate(staleness.tolist()):
        if stale > max_staleness:
            recycle.append(i)
        elif len(take) < batch_size:
            take.append(i)
        else:
            keep.append(i)
    return Drain(take=tuple(take), recycle=tuple(recycle), keep=tuple(keep),
                 full=len(take) == batch_size)


def is_count(value: Any) -> bool:
    """A whole number >= 0 (not a bool): a count read back from a checkpoint."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@attrs.frozen(kw_only=True)
class PoolCounts:
    """What a fully-async pool did with every group it started (nothing goes uncounted):
    ``started = trained + recycled + filtered + pending``.

    ``started``, ``trained``, ``recycled`` and ``filtered`` are counters over the whole run,
    across resumes (a checkpoint keeps them, :meth:`to_state`); ``pending`` is a gauge: the
    groups in flight or ready at that moment. A resumed run continues from :meth:`resumed`.
    """

    started: int = 0
    trained: int = 0
    recycled: int = 0
    filtered: int = 0

    @property
    def pending(self) -> int:
        """Groups started but not yet trained, recycled or filtered (in flight or ready)."""
        return self.started - self.trained - self.recycled - self.filtered

    def add(self, **counts: int) -> "PoolCounts":
        """Example: ``PoolCounts().add(started=4, trained=2).pending == 2``."""
        return attrs.evolve(self, **{k: getattr(self, k) + v for k, v in counts.items()})

    def resumed(self) -> "PoolCounts":
        """The counts a run resumed from these continues from: the groups pending at the
        checkpoint are generated again with their original seeds, so they count as recycled
        (and ``pending`` restarts at 0). Example: started 10, trained 8, 2 pending ->
        started 10, trained 8, recycled 2, pending 0."""
        return attrs.evolve(self, recycled=self.recycled + self.pending)

    def as_record(self) -> dict[str, int]:
        """The metrics record's ``pool_*`` keys. Example: ``PoolCounts(started=2,
        trained=1).as_record()["pool_pending"] == 1``."""
        return {"pool_started": self.started, "pool_trained": self.trained,
                "pool_recycled": self.recycled, "pool_filtered": self.filtered,
                "pool_pending": self.pending}

    def to_state(self) -> dict[str, int]:
        """Plain JSON for a checkpoint (:meth:`from_state` reads it back)."""
        return attrs.asdict(self)

    @classmethod
    def from_state(cls, state: Any) -> "PoolCounts":
        """Inverse of :meth:`to_state`; a malformed one is an :class:`AsyncPoolError`.
        Example: ``PoolCounts.from_state({"started": 3, "trained": 2, "recycled": 0,
        "filtered": 1}).pending == 0``."""
        names = tuple(attrs.fields_dict(cls))
        if not isinstance(state, dict) or set(state) != set(names) or not all(
                is_count(state[n]) for n in names) or cls(**state).pending < 0:
            raise field_error(AsyncPoolError, "checkpoint pool_counts", state,
                              f"are not the counts {list(names)} (whole numbers, started "
                              "at least the others' sum)",
                              "resume from an intact checkpoint (--load)")
        return cls(**state)
