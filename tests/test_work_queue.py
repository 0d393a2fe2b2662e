"""The engines' work queue on one in-process store (``torch.distributed.HashStore``): the claim
protocol without processes or timing.

Named examples: interleaved leaders partition the prompts into the core's chunks; a TP peer
reads exactly its leader's claims; a failing engine pushes the counter past the end (the other
engine's next claim is the end) and tells its peers to stop; a finished round's keys are
deleted (by an engine group, ``KEPT_ROUNDS`` rounds later). The multi-process runs are in ``tests/shell/test_engine_group.py``.
"""

from datetime import timedelta

import torch.distributed as dist

from vime_pure.data.work_queue import queue_chunk_size
from vime_shell.engines import group as group_module
from vime_shell.engines.group import EngineGroup, EngineOptions
from vime_shell.engines.layout import EngineLayout
from vime_shell.engines.work_queue import KEPT_ROUNDS, PromptQueue, forget_round

ROUND = "vime/queue/0/0"


def _queue(store, engine: int, *, leader: bool = True, peers: bool = False, prompts: int = 10,
           engines: int = 2) -> PromptQueue:
    return PromptQueue(store, ROUND, engine=engine, leader=leader, peers=peers,
                       num_prompts=prompts, num_engines=engines)


def test_interleaved_leaders_partition_the_prompts_into_chunks():
    store = dist.HashStore()
    a, b = iter(_queue(store, 0)), iter(_queue(store, 1))
    assert queue_chunk_size(10, 2) == 2
    got = [("a", next(a)), ("b", next(b)), ("a", next(a)), ("a", next(a)), ("b", next(b))]
    assert [r for _, r in got] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8),
                                   range(8, 10)]
    assert list(a) == [] and list(b) == []  # both see the end


def test_a_peer_generates_its_leaders_chunks_and_stops_at_the_end():
    store = dist.HashStore()
    leader = list(_queue(store, 1, peers=True, prompts=5, engines=1))
    peer = list(_queue(store, 1, leader=False, peers=True, prompts=5, engines=1))
    assert leader == peer == [range(0, 2), range(2, 4), range(4, 5)]


def test_a_failure_stops_the_other_engines_claims_and_the_failed_leaders_peers():
    store = dist.HashStore()
    healthy = iter(_queue(store, 0))
    failing = _queue(store, 1, peers=True)
    claims = iter(failing)
    assert next(healthy) == range(0, 2) and next(claims) == range(2, 4)
    failing.abort()  # engine 1's leader failed generating prompts 2-3
    assert list(healthy) == []  # engine 0's next claim is past the end
    peer = _queue(store, 1, leader=False, peers=True)
    assert list(peer) == [range(2, 4)]  # it read the leader's claim, then "abort"


def test_a_finished_rounds_keys_are_deleted():
    store = dist.HashStore()
    assert list(_queue(store, 0, peers=True, prompts=2, engines=1)) == [range(0, 1),
                                                                         range(1, 2)]
    keys = [f"{ROUND}/next", *(f"{ROUND}/e0/{j}" for j in range(3))]  # 2 claims, the end
    assert store.check(keys)
    forget_round(store, ROUND, engine=0, leader=True, first_rank=True, published=2)
    assert not any(store.check([k]) for k in keys)
    store.wait([], timedelta(seconds=1))  # the store still serves


def test_an_engine_group_forgets_a_round_kept_rounds_later(monkeypatch):
    """Round r's keys (the counter, the leader's claims) go when round r + KEPT_ROUNDS starts."""
    store = dist.HashStore()
    monkeypatch.setattr(group_module, "job_store", lambda: store)
    group = EngineGroup(EngineLayout(world_size=4, num_engines=2, gpus_per_engine=2), 0, None,
                        EngineOptions())
    first, _ = group._next_round(3)  # noqa: SLF001 - the round bookkeeping under test
    prefix = f"{group._prefix}/{first}"  # noqa: SLF001
    assert list(PromptQueue(store, prefix, engine=0, leader=True, peers=True, num_prompts=3,
                            num_engines=2)) == [range(0, 1), range(1, 2), range(2, 3)]
    group._queued[first] = 3  # noqa: SLF001 - what _generate records for a queued round
    for _ in range(KEPT_ROUNDS - 1):
        group._next_round(3)  # noqa: SLF001
    assert store.check([f"{prefix}/next", f"{prefix}/e0/3"])
    group._next_round(3)  # noqa: SLF001 - round KEPT_ROUNDS: round 0 is forgotten
    assert not any(store.check([f"{prefix}/{k}"]) for k in ("next", "e0/0", "e0/3"))
