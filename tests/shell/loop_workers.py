"""Process bodies for the ``vime train`` loop tests (importable, so ``spawn`` can run them).

Each worker runs one or more short trainings in a fresh process and returns plain, picklable
observations; the tests assert on them. ``TINY`` is the shared small configuration: 4 prompts
x 4 samples = 16 groups, 2 optimizer steps of 8 groups, micro-batches capped at 24 tokens (so
a step has several micro-batches per rank), rewarded by ``first_char_reward``.
"""

import os
import signal

import numpy as np

TINY = dict(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=8,
            max_tokens_per_gpu=24, lr=1e-3, seed=3,
            custom_rm_path="tests.shell.loop_workers:first_char_reward")


def first_char_reward(sample) -> float:
    """Partial credit (right first character): an untrained model earns some reward in 16
    samples (~1/19 each), so advantages are non-zero and the parameters move."""
    meta = sample.metadata
    return float(meta["response"][:1] == meta["label"][:1])


def _cfg(**kwargs):
    from vime_shell.loop.config import TrainConfig

    return TrainConfig(**{**TINY, **kwargs})


def _observe(event, out: list, *, engine_check: bool = False) -> None:
    """Record what a test needs from one rollout (on this rank)."""
    from megatron.core import parallel_state as mpu

    sched = event.schedule
    rank = mpu.get_data_parallel_rank()
    item = {"rollout": event.rollout_id, "metrics": dict(event.metrics), "dp_rank": rank,
            "trace": [(s, tuple(ix), n) for s, ix, n in event.trace],
            "plan": [[tuple(mb.sample_indices.tolist()) for mb in step.microbatches]
                     for step in event.records.steps],
            "steps": [[[tuple(mb) for mb in r] for r in step.microbatches]
                      for step in sched.steps],
            "partition": tuple(sched.partitions[rank]),
            "group_ids": event.batch.original_group_ids(),
            "tokens": np.asarray(event.batch.tokens).copy(),
            "advantages": np.asarray(event.batch.advantages).copy(),
            "rollout_log_probs": (None if event.batch.rollout_log_probs is None
                                  else np.asarray(event.batch.rollout_log_probs).copy()),
            "has_engine": event.engine is not None}
    if engine_check:
        state = event.trainer.hf_state_dict()  # collective: every rank calls it
        engine = getattr(event, "engine", None)
        if engine is not None:
            params = dict(engine.model.named_parameters())
            item["engine_vs_trainer"] = max(float((params[n] - t).abs().max())
                                            for n, t in state.items())
        item["state"] = {n: t.numpy().copy() for n, t in state.items()}
    out.append(item)


def loop_worker(rank: int, run_dir: str, cache: str, kwargs: dict) -> dict:
    """One run of ``kwargs`` (on top of ``TINY``); engine/trainer weights after each sync."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.loop.loop import run_training

    seen: list = []
    result = run_training(_cfg(run_dir=run_dir, **kwargs),
                          on_rollout=lambda e: _observe(e, seen, engine_check=True),
                          progress=False)
    return {"rollouts": seen, "hf_dir": str(result.hf_checkpoint)}


def replay_worker(rank: int, root: str, cache: str) -> dict:
    """Original run with dumps, then train-only replay, forge replay and a fallback replay."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.loop.loop import run_training

    template = f"{root}/dumps/r{{rollout_id}}.npz"
    runs = {}
    for name, kwargs in (
            ("original", dict(save_rollout_data=template)),
            ("train_only", dict(load_rollout_data=template)),
            ("forge", dict(load_rollout_data=template, load_rollout_data_mode="forge")),
            ("fallback", dict(load_rollout_data=f"{root}/dumps/r{{rollout_id}}.npz",
                              load_rollout_data_fallback=True, num_rollout=3))):
        seen: list = []
        run_training(_cfg(run_dir=f"{root}/{name}", **{"num_rollout": 2, **kwargs}),
                     on_rollout=lambda e, seen=seen: _observe(e, seen), progress=False)
        runs[name] = seen
    return runs


