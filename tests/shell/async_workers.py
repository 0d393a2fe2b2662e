"""Process bodies for the separate-rollout-ranks tests (importable, so ``spawn`` runs them).

``modes_worker`` runs, in one 2-rank job (rank 0 trains, rank 1 runs the engine), several
short trainings in turn on ``TINY`` (see ``loop_workers``) and returns, from the trainer, each
rollout's batch contents and metrics; the engine rank returns what it raised, if anything.
"""

import os
import signal
import time
from pathlib import Path

import numpy as np

from tests.shell.agentic_workers import _responses
from tests.shell.loop_workers import TINY

SEPARATE = dict(rollout_num_gpus=1, colocate=False, num_rollout=3)
PARTIAL = dict(partial_rollout=True, mask_offpolicy_in_partial_rollout=True,
               over_sampling_batch_size=6, rollout_max_response_len=4,
               custom_generate_function_path="tests.shell.agentic_workers:slow_generate")
# --custom-generate-function-path: a multi-turn per-sample function (one token per turn, a
# long tail of slow groups), synchronous and in the fully-async pool.
AGENTIC = dict(custom_generate_function_path="tests.shell.agentic_workers:slow_generate",
               rollout_max_response_len=4, num_rollout=2)
RUNS = {
    "sync": {},
    "agentic_sync": AGENTIC,
    "agentic_k0": dict(AGENTIC, fully_async=True, max_weight_staleness=0),
    "agentic_k2": dict(AGENTIC, fully_async=True, max_weight_staleness=2),
    "one_step_off_k0": dict(train_async=True, max_weight_staleness=0),
    "fully_async_k0": dict(fully_async=True, max_weight_staleness=0),
    "one_step_off": dict(train_async=True),
    "fully_async_k2": dict(fully_async=True, max_weight_staleness=2),
    # Work stealing at K = 0 with a straggler: engine rank 1's pool is late after every sync
    # (it looks for work only once engine rank 0 generated every prompt of the block).
    "stealing_k0": dict(fully_async=True, max_weight_staleness=0,
                        rollout_function_path="tests.shell.async_workers:marking_rollout"),
    # One engine of 2 ranks (each holding a replica: the HF engine), synchronous and with the
    # pool on its leader, the other rank following it.
    "tp2_sync": dict(rollout_num_gpus_per_engine=2, num_rollout=2),
    "tp2_k0": dict(fully_async=True, max_weight_staleness=0, rollout_num_gpus_per_engine=2,
                   num_rollout=2),
    # The same with the old static slices (GroupPool.static_slices: the benchmarks' baseline).
    "static_k0": dict(fully_async=True, max_weight_staleness=0),
    # A fully-async run checkpointed after every rollout (groups still in flight there) that
    # dies while rollout 2 trains (its hook raises before that rollout's checkpoint), resumed
    # from rollout 2 and dying the same way in rollout 3, then resumed again up to rollout 4.
    "resume_first": dict(fully_async=True, max_weight_staleness=2, num_rollout=4,
                         save_interval=1),
    "resume_middle": dict(fully_async=True, max_weight_staleness=2, num_rollout=4,
                          save_interval=1),
    "resume_rest": dict(fully_async=True, max_weight_staleness=2, num_rollout=4),
    # The pool of the job's last engine rank fails (the others' rollout function works), or
    # drops its weights (the others load theirs).
    "pool_failure": dict(fully_async=True, max_weight_staleness=2),
    # Its reward varies within every group, so the first step moves the weights whichever
    # groups the shared queue put in the batch (else a dropped sync could go unseen).
    "pool_broken_sync": dict(fully_async=True, max_weight_staleness=2,
                             custom_rm_path="tests.shell.async_workers:alternating_reward"),
    # One prompt per block: with 2 engine ranks, the second one's pool owns none.
    "pool_one_prompt": dict(fully_async=True, max_weight_staleness=1, rollout_batch_size=1,
                            global_batch_size=4, num_rollout=1),
    # --partial-rollout with engines on a rank of their own (synchronous): groups cut at the
    # end of a rollout resume in the next one, also across a checkpoint.
    "partial_first": dict(PARTIAL, num_rollout=2, save_interval=2),
    "partial_rest": dict(PARTIAL, num_rollout=3),
    # ... one step off (a carried group trains one version later than its batch: K = 2).
    "one_step_off_partial": dict(PARTIAL, train_async=True, max_weight_staleness=2,
                                 num_rollout=3),
    # ... and resumed once more without --partial-rollout: the buffered groups' prompts are
    # generated again from scratch in rollout 3.
    "partial_plain": dict(custom_generate_function_path=PARTIAL["custom_generate_function_path"],
                          rollout_max_response_len=4, num_rollout=4),
    # --partial-rollout in the pools: every sync cuts the requests in flight (one per engine
    # rank is held in the engine until a sync cuts it), continued at once on the new weights.
    "pool_partial": dict(fully_async=True, max_weight_staleness=2, partial_rollout=True,
                         mask_offpolicy_in_partial_rollout=True, rollout_max_response_len=4,
                         num_rollout=4, custom_generate_function_path="tests.shell."
                                                                      "agentic_workers:"
                                                                      "holding_generate"),
    # --pause-generation-mode in the pools: in place and retracted requests continue across a
    # sync with per-token versions; abort ends the request held in the engine at a sync, and
    # its group is generated again.
    "pause_in_place": dict(fully_async=True, max_weight_staleness=1),
    "pause_retract": dict(fully_async=True, max_weight_staleness=1,
                          pause_generation_mode="retract"),
    "pause_abort": dict(AGENTIC, fully_async=True, max_weight_staleness=2, num_rollout=4,
                        pause_generation_mode="abort",
                        custom_generate_function_path="tests.shell.agentic_workers:"
                                                      "holding_generate"),
    # slime's first asynchronous job: math GRPO, the math-verify reward on the pool's threads.
    "math_pool": dict(fully_async=True, max_weight_staleness=1, rm_type="math",
                      custom_rm_path=None),
    # A reward and a generate function that never return, under the fully-async pool (its
    # threads, the front's event loop): the job stops at --reward-timeout / --generate-timeout.
    "reward_timeout_pool": dict(fully_async=True, reward_timeout=0.5,
                                custom_rm_path="tests.shell.async_workers:sleeping_reward"),
    "generate_timeout_pool": dict(AGENTIC, fully_async=True, generate_timeout=0.5,
                                  custom_generate_function_path="tests.shell.async_workers:"
                                                                "loop_blocking_generate"),
}


