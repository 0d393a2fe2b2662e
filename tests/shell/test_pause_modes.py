"""``--pause-generation-mode`` in the fully-async pool (2 ranks: a trainer, an engine rank):
``in_place`` and ``retract`` train with the staleness bound acting per token (the record's
``token_staleness/<s>`` never past ``K``); ``abort`` ends the request a sync meets (held in the
engine until then, ``agentic_workers.holding_generate``) and its group is generated again
(recycled, counted) and trained once."""

import pytest

from tests.shell.async_workers import modes_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow

NAMES = ("pause_in_place", "pause_retract", "pause_abort")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, embedded_cache):
    root = tmp_path_factory.mktemp("pause")
    trainer, engine = spawn(modes_worker, 2, str(root), embedded_cache, NAMES, timeout=600)
    return trainer, engine


@pytest.mark.parametrize("name", ["pause_in_place", "pause_retract"])
def test_in_flight_policies_train_with_the_bound_per_token(runs, name):
    trainer, engine = runs
    assert "error" not in trainer[name] and "error" not in engine[name]
    rollouts = trainer[name]["rollouts"]
    assert len(rollouts) == 3
    for r in rollouts:
        m = r["metrics"]
        shares = {k: v for k, v in m.items() if k.startswith("token_staleness/")}
        assert shares and sum(shares.values()) == pytest.approx(1.0)
        assert m["token_staleness_max"] <= 1  # K: staler tokens are masked, never trained
        assert max(int(k.split("/")[1]) for k in shares) <= 1
        assert m["staleness_max"] <= 1
        assert isinstance(m["stale_tokens_masked"], int)


def test_an_abort_policy_generates_the_cut_group_again_and_trains_it_once(runs):
    trainer, engine = runs
    assert "error" not in trainer["pause_abort"] and "error" not in engine["pause_abort"]
    rollouts = trainer["pause_abort"]["rollouts"]
    assert len(rollouts) == 4
    last = rollouts[-1]["metrics"]
    assert last["paused_requests"] >= 1  # the held request met a sync
    assert last["pool_recycled"] >= 1  # and its group was generated again
    trained = [g for r in rollouts for g in r["group_ids"]]
    assert len(trained) == len(set(trained))  # no group trained twice
    for r in rollouts:  # every sample of an aborted request was dropped with its group
        assert "token_staleness_max" not in r["metrics"]  # abort: one version per request
