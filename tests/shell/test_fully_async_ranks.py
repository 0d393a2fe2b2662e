"""``--fully-async`` over two engine ranks in one 3-process gloo job (rank 0 trains, ranks 1
and 2 each run an HF engine and a pool; the pools share one queue of draws).

Asserts: with ``--max-weight-staleness 0`` the pools give the synchronous run's batches (same
job, synchronous mode over the same two engine ranks), also with the old static slices and
with a straggler engine rank 1 (late after every sync), whose prompts engine rank 0 takes:
every group trained once, the batches (tokens, rewards, group ids in draw order) the
synchronous ones, engine rank 1 with fewer groups; with ``K = 2`` (blocks of 3 prompts) the
bound holds, the summed counts add up, every batch holds 3 groups from the two parts, and
every sync is checked on a probe from both engine ranks' weights (engine
rank 1 alone dropping its weights is caught, also one step off), and the pools evaluate
together; a run resumed twice never trains a group twice, regenerates what was in
flight and keeps its pool counters cumulative; a failing engine rank 1 stops the trainer with an error naming it (no hang: the job
has a deadline).
"""

from collections import defaultdict

import pytest

from tests.shell.async_workers import (check_pool_counts_are_cumulative,
                                       check_resumed_pool_run, modes_worker)
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, embedded_cache):
    root = tmp_path_factory.mktemp("pool-ranks")
    names = ("sync", "fully_async_k0", "static_k0", "stealing_k0", "fully_async_k2", "resume_first", "resume_middle", "resume_rest",
             "pool_one_prompt", "pool_broken_sync", "broken_sync", "pool_failure",
             "pool_partial")
    overrides = {"sync": {"num_rollout": 2}, "fully_async_k0": {"num_rollout": 2},
                 "static_k0": {"num_rollout": 2}, "stealing_k0": {"num_rollout": 2},
                 # blocks of 3 prompts over two pools
                 "fully_async_k2": {"rollout_batch_size": 3, "global_batch_size": 12,
                                    "num_rollout": 2},
                 "pool_broken_sync": {"num_rollout": 1},
                 "broken_sync": {"num_rollout": 1},
                 "pool_failure": {"num_rollout": 1}}
    # 12 short runs in one job: the deadline catches a hang, sized for a loaded machine
    return spawn(modes_worker, 3, str(root), embedded_cache, names, 2, overrides, timeout=900)


def test_two_pools_at_staleness_0_give_the_synchronous_batches(runs):
    trainer, *engines = runs
    sync = [r["contents"] for r in trainer["sync"]["rollouts"]]
    assert len(sync) == 2
    assert [r["contents"] for r in trainer["fully_async_k0"]["rollouts"]] == sync
    for r in trainer["fully_async_k0"]["rollouts"]:
        m = r["metrics"]
        assert m["staleness_max"] == 0
        assert m["pool_part_engine_rank_0"] + m["pool_part_engine_rank_1"] == 4
    assert all("error" not in e["fully_async_k0"] for e in engines)


def test_static_slices_at_staleness_0_give_the_synchronous_batches(runs):
    """The benchmarks' baseline (``GroupPool.static_slices``): each pool its half of a block."""
    trainer, *engines = runs
    sync = [r["contents"] for r in trainer["sync"]["rollouts"]]
    assert [r["contents"] for r in trainer["static_k0"]["rollouts"]] == sync
    for r in trainer["static_k0"]["rollouts"]:
        m = r["metrics"]
        assert m["pool_part_engine_rank_0"] == m["pool_part_engine_rank_1"] == 2
    assert all("error" not in e["static_k0"] for e in engines)