def alternating_reward(sample) -> float:
    """1 for every other sample of a group: every group has a non-zero advantage."""
    return float(sample.index % 2)


def sleeping_reward(sample) -> float:
    """A reward whose grader never answers."""
    time.sleep(3600)
    return 0.0


async def loop_blocking_generate(args, sample, sampling_params):
    """A generate function that blocks the event loop it runs on (a blocking call in the
    coroutine) for its first execution; the others would finish."""
    if sample.index == 0:
        time.sleep(3600)
    from vime_shell.rollout.functions import generate

    return await generate(args, sample, sampling_params)


def batch_contents(batch) -> list:
    """The batch as a multiset of (tokens, reward) per sample, order-free. Compared exactly
    across modes: tokens and rewards do not depend on how the pool batched the requests
    (``tests.metric_keys``), the engine's log-probs do (float noise), so they are left out."""
    offsets = np.asarray(batch.token_offsets)
    tokens = np.asarray(batch.tokens)
    rows = [(tuple(tokens[offsets[i]:offsets[i + 1]].tolist()), float(batch.rewards[i]))
            for i in range(len(batch.lengths))]
    return sorted(rows)


def check_resumed_pool_run(trainer: dict) -> None:
    """``resume_first``, ``resume_middle`` then ``resume_rest`` (see ``RUNS``): 4 rollouts in
    all, no group trained twice, and the groups pending at each checkpoint (in flight or
    waiting; how many depends on timing, so possibly none) are counted as recycled by the run
    resumed from it: they are generated again, never lost."""
    for name in ("resume_first", "resume_middle"):
        assert trainer[name]["error"] == ("RuntimeError", "killed after the checkpoint")
    first, middle, rest = (trainer[f"resume_{n}"]["rollouts"]
                           for n in ("first", "middle", "rest"))
    assert [r["metrics"]["rollout"] for r in first + middle + rest] == [0, 1, 2, 3]
    # Group ids number the pool's draws (block, prompt, sample): each trains at most once.
    ids = [g for r in first + middle + rest for g in set(r["group_ids"])]
    assert len(ids) == len(set(ids)) == 4 * 16
    for before, after in ((first, middle), (middle, rest)):
        at_checkpoint, resumed = before[-1]["metrics"], after[0]["metrics"]
        assert resumed["pool_recycled"] >= (at_checkpoint["pool_recycled"]
                                            + at_checkpoint["pool_pending"])


