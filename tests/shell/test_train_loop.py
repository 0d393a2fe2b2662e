"""The ``vime train`` loop end to end: 3 rollouts on the embedded model at world size 1, 2 at
DP=2 and 2 at TP=2 (gloo), plus the multi-turn (compact) rollout.

Asserts the loop's invariants (:mod:`vime_shell.run.driver`): each rank's trainer ran exactly
its micro-batches of the schedule, step by step; the engine-trainer log-prob gap is < 1e-4 on
every rollout (each one sampled right after the previous sync) and the engine holds exactly the
trainer's weights after the last sync; the parameters changed; ``metrics.jsonl`` holds one
complete record per rollout. Multi-turn: siblings share a step, and on a fixed hand-made batch
the reported loss is the hand-computed per-group value.
"""

import json
import math

import numpy as np
import pytest

from tests.shell.loop_workers import loop_worker, world_size_1_worker
from vime_shell.megatron.spawn import spawn
from vime_shell.run.run_log import REQUIRED_KEYS
from vime_shell.sources.replay import dump_path
from vime_shell.storage.dump import load_rollout_batch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # The first worker builds the embedded model here; later ones reuse it.
    return str(tmp_path_factory.mktemp("embedded"))


def _initial_weights(hf_dir: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(f"{hf_dir}/model.safetensors")


@pytest.fixture(scope="module")
def ws1(tmp_path_factory, cache):
    """One process runs the world-size-1 cases in turn (see ``world_size_1_worker``)."""
    from vime_shell.storage.dump import save_rollout_batch

    root = tmp_path_factory.mktemp("ws1")
    batch, per_group = _fixed_multi_turn_batch()
    dump = save_rollout_batch(root / "fixed.npz", batch)
    out = spawn(world_size_1_worker, 1, str(root), cache, str(dump))[0]
    return {"root": root, "batch": batch, "per_group": per_group, **out}


def assert_loop_invariants(per_rank: list[dict], run_dir, dp: int, num_rollout: int) -> None:
    for rank_out in per_rank:
        rollouts = rank_out["rollouts"]
        assert [r["rollout"] for r in rollouts] == list(range(num_rollout))
        for r in rollouts:
            # Schedule honoured: the trainer ran its records' micro-batches, in order, per
            # step, and the records are this rank's share of every step of the schedule.
            first = r["trace"][0][0]  # the trainer numbers steps over the whole run
            ran = [(s - first, ix) for s, ix, _ in r["trace"]]
            planned = [(s, mb) for s, step in enumerate(r["plan"]) for mb in step]
            assert ran == planned
            for s, step in enumerate(r["steps"]):
                assert r["plan"][s] == list(step[r["dp_rank"]])
                assert len(step) == dp and len({len(x) for x in step}) == 1
            assert r["metrics"]["logprob_gap"] < 1e-4
            assert r["metrics"]["num_steps"] == 2 and r["metrics"]["num_groups"] == 16
            # grad_norm is the mean over the rollout's optimizer steps, not the last one's
            norms = r["step_grad_norms"]
            assert len(norms) == 2 and r["metrics"]["grad_norm_max"] == max(norms)
            assert r["metrics"]["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-12)
        initial = _initial_weights(rank_out["hf_dir"])
        final = rollouts[-1]["state"]
        assert max(float(np.abs(final[k] - initial[k]).max()) for k in initial) > 1e-5
    # Rank 0 holds the engine: after the last sync it has exactly the trainer's weights.
    assert per_rank[0]["rollouts"][-1]["engine_vs_trainer"] == 0.0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["rollout"] for x in lines] == list(range(num_rollout))
    for line, seen in zip(lines, per_rank[0]["rollouts"]):
        assert set(REQUIRED_KEYS) <= set(line)
        assert all(isinstance(line[k], (int, float)) and math.isfinite(line[k])
                   for k in REQUIRED_KEYS)
        assert line["num_microbatches"] == sum(len(step[0]) for step in seen["steps"])
    assert (run_dir / "curves.png").stat().st_size > 0
    assert (run_dir / "schedule.png").stat().st_size > 0


def test_three_rollouts_world_size_1(ws1):
    assert_loop_invariants([ws1["single"]], ws1["root"] / "single", dp=1, num_rollout=3)


def test_two_rollouts_dp2_gloo(tmp_path, cache):
    out = spawn(loop_worker, 2, str(tmp_path / "run"), cache,
                {"num_rollout": 2, "balance_data": True})
    assert_loop_invariants(out, tmp_path / "run", dp=2, num_rollout=2)
    # Both ranks saw the same batch and trained disjoint halves of it.
    a, b = (o["rollouts"] for o in out)
    for ra, rb in zip(a, b):
        assert np.array_equal(ra["tokens"], rb["tokens"])
        assert not set(ra["partition"]) & set(rb["partition"])
        assert ra["metrics"]["loss"] == rb["metrics"]["loss"]
    assert np.array_equal(a[-1]["state"]["lm_head.weight"], b[-1]["state"]["lm_head.weight"])


def test_two_rollouts_tp2_gloo_on_the_padded_vocabulary(tmp_path, cache):
    # The embedded model's 20-row vocabulary (19 tokens + 1 reserved row) splits over TP=2.
    out = spawn(loop_worker, 2, str(tmp_path / "run"), cache,
                {"num_rollout": 2, "tensor_model_parallel_size": 2})
    assert_loop_invariants(out, tmp_path / "run", dp=1, num_rollout=2)
    a, b = (o["rollouts"] for o in out)
    assert [r["metrics"]["loss"] for r in a] == [r["metrics"]["loss"] for r in b]
    assert a[-1]["state"]["lm_head.weight"].shape[0] == 20
    assert all(np.array_equal(a[-1]["state"][k], b[-1]["state"][k]) for k in a[-1]["state"])


def test_multi_turn_siblings_share_a_step(ws1):
    for r in ws1["multi_turn"]["rollouts"]:
        groups = r["group_ids"]
        assert len(groups) == 2 * 16 and len(set(groups)) == 16  # 2 siblings per execution
        step_of = {i: s for s, step in enumerate(r["steps"]) for mbs in step for mb in mbs
                   for i in mb}
        for g in set(groups):
            assert len({step_of[i] for i, x in enumerate(groups) if x == g}) == 1
        assert r["metrics"]["logprob_gap"] < 1e-4


def _fixed_multi_turn_batch():
    """4 executions of 2 prompts, 2-3 siblings of different lengths and masks each, and chosen
    per-group advantages (so token-, sample- and group-weighted means all differ)."""
    import attrs

    from vime_pure.data.batch import RolloutBatch
    from vime_pure.data.sample import Sample

    def s(prompt, response, group, mask=None):
        return Sample(tokens=prompt + response, response_length=len(response), group_id=group,
                      loss_mask=mask, reward=0.0, rollout_log_probs=[-1.0] * len(response))

    # Sparse string group ids: replay must keep them as they are.
    a, b, c, d = "exec-9", "exec-2", "exec-7", "exec-4"
    output = [[[s([4, 5, 6], [7, 8], a), s([7, 8, 6], [5], a)],
               [s([4, 5, 6], [9, 9], b), s([9, 9, 6], [4, 4], b, mask=[1, 0])]],
              [[s([5, 5, 6], [5], c), s([5, 6], [5, 5], c)],
               [s([5, 5, 6], [3, 3], d), s([3, 3, 6], [6, 7], d), s([6, 7, 6], [4], d)]]]
    batch = RolloutBatch.from_samples(output)
    per_group = np.array([0.25, -0.5, 0.0, 3.0])
    return attrs.evolve(batch, advantages=per_group[batch.group_ids]), per_group


def test_fixed_batch_loss_is_the_per_group_value(ws1):
    batch, per_group = ws1["batch"], ws1["per_group"]
    (r,) = ws1["fixed"]["rollouts"]
    # One step at ratio 1 (old log-probs = current): the clipped surrogate is -A per token;
    # group_token_mean averages tokens within a group, then groups: -mean_g(A_g).
    expected = -per_group.mean()
    assert r["metrics"]["num_steps"] == 1
    assert r["metrics"]["loss"] == pytest.approx(expected, abs=1e-6)
    # Per-token or per-sample averaging would give a different number on this batch.
    masks = [float(batch.sample_loss_mask(i).sum()) for i in range(batch.num_samples)]
    token_mean = -sum(m * a for m, a in zip(masks, batch.advantages)) / sum(masks)
    sample_mean = -float(np.mean(batch.advantages))
    assert abs(token_mean - expected) > 0.1 and abs(sample_mean - expected) > 0.1
    assert r["group_ids"] == batch.original_group_ids()


@pytest.fixture(scope="module")
def real_jobs(tmp_path_factory, cache):
    from tests.shell.loop_workers import real_jobs_worker

    return spawn(real_jobs_worker, 1, str(tmp_path_factory.mktemp("real")), cache)[0]


def test_kl_is_zero_at_the_first_step_and_the_reference_never_moves(real_jobs):
    first, second = real_jobs["kl_records"]
    assert first["kl"] == 0.0  # the policy is the reference before its first update
    assert second["kl"] > 0.0
    initial = _initial_weights(real_jobs["hf_dir"])
    assert max(float(np.abs(real_jobs["reference"][k] - initial[k]).max()) for k in initial) == 0
    assert max(float(np.abs(real_jobs["policy"][k] - initial[k]).max()) for k in initial) > 1e-5


def test_dynamic_sampling_varies_the_batch_and_keeps_the_per_group_loss(real_jobs):
    runs = real_jobs["math"]
    for r in runs:
        m = r["metrics"]
        kept, generated = m["prompts_kept"], m["prompts_generated"]
        assert 1 <= kept <= 4 and m["prompts_filtered"] + kept <= generated
        assert r["num_groups"] == kept * 4 == sum(r["schedule_groups"])
        # One on-policy step (ratio 1): group_token_mean gives -mean over groups of A_g.
        _, first = np.unique(r["group_ids"], return_index=True)
        assert m["loss"] == pytest.approx(-r["advantages"][first].mean(), abs=1e-5)
    assert sum(r["metrics"]["prompts_filtered"] for r in runs) > 0


def test_eval_metrics_appear_at_the_interval_and_after_the_last_rollout(real_jobs):
    lines = [json.loads(x) for x in real_jobs["math_lines"]]
    with_eval = [x["rollout"] for x in lines if "eval/arith/reward_mean" in x]
    assert with_eval == [0, 2, 3] and lines[-1]["eval_only"] is True
    for x in lines:
        if "eval/arith/reward_mean" in x:
            assert 0.0 <= x["eval/arith/pass@1"] <= x["eval/arith/pass@2"] <= 1.0


def test_the_checkpoint_holds_the_prompt_position(real_jobs):
    state = real_jobs["loop_state"]
    generated = sum(r["metrics"]["prompts_generated"] for r in real_jobs["math"])
    assert state["data"]["offset"] == generated and state["data"]["draws"] >= 3


def test_a_broken_sync_is_caught_before_any_update(tmp_path, cache):
    """The gap check reuses the first step's training forward (no separate pass) and still
    stops the run on stale engine weights, before the optimizer step."""
    from tests.shell.loop_workers import broken_sync_worker

    out = spawn(broken_sync_worker, 1, str(tmp_path), cache)[0]
    assert out["error"] is not None and out["error"].startswith("rollout 1: mean engine-trainer")
    assert out["steps_after_rollout_0"] == out["steps_done"] == 1


def test_engines_on_every_rank_give_the_one_engine_batch_and_fail_together(tmp_path, cache):
    """Two engines (one per rank) and one engine on rank 0 generate the same batches, filter
    verdicts and eval metrics (request seeds and group ids come from global prompt indices),
    and the filter judging each group on the engine that holds it (only verdicts travel)
    gives the batches and counts of rank 0 judging the whole batch (``--save-rollout-data``);
    when the second engine fails, in generation or in evaluation, every rank stops with an
    error naming it (none hangs)."""
    from tests.shell.loop_workers import engine_layouts_worker

    out = spawn(engine_layouts_worker, 2, str(tmp_path), cache)
    for rank, o in enumerate(out):
        assert all(r["has_engine"] for r in o["two_engines"]["rollouts"])
        assert [r["has_engine"] for r in o["one_engine"]["rollouts"]] == [rank == 0] * 2
    two, one = out[0]["two_engines"]["rollouts"], out[0]["one_engine"]["rollouts"]
    whole = out[0]["whole"]["rollouts"]
    for a, b in [*zip(two, one, strict=True), *zip(two, whole, strict=True)]:
        # Exact although the engines batched other prompts together (chunks of a 2-engine
        # queue): tokens and rewards do not follow batch composition (tests.metric_keys), and
        # the loss is the trainer's, same layout and machine, from its own log-probs (no TIS).
        # The engine-log-prob keys (logprob_gap, mismatch_*) would differ: not compared.
        assert np.array_equal(a["tokens"], b["tokens"])
        assert np.array_equal(a["rewards"], b["rewards"])
        keys = ("prompts_generated", "prompts_kept", "prompts_filtered", "generation_rounds",
                "filtered_reward_mean", "eval/held_out/reward_mean", "eval/held_out/pass@1",
                "loss")
        assert [a["metrics"].get(k) for k in keys] == [b["metrics"].get(k) for k in keys]
    assert all(r["metrics"]["prompts_generated"] >= 6 for r in two)  # over-sampled rounds ran
    # Each engine leader dumped its part beside rank 0's index; joined, each is the batch.
    for rid, trained in enumerate(two):
        index = dump_path(out[0]["dumps"], rid)
        batch = load_rollout_batch(index)
        assert np.array_equal(batch.tokens, trained["tokens"])
        assert np.array_equal(batch.rewards, trained["rewards"])
        assert np.array_equal(batch.advantages, trained["advantages"])
        assert batch.original_group_ids() == trained["group_ids"]
        # which engine claimed which chunks is the queue's business: rank 0 alone writes
        # the batch, otherwise each holder its part beside the index
        parts = {p.name for p in index.parent.glob(f"r{rid}.rank*.npz")}
        assert parts <= {f"r{rid}.rank0.npz", f"r{rid}.rank1.npz"}
        assert parts != {f"r{rid}.rank0.npz"}
    for failure in ("failure", "eval_failure"):  # generation, then evaluation
        # Rank 1's rollout function raised: a PluginError naming it (the RuntimeError chained).
        assert {o[failure][0] for o in out} == {"EngineGroupError", "PluginError"}, out
        assert "engine 1 (rank 1)" in out[0][failure][1]
        assert "is down" in out[1][failure][1]
