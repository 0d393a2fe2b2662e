"""Properties of the asynchronous-training decisions (``vime_pure.async_pool``).

``drain`` partitions the completed groups and never hands over one past the bound; a simulated
fully-async run (random completion order, random trainer pace, syncs every
``--update-weights-interval``) driven only by ``admits`` and ``drain`` never trains a group past
``--max-weight-staleness``, counts every group it started, and with a bound of 0 never
generates a group twice.
"""

import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_pure.async_pool import (SYNC_MODES, AsyncPoolError, Asynchrony, PoolCounts, SyncMode,
                                  admits, check_staleness_bound, drain, enforce_staleness_bound,
                                  generation_lag, resolve_asynchrony, weights_sync_due)
from vime_pure.errors import RolloutBatchError


def test_docstring_examples():
    split = drain(versions=(3, 1, 4, 4), trainer_version=4, max_staleness=1, batch_size=2)
    assert (split.take, split.recycle, split.keep, split.full) == ((0, 2), (1,), (3,), True)
    assert weights_sync_due(1, 2) and not weights_sync_due(0, 2)
    assert generation_lag("one_step_off", None) == 1
    assert generation_lag("one_step_off", 0) == 0
    assert generation_lag("sync", 3) == 0
    assert not admits(batches_sent=0, start_version=0, engine_version=0, queued=4,
                      batch_size=4, max_staleness=0)
    assert PoolCounts().add(started=4, trained=2).pending == 2


def test_bad_inputs_are_typed_errors():
    with pytest.raises(RolloutBatchError, match="newer than the trainer"):
        drain(versions=(3,), trainer_version=2, max_staleness=0, batch_size=1)
    with pytest.raises(AsyncPoolError, match="--max-weight-staleness"):
        check_staleness_bound(max_staleness=0, update_weights_interval=2)
    with pytest.raises(AsyncPoolError, match="one step off|lag 1"):
        check_staleness_bound(max_staleness=1, update_weights_interval=2, lag=1)
    with pytest.raises(AsyncPoolError, match="sample 1"):
        enforce_staleness_bound(np.array([3, 1]), 3, 1)
    enforce_staleness_bound(np.array([3, -1, 2]), 3, 1)  # on policy (-1) counts as fresh
    with pytest.raises(AsyncPoolError, match="mode"):
        generation_lag("async", 1)


def assert_asynchrony_invariants(a: Asynchrony) -> None:
    """What every holder of a resolved ``Asynchrony`` may rely on."""
    assert a.lag in (0, 1) and a.lag <= a.max_staleness or a.mode is SyncMode.SYNC
    assert (a.lag == 1) == (a.mode is SyncMode.ONE_STEP_OFF and a.max_staleness >= 1)
    assert a.bounded == (a.mode is not SyncMode.SYNC)
    assert a.pooled == (a.mode is SyncMode.FULLY_ASYNC)
    if a.bounded:  # every batch can be fresh enough: K >= lag + I - 1
        assert a.max_staleness >= a.lag + a.update_weights_interval - 1
    plain = a.staleness_needed(carries_groups=False)
    assert plain == a.lag + a.update_weights_interval - 1
    # carrying unfinished groups into the next rollout costs one version, except in the pool
    assert a.staleness_needed(carries_groups=True) == plain + (not a.pooled)
    assert a.mode.value in SYNC_MODES and (a.flag == "") == (a.mode is SyncMode.SYNC)


def test_the_asynchrony_is_one_resolved_value():
    """The two flags and K resolve once; K = 0 makes one step off synchronous (lag 0), the
    default K is 1, and the flags that exclude each other or break the bound are refused."""
    one_off = resolve_asynchrony(train_async=True, fully_async=False, max_weight_staleness=None)
    assert (one_off.mode, one_off.lag, one_off.max_staleness) == (SyncMode.ONE_STEP_OFF, 1, 1)
    assert resolve_asynchrony(train_async=True, fully_async=False,
                              max_weight_staleness=0).lag == 0
    pool = resolve_asynchrony(train_async=False, fully_async=True, max_weight_staleness=2,
                              update_weights_interval=3)
    assert pool.pooled and pool.lag == 0 and pool.flag == "--fully-async"
    assert SyncMode("fully_async") is SyncMode.FULLY_ASYNC and SyncMode.SYNC == "sync"
    with pytest.raises(AsyncPoolError, match="--fully-async=True: excludes --train-async"):
        resolve_asynchrony(train_async=True, fully_async=True, max_weight_staleness=None)
    with pytest.raises(AsyncPoolError, match="--max-weight-staleness"):
        Asynchrony(mode=SyncMode.FULLY_ASYNC, max_staleness=0, update_weights_interval=2)
    with pytest.raises(ValueError):
        Asynchrony(mode="async")
    for a in (one_off, pool):
        assert_asynchrony_invariants(a)


@given(st.booleans(), st.booleans(), st.one_of(st.none(), st.integers(0, 4)),
       st.integers(1, 4))
def test_every_accepted_flag_combination_resolves_to_a_consistent_asynchrony(
        train_async, fully_async, staleness, interval):
    try:
        a = resolve_asynchrony(train_async=train_async, fully_async=fully_async,
                               max_weight_staleness=staleness, update_weights_interval=interval)
    except AsyncPoolError as exc:
        assert str(exc).count("Fix:") == 1
        return
    assert_asynchrony_invariants(a)
    assert a.lag == generation_lag(a.mode.value, staleness)