def check_pool_counts_are_cumulative(trainer: dict) -> None:
    """Over ``resume_first``, ``resume_middle`` and ``resume_rest``: ``pool_trained`` is every
    prompt group trained so far, both resumes included (the checkpoint keeps the counts); the
    counters never go back; ``pool_pending`` (a gauge) closes ``started = trained + recycled +
    filtered + pending`` at every rollout (a resume counts the groups pending at its
    checkpoint as recycled: they are generated again)."""
    records = [r["metrics"] for n in ("first", "middle", "rest")
               for r in trainer[f"resume_{n}"]["rollouts"]]
    assert [m["rollout"] for m in records] == [0, 1, 2, 3]
    kept = np.cumsum([m["prompts_kept"] for m in records]).tolist()
    assert [m["pool_trained"] for m in records] == kept
    for key in ("pool_started", "pool_recycled", "pool_filtered"):
        values = [m[key] for m in records]
        assert values == sorted(values), (key, values)
    for m in records:
        assert m["pool_started"] == (m["pool_trained"] + m["pool_recycled"]
                                     + m["pool_filtered"] + m["pool_pending"])


def always_failing_rollout(ctx):
    """A rollout function whose engine is down."""
    raise RuntimeError("engine is down")


def last_rank_failing_rollout(ctx):
    """The default rollout function, except on the job's last rank (engine rank 1 of 2),
    whose engine is down."""
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        raise RuntimeError("engine is down")
    from vime_shell.rollout.functions import single_turn_rollout

    return single_turn_rollout(ctx)


MARKS = "VIME_TEST_MARKS"  # where engine rank 0 marks the prompts it generated


def marking_rollout(ctx):
    """The default rollout function; engine rank 0 of 2 also marks each prompt it generated
    (``rollout-prompt`` files under ``$VIME_TEST_MARKS``) for the straggler below."""
    from vime_shell.rollout.functions import single_turn_rollout

    out = single_turn_rollout(ctx)
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 2:
        Path(os.environ[MARKS], f"{ctx.rollout_id}-{ctx.prompt_offset}").touch()
    return out


def _late_admit(admit, block_size: int):
    """Engine rank 1's pool as a straggler that is late after every sync: it looks for work
    only once engine rank 0 has generated every prompt of the block the new weights serve
    (``K = 0``: block ``version``), so it finds nothing of it left to claim. Its loop still
    takes every command (a rank late inside a bridge collective would hold every rank).
    Deterministic: no timing decides who takes what."""
    def late(self):
        marks = [Path(os.environ[MARKS], f"{self.version}-{i}") for i in range(block_size)]
        if self.version == 0 or all(m.exists() for m in marks):
            admit(self)

    return late


def _ignore_weights(self, named, version=None):
    """A broken engine-side sync: the buckets arrive and are thrown away."""
    for _ in named:
        pass


