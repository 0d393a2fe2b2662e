"""Fuzz: the asynchronous-training decisions (``vime_pure.async_pool``) on valid and invalid
inputs (junk types, bools, negatives, versions newer than the trainer). Success gives the
documented values; failure a ``VimeError``."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import REJECTED, outcome
from tests.fuzz.strategies import JUNK, mostly
from vime_pure.async_pool import (admits, check_staleness_bound, drain, enforce_staleness_bound,
                                  generation_lag, weights_sync_due)
from vime_pure.pool_ranks import (admits_live, draw_of, merge_order, merge_resume_states,
                                  pool_share)

INTS = mostly(st.integers(0, 9), st.one_of(st.integers(-3, -1), st.booleans(), JUNK))


@given(INTS, INTS)
def test_weights_sync_due(rid, interval):
    out = outcome("weights_sync_due", weights_sync_due, rid, interval)
    if out is not REJECTED:
        assert out == ((int(rid) + 1) % int(interval) == 0)


@given(mostly(st.sampled_from(["sync", "one_step_off", "fully_async"]), JUNK),
       st.one_of(st.none(), INTS), INTS, INTS)
def test_lag_and_bound(mode, staleness, interval, bound):
    lag = outcome("generation_lag", generation_lag, mode, staleness)
    if lag is not REJECTED:
        assert lag in (0, 1) and (lag == 0 or mode == "one_step_off")
    outcome("check_staleness_bound", check_staleness_bound, max_staleness=bound,
            update_weights_interval=interval)


@given(INTS, INTS, INTS, INTS, INTS, INTS)
def test_admits(sent, start, engine, queued, size, bound):
    out = outcome("admits", admits, batches_sent=sent, start_version=start,
                  engine_version=engine, queued=queued, batch_size=size, max_staleness=bound)
    if out is not REJECTED:
        assert out in (True, False) and (not out or queued < 2 * size)


@given(mostly(st.lists(st.integers(0, 8), max_size=8).map(tuple),
              st.one_of(JUNK, st.lists(st.booleans(), min_size=1).map(tuple))),
       INTS, INTS, INTS)
def test_drain_and_enforce(versions, trainer, bound, size):
    out = outcome("drain", drain, versions=versions, trainer_version=trainer,
                  max_staleness=bound, batch_size=size)
    if out is not REJECTED:
        assert sorted(out.take + out.recycle + out.keep) == list(range(len(versions)))
        kept = np.asarray([versions[i] for i in out.take], dtype=np.int64)
        assert outcome("enforce_staleness_bound", enforce_staleness_bound, kept, trainer,
                       bound) is None


KEYS = mostly(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=8),
              st.one_of(JUNK, st.lists(st.tuples(st.booleans(), st.integers(-2, 2)),
                                       min_size=1)))


@given(INTS, INTS, INTS, KEYS)
def test_pool_shares_and_merge_order(size, pools, pool, keys):
    share = outcome("pool_share", pool_share, size, pools, pool)
    if share is not REJECTED:
        assert all(0 <= i < int(size) for i in share)
    order = outcome("merge_order", merge_order, keys)
    if order is not REJECTED:
        assert [keys[i] for i in order] == sorted(keys)


@given(INTS, INTS, mostly(st.lists(st.integers(0, 5), min_size=1, max_size=4), JUNK),
       INTS, INTS, INTS)
def test_draw_of_and_admits_live(ticket, base, indices, live, sent, size):
    out = outcome("draw_of", draw_of, ticket, base, indices)
    if out is not REJECTED:
        assert out[0] >= int(base) and out[1] in indices
    outcome("admits_live", admits_live, live_before=live, batches_sent=sent, start_version=0,
            engine_version=0, batch_size=size, max_staleness=0)


TRIPLES = mostly(st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=3), max_size=4),
                 JUNK)
STATE = st.fixed_dictionaries({"block": INTS, "starts": TRIPLES, "done": KEYS})


@given(mostly(st.lists(STATE, min_size=1, max_size=3), JUNK), INTS)
def test_merge_resume_states(states, size):
    out = outcome("merge_resume_states", merge_resume_states, states, size)
    if out is not REJECTED:
        assert out["block"] >= max(s["block"] for s in states)
