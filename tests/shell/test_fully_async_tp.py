"""``--fully-async`` over one engine of 2 ranks (``--rollout-num-gpus-per-engine 2``) in one
4-process gloo job: ranks 0-1 train, ranks 2-3 are one HF engine holding a replica per rank;
the pool runs on the engine's leader and the other rank follows it (claims nothing, answers
empty parts, loads every sync).

Asserts: the pool trains, and with ``--max-weight-staleness 0`` its batches are the
synchronous run's on the same layout (tokens and rewards bit for bit); every group comes
from the leader.
"""

import pytest

from tests.shell.async_workers import modes_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, embedded_cache):
    root = tmp_path_factory.mktemp("pool-tp")
    # 4 ranks: an engine of 2 ranks must divide the ranks per node
    return spawn(modes_worker, 4, str(root), embedded_cache, ("tp2_sync", "tp2_k0"), 2, {},
                 timeout=900)


def test_one_engine_of_two_ranks_runs_the_pool_and_gives_the_synchronous_batches(runs):
    trainer, _, *engines = runs
    sync = [r["contents"] for r in trainer["tp2_sync"]["rollouts"]]
    pool = trainer["tp2_k0"]["rollouts"]
    assert len(sync) == 2 and [r["contents"] for r in pool] == sync
    for r in pool:
        m = r["metrics"]
        assert m["staleness_max"] == 0
        assert (m["pool_part_engine_rank_0"], m["pool_part_engine_rank_1"]) == (4, 0)
    assert all("error" not in e[name] for e in engines for name in ("tp2_sync", "tp2_k0"))