def world_size_1_worker(rank: int, root: str, cache: str, dump: str) -> dict:
    """Three runs in one process (imports dominate a short run): the default single-turn
    loop, the compact multi-turn loop, and a train-only replay of one hand-made batch."""
    fixed = dict(load_rollout_data=dump, num_rollout=1,
                 rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                 max_tokens_per_gpu=16)
    multi_turn = dict(num_rollout=2, rollout_function_path="vime_shell.rollout.functions:compact_rollout",
                      rollout_num_turns=2)
    return {"single": loop_worker(rank, f"{root}/single", cache, {"num_rollout": 3}),
            "multi_turn": loop_worker(rank, f"{root}/multi", cache, multi_turn),
            "fixed": loop_worker(rank, f"{root}/fixed", cache, fixed)}


def killed_worker(root: str, cache: str, port: int, kill_after: int) -> None:
    """Run 4 rollouts with checkpoints every 2 and SIGKILL this process after ``kill_after``."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      VIME_CACHE_DIR=cache)
    import torch

    torch.set_num_threads(1)
    from vime_shell.loop.loop import run_training

    def hook(event):
        if event.rollout_id == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    run_training(_cfg(**resume_kwargs(root, "interrupted", resume=False)), on_rollout=hook,
                 progress=False)


def resume_kwargs(root: str, name: str, resume: bool) -> dict:
    """A new run passes --save only; its resumption adds --load of the same directory."""
    return dict(num_rollout=4, save=f"{root}/{name}/ckpt",
                load=f"{root}/{name}/ckpt" if resume else None,
                save_interval=2, run_dir=f"{root}/{name}/run",
                save_rollout_data=f"{root}/{name}/dumps/r{{rollout_id}}.npz")


def resume_worker(rank: int, root: str, cache: str) -> dict:
    """The uninterrupted run, then the resumption of the killed one; final weights of both."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_shell.loop.loop import run_training

    out = {}
    for name in ("uninterrupted", "interrupted"):
        final: dict = {}

        def hook(event, final=final):
            if event.rollout_id == 3:
                final.update({n: t.numpy().copy()
                              for n, t in event.trainer.hf_state_dict().items()})

        result = run_training(_cfg(**resume_kwargs(root, name, resume=name == "interrupted")),
                              on_rollout=hook, progress=False)
        out[name] = {"start": result.start_rollout, "final": final,
                     "ran": [r["rollout"] for r in result.records]}
    return out


def save_hf_worker(rank: int, root: str, cache: str, probe: np.ndarray) -> dict:
    """Train 2 rollouts with ``--save-hf``; Megatron log-probs of ``probe`` after the last one."""
    os.environ["VIME_CACHE_DIR"] = cache
    from vime_pure import (BatchingPolicy, ParallelLayout, RolloutBatch, Sample, rank_batch,
                           schedule_for)
    from vime_shell.loop.loop import run_training

    n, length = probe.shape
    batch = RolloutBatch.from_samples([[Sample(tokens=row.tolist(), response_length=length - 1,
                                               reward=0.0)] for row in probe])
    records = rank_batch(batch, schedule_for(batch, ParallelLayout(dp=1), BatchingPolicy(
        global_batch_size=n, micro_batch_size=1)), dp_rank=0)
    seen: dict = {}

    def hook(event):
        logps = event.trainer.compute_log_probs(records.microbatches, records.num_response_tokens)
        seen["log_probs"] = logps.reshape(n, length - 1)
        seen["state"] = {k: t.numpy().copy() for k, t in event.trainer.hf_state_dict().items()}

    result = run_training(_cfg(run_dir=f"{root}/run", num_rollout=2, save_hf=f"{root}/hf",
                               save_hf_max_shard_size="300KB"),
                          on_rollout=hook, progress=False)
    return {**seen, "hf_dir": str(result.hf_checkpoint)}