@given(st.lists(st.integers(0, 20), max_size=40), st.integers(0, 20), st.integers(0, 5),
       st.integers(1, 8))
def test_drain_partitions_and_respects_the_bound(versions, trainer, bound, size):
    """Each completed group is taken, recycled or kept exactly once, in completion order; no
    taken group is staler than the bound and every recycled one is; the batch is full iff
    enough fresh-enough groups exist."""
    versions = [min(v, trainer) for v in versions]
    split = drain(versions=tuple(versions), trainer_version=trainer, max_staleness=bound,
                  batch_size=size)
    assert sorted(split.take + split.recycle + split.keep) == list(range(len(versions)))
    assert all(trainer - versions[i] <= bound for i in split.take + split.keep)
    assert all(trainer - versions[i] > bound for i in split.recycle)
    fresh = [i for i, v in enumerate(versions) if trainer - v <= bound]
    assert list(split.take) == fresh[:size] and split.full == (len(fresh) >= size)


@st.composite
def async_runs(draw):
    """A fully-async run: batch size, bound, sync interval (bound >= interval - 1, as the
    launch check asks), steps, and a seed for completion order and pace."""
    interval = draw(st.integers(1, 3))
    return dict(size=draw(st.integers(1, 5)), interval=interval,
                bound=draw(st.integers(interval - 1, interval + 2)),
                steps=draw(st.integers(1, 8)), seed=draw(st.integers(0, 2**16)))


def simulate(size: int, bound: int, interval: int, steps: int, seed: int) -> dict:
    """The engine pool and the trainer, event by event, deciding only with the core."""
    rng = random.Random(seed)
    engine_version = trainer_version = 0
    running: list[int] = []  # versions of groups in flight
    ready: list[int] = []
    counts = PoolCounts()
    trained: list[int] = []
    for _ in range(10_000):
        if len(trained) == steps * size:
            break
        while admits(batches_sent=trainer_version, start_version=0,
                     engine_version=engine_version, queued=len(running) + len(ready),
                     batch_size=size, max_staleness=bound):
            running.append(engine_version)
            counts = counts.add(started=1)
        if running and rng.random() < 0.7:  # a random in-flight group completes
            ready.append(running.pop(rng.randrange(len(running))))
            continue
        split = drain(versions=tuple(ready), trainer_version=trainer_version,
                      max_staleness=bound, batch_size=size)
        counts = counts.add(recycled=len(split.recycle))
        if not split.full:  # regenerated groups start over at the current version
            ready = [ready[i] for i in split.take + split.keep]
            continue
        trained += [trainer_version - ready[i] for i in split.take]
        counts = counts.add(trained=size)
        ready = [ready[i] for i in split.keep]
        if weights_sync_due(trainer_version, interval):
            engine_version = trainer_version + 1
        trainer_version += 1
    assert counts.pending == len(running) + len(ready)
    return dict(staleness=trained, counts=counts)


@given(async_runs())
def test_simulated_fully_async_run_keeps_the_bound_and_counts_every_group(run):
    """The pool trains every step to the end (no deadlock), no trained group exceeds the
    bound, and started = trained + recycled + pending: nothing is silently dropped."""
    out = simulate(**run)
    assert len(out["staleness"]) == run["steps"] * run["size"]
    assert max(out["staleness"]) <= run["bound"]
    c = out["counts"]
    assert c.started == c.trained + c.recycled + c.pending


@given(async_runs())
def test_at_bound_zero_nothing_is_generated_twice(run):
    """With K = 0 and a sync after every step, admission never starts a group that would be
    stale: the run is the synchronous loop, nothing recycled."""
    out = simulate(**{**run, "bound": 0, "interval": 1})
    assert out["counts"].recycled == 0 and set(out["staleness"]) == {0}


def test_a_resume_counts_the_pending_groups_as_recycled():
    """Started 10, trained 8, 2 in flight at the checkpoint: the resumed run continues from
    started 10, trained 8, recycled 2 (they are generated again), pending 0."""
    resumed = PoolCounts(started=10, trained=8).resumed()
    assert resumed == PoolCounts(started=10, trained=8, recycled=2)
    assert resumed.as_record() == {"pool_started": 10, "pool_trained": 8, "pool_recycled": 2,
                                   "pool_filtered": 0, "pool_pending": 0}


counts = st.builds(lambda t, r, f, p: PoolCounts(started=t + r + f + p, trained=t, recycled=r,
                                                 filtered=f),
                   *[st.integers(0, 1000)] * 4)


@given(counts, counts)
def test_counts_survive_a_checkpoint_and_stay_cumulative(before, after):
    """A checkpoint's counts read back exactly; a resumed run's counts added onto them never
    go back, and ``started = trained + recycled + filtered + pending`` still holds."""
    back = PoolCounts.from_state(before.to_state())
    assert back == before
    total = back.resumed().add(started=after.started, trained=after.trained,
                               recycled=after.recycled, filtered=after.filtered)
    for name in ("started", "trained", "recycled", "filtered"):
        assert getattr(total, name) >= getattr(before, name)
    assert total.pending == after.pending
    assert total.started == total.trained + total.recycled + total.filtered + total.pending


@pytest.mark.parametrize("state", [None, {"started": 1}, {"started": 1, "trained": 2,
                                                          "recycled": 0, "filtered": 0},
                                   {"started": 1.0, "trained": 0, "recycled": 0, "filtered": 0}])
def test_a_malformed_checkpoint_count_is_a_typed_error(state):
    with pytest.raises(AsyncPoolError, match="pool_counts"):
        PoolCounts.from_state(state)