def test_a_straggler_engine_ranks_prompts_are_taken_and_the_batches_stay_the_same(runs):
    """Work stealing: engine rank 1 is late after every sync, so engine rank 0 takes the
    whole block; every group trains once and the batches are the synchronous ones, in draw
    order, whoever generated them (the counts the run records, never its times)."""
    trainer, *engines = runs
    sync, stolen = trainer["sync"]["rollouts"], trainer["stealing_k0"]["rollouts"]
    assert [r["contents"] for r in stolen] == [r["contents"] for r in sync]
    # Group ids number the pools' draws over the run (the synchronous loop's restart per
    # rollout): the same, in draw order, as the static slices' and the healthy run's.
    for name in ("static_k0", "fully_async_k0"):
        assert [r["group_ids"] for r in stolen] == [r["group_ids"] for r in
                                                    trainer[name]["rollouts"]]
    ids = [g for r in stolen for g in set(r["group_ids"])]
    assert len(ids) == len(set(ids)) == 2 * 4 * 4
    parts = [(r["metrics"]["pool_part_engine_rank_0"], r["metrics"]["pool_part_engine_rank_1"])
             for r in stolen]
    assert all(sum(p) == 4 for p in parts) and parts[1] == (4, 0)
    assert sum(p[1] for p in parts) < sum(p[0] for p in parts)
    for r in stolen:
        m = r["metrics"]
        assert m["staleness_max"] == 0 and m["pool_recycled"] == 0
        assert m["pool_started"] == m["pool_trained"] + m["pool_pending"]
    assert all("error" not in e["stealing_k0"] for e in engines)


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
        # Blocks of 3 prompts: the two parts hold 3 groups, however they are split.
        assert m["pool_part_engine_rank_0"] + m["pool_part_engine_rank_1"] == 3
        assert r["num_samples"] == 3 * 4
    ids = [g for r in rollouts for g in set(r["group_ids"])]  # one per sample: never twice
    assert len(ids) == len(set(ids)) == 2 * 3 * 4
    evals = {r["metrics"]["rollout"]: r["metrics"].get("eval/held/pass@1") for r in rollouts}
    assert evals[1] is None and 0 <= evals[0] <= 1  # --eval-interval 2
    assert all("error" not in e["fully_async_k2"] for e in engines)


def test_one_prompt_per_block_goes_to_one_engine_rank(runs):
    """``B = 1 < N = 2``: one pool takes the prompt, the other answers an empty part; both
    load every sync and answer their probes."""
    trainer, *engines = runs
    rollouts = trainer["pool_one_prompt"]["rollouts"]
    assert [r["metrics"]["rollout"] for r in rollouts] == [0]
    for r in rollouts:
        m = r["metrics"]
        assert sorted((m["pool_part_engine_rank_0"], m["pool_part_engine_rank_1"])) == [0, 1]
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


def test_partial_rollouts_in_two_pools_are_cut_at_syncs_and_mask_their_older_segments(runs):
    """``--fully-async --partial-rollout`` over two engine ranks, ``K = 2``: each sync cuts the
    requests in flight, continued at once on the new weights (one training request per engine
    rank stays in the engine until a sync cuts it, so the run is sure to cut). Every group
    trains once, within the bound; every trained sample's loss mask is 0 exactly on the tokens
    generated under weights older than its group's newest segment (``--mask-offpolicy-in-
    partial-rollout``), and the logged share of such tokens is those zeros."""
    trainer, *engines = runs
    run = trainer["pool_partial"]
    assert "error" not in run and all("error" not in e["pool_partial"] for e in engines)
    rollouts = run["rollouts"]
    assert [r["metrics"]["rollout"] for r in rollouts] == [0, 1, 2, 3]
    ids = [g for r in rollouts for g in set(r["group_ids"])]
    assert len(ids) == len(set(ids))
    assert all(r["metrics"]["staleness_max"] <= 2 for r in rollouts)
    assert rollouts[-1]["metrics"]["partial/cut_requests"] >= 1
    for r in rollouts:
        newest: dict = defaultdict(int)  # per prompt group (all executions of one prompt)
        for group, (_, high) in zip(r["prompt_groups"], r["versions"]):
            newest[group] = max(newest[group], high)
        zeros = tokens = 0
        for group, (_, response, mask), (low, high) in zip(r["prompt_groups"], r["samples"],
                                                            r["versions"]):
            old = (len(mask) if high < newest[group] else
                   0 if low == high else mask.index(1))  # resumed: its older prefix
            assert mask == [0] * old + [1] * (len(mask) - old), (low, high, mask)
            assert low == high or 0 < old < len(mask)
            zeros, tokens = zeros + old, tokens + len(response)
        assert r["metrics"]["partial/offpolicy_token_frac"] == pytest.approx(zeros / tokens)