def modes_worker(rank: int, root: str, cache: str, runs: tuple[str, ...],
                 engine_ranks: int = 1, overrides: dict | None = None) -> dict:
    """Each named run in turn (``fully_async_k2`` also evaluates); ``failure``: the engine's rollout function raises;
    ``broken_sync``: one step off with an engine rank that drops the weights it receives;
    ``hook_failure``: the trainer fails while the engine still owes it a rollout.
    ``pool_failure``: fully async, the last engine rank's rollout function raises;
    ``pool_broken_sync``: fully async, the last engine rank drops the weights it receives;
    ``engine_ranks``: the job's last ``engine_ranks`` ranks run engines; ``overrides``: more
    settings per run name."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.engines.group import EngineGroup
    from vime_shell.settings.train_config import TrainConfig
    from vime_shell.sources.pool import GroupPool
    from vime_shell.run.driver import run_training

    out: dict = {"root": Path(root)}
    loads_weights = EngineGroup.sync_weights
    admit = GroupPool._admit
    for name in runs:
        seen: list = []
        extra = RUNS.get(name, dict(train_async=True))
        if name in ("failure", "pool_failure"):
            failing = "always" if name == "failure" else "last_rank"
            extra = {**extra, "rollout_function_path":
                     f"tests.shell.async_workers:{failing}_failing_rollout"}
        extra = {**extra, **(overrides or {}).get(name, {})}
        if name == "hook_failure":  # the trainer fails while rollout 1 is being generated
            extra = dict(train_async=True, update_weights_interval=2, max_weight_staleness=2)
        last = rank == int(os.environ["WORLD_SIZE"]) - 1  # the last engine rank
        EngineGroup.sync_weights = (_ignore_weights if last and name.endswith("broken_sync")
                                    else loads_weights)
        GroupPool.static_slices = name == "static_k0"
        GroupPool._admit = admit
        if name == "stealing_k0":
            os.environ[MARKS] = str(Path(root, f"{name}-marks"))
            Path(os.environ[MARKS]).mkdir(exist_ok=True)
            if last:
                GroupPool._admit = _late_admit(admit, {**TINY, **extra}["rollout_batch_size"])
        if name in ("one_step_off_k0", "fully_async_k0"):  # dumps carry the engines' annotations
            extra = {**extra, "save_rollout_data": f"{root}/{name}-dumps/r{{rollout_id}}.npz"}
        if name in ("fully_async_k2", "agentic_k2"):  # evaluation runs in the pool too
            from vime_shell.rollout.tasks import arithmetic_rows, write_jsonl

            held_out = write_jsonl(Path(root) / f"eval-rank{rank}.jsonl", arithmetic_rows()[1])
            extra = {**extra, "eval_prompt_data": ("held", str(held_out)), "eval_interval": 2,
                     "n_samples_per_eval_prompt": 2}
        if name.startswith(("resume", "partial")):
            kind = name.split("_")[0]
            extra = {**extra, "run_dir": f"{root}/{kind}", "save": f"{root}/{kind}-ck",
                     "load": f"{root}/{kind}-ck"
                     if name.endswith(("_middle", "_rest", "_plain")) else None}
        cfg = TrainConfig(**{**TINY, **SEPARATE, "rollout_num_gpus": engine_ranks,
                             "run_dir": f"{root}/{name}", **extra})
        def observe(e, seen=seen, name=name):
            if name == "hook_failure":
                raise RuntimeError("the trainer's hook failed")
            if (name, e.rollout_id) in (("resume_first", 2), ("resume_middle", 3)):
                raise RuntimeError("killed after the checkpoint")  # trained, not checkpointed
            batch = e.gather_batch()  # collective: every trainer rank observes
            seen.append({"contents": batch_contents(batch), "metrics": dict(e.metrics),
                         "group_ids": list(batch.original_group_ids()),
                         "trace": [(s, tuple(ix), n) for s, ix, n in e.trace],
                         "num_samples": len(batch.lengths)})
            if name == "pool_partial":  # per sample: response, loss mask, weight versions
                seen[-1] |= {"samples": _responses(batch), "versions": np.stack(
                    [batch.weight_version_min, batch.weight_version_max]).T.tolist(),
                    "prompt_groups": batch.prompt_groups.tolist()}

        try:
            run_training(cfg, progress=False, on_rollout=observe)
            out[name] = {"rollouts": seen}
        except Exception as exc:  # noqa: BLE001 - the test reads which error each rank raised
            out[name] = {"error": (type(exc).__name__, str(exc)), "rollouts": seen}
    return out


def dying_rollout(ctx):
    """The engine rank's process dies mid-generation (no error reply: SIGKILL)."""
    os.kill(os.getpid(), signal.SIGKILL)


def dying_engine_worker(rank: int, root: str, cache: str):
    """One step off with an engine rank that is killed while generating rollout 0; the
    trainer returns the error it raised."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.run.driver import run_training
    from vime_shell.settings.train_config import TrainConfig

    cfg = TrainConfig(**{**TINY, **SEPARATE, "train_async": True, "run_dir": f"{root}/dying",
                         "rollout_function_path": "tests.shell.async_workers:dying_rollout"})
    try:
        run_training(cfg, progress=False)
    except Exception as exc:  # noqa: BLE001 - the test reads the trainer's error
        return (type(exc).__name__, str(exc))
    return None
