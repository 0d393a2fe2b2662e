"""``--fully-async`` over two engine ranks in one 3-process gloo job (rank 0 trains, ranks 1
and 2 each run an HF engine and a pool over their slice of every prompt block).

Asserts: with ``--max-weight-staleness 0`` the pools give the synchronous run's batches (same
job, synchronous mode over the same two engine ranks); with ``K = 2`` (blocks of 3 prompts,
split 2 + 1) the bound holds, the summed counts add up, both engine ranks' groups are in
every batch and every sync is checked on a probe from both engine ranks' weights (engine
rank 1 alone dropping its weights is caught, also one step off), and the pools evaluate
together; a run resumed twice never trains a group twice, regenerates what was in
flight and keeps its pool counters cumulative; a failing engine rank 1 stops the trainer with an error naming it (no hang: the job
has a deadline).
"""

import pytest

from tests.shell.async_workers import (check_pool_counts_are_cumulative,
                                       check_resumed_pool_run, modes_worker)
from vime_shell.megatron.spawn import spawn
from vime_shell.models.embedded import build_embedded

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("embedded")
    build_embedded(cache)
    root = tmp_path_factory.mktemp("pool-ranks")
    names = ("sync", "fully_async_k0", "fully_async_k2", "resume_first", "resume_middle", "resume_rest",
             "pool_one_prompt", "pool_broken_sync", "broken_sync", "pool_failure")
    overrides = {"sync": {"num_rollout": 2}, "fully_async_k0": {"num_rollout": 2},
                 # blocks of 3 prompts: engine rank 0 owns prompts 0-1, engine rank 1 prompt 2
                 "fully_async_k2": {"rollout_batch_size": 3, "global_batch_size": 12,
                                    "num_rollout": 2},
                 "pool_broken_sync": {"num_rollout": 1},
                 "broken_sync": {"num_rollout": 1},
                 "pool_failure": {"num_rollout": 1}}
    # 10 short runs in one job: the deadline catches a hang, sized for a loaded machine
    return spawn(modes_worker, 3, str(root), str(cache), names, 2, overrides, timeout=900)


def test_two_pools_at_staleness_0_give_the_synchronous_batches(runs):
    trainer, *engines = runs
    sync = [r["contents"] for r in trainer["sync"]["rollouts"]]
    assert len(sync) == 2
    assert [r["contents"] for r in trainer["fully_async_k0"]["rollouts"]] == sync
    for r in trainer["fully_async_k0"]["rollouts"]:
        m = r["metrics"]
        assert m["staleness_max"] == 0
        assert m["pool_part_engine_rank_0"] == m["pool_part_engine_rank_1"] == 2
    assert all("error" not in e["fully_async_k0"] for e in engines)


def test_two_pools_keep_the_bound_count_every_group_and_probe_both_engines(runs):
    trainer, *engines = runs
    rollouts = trainer["fully_async_k2"]["rollouts"]
    assert [r["metrics"]["rollout"] for r in rollouts] == [0, 1]
    for r in rollouts:
        m = r["metrics"]
        assert m["staleness_max"] <= 2
        assert m["probe_gap"] < 1e-4  # the probe batch holds both engine ranks' groups
        assert m["pool_started"] == (m["pool_trained"] + m["pool_recycled"]
                                     + m["pool_filtered"] + m["pool_pending"])
        # Blocks of 3 prompts: engine rank 0 owns prompts 0-1, engine rank 1 prompt 2.
        assert (m["pool_part_engine_rank_0"], m["pool_part_engine_rank_1"]) == (2, 1)
        assert r["num_samples"] == 3 * 4
    ids = [g for r in rollouts for g in set(r["group_ids"])]  # one per sample: never twice
    assert len(ids) == len(set(ids)) == 2 * 3 * 4
    evals = {r["metrics"]["rollout"]: r["metrics"].get("eval/held/pass@1") for r in rollouts}
    assert evals[1] is None and 0 <= evals[0] <= 1  # --eval-interval 2
    assert all("error" not in e["fully_async_k2"] for e in engines)


def test_one_prompt_per_block_leaves_engine_rank_1_without_groups(runs):
    """``B = 1 < N = 2``: engine rank 1's pool owns no prompt and answers empty parts; it
    still loads every sync and answers its probe."""
    trainer, *engines = runs
    rollouts = trainer["pool_one_prompt"]["rollouts"]
    assert [r["metrics"]["rollout"] for r in rollouts] == [0]
    for r in rollouts:
        m = r["metrics"]
        assert (m["pool_part_engine_rank_0"], m["pool_part_engine_rank_1"]) == (1, 0)
        assert r["num_samples"] == 4 and m["staleness_max"] <= 1 and m["probe_gap"] < 1e-4
        assert m["pool_started"] == (m["pool_trained"] + m["pool_recycled"]
                                     + m["pool_filtered"] + m["pool_pending"])
    assert all("error" not in e["pool_one_prompt"] for e in engines)


def test_a_resumed_run_over_two_pools_never_trains_a_group_twice(runs):
    """The checkpoint holds the two pools' resume points merged into one."""
    trainer, _, _ = runs
    check_resumed_pool_run(trainer)


def test_pool_counters_over_two_pools_are_cumulative_across_two_resumes(runs):
    """The checkpoint keeps the two pools' summed counts; the resumed runs add theirs."""
    trainer, _, _ = runs
    check_pool_counts_are_cumulative(trainer)


def test_a_failing_engine_rank_1_stops_the_trainer_with_its_name(runs):
    trainer, healthy, failing = runs
    kind, message = trainer["pool_failure"]["error"]
    assert kind == "EngineGroupError"
    assert "engine rank 1 (global rank 2)" in message and "engine is down" in message
    assert "engine rank 0" not in message
    assert failing["pool_failure"]["error"][0] == "PluginError"
    assert "error" not in healthy["pool_failure"]  # it stopped cleanly when told


@pytest.mark.parametrize("name", ["pool_broken_sync", "broken_sync"])
def test_a_broken_sync_on_engine_rank_1_alone_is_caught_by_the_probe(runs, name):
    """The probe batch holds every engine rank's probe: engine rank 1 dropping its weights
    (engine rank 0 loads them) fails the first sync's check, fully async and one step off."""
    trainer, *engines = runs
    kind, message = trainer[name]["error"]
    assert kind == "WeightSyncError" and "on the probe" in message
    assert all("error" not in e[name] for e in engines)
