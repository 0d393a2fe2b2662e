"""Process bodies for the engine-group tests (importable, so ``spawn`` can run them).

Also imported by ``tests/vllm`` (no Megatron there): only the engines, rollouts and the core.
A *case* is ``(rollout_num_gpus, gpus_per_engine, rollout function name, engine name)``; each
worker runs every case in one process group and returns plain, picklable observations.
"""

import os
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from vime_pure import RolloutBatch
from vime_shell.engines import SamplingParams
from vime_shell.engines.group import EngineGroup, EngineGroupError, EngineOptions
from vime_shell.engines.layout import resolve_engine_layout
from vime_shell.engines.weights import load_safetensors_dir
from vime_shell.engines.work_queue import PromptQueue, job_store
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.rollout.functions import (RolloutContext, compact_rollout, rollout_sampling_seed,
                                          share_context, single_turn_rollout)
from vime_shell.rollout.rewards import Rewarder
from vime_shell.rollout.tasks import get_task

ROLLOUTS = {"single": single_turn_rollout, "compact": compact_rollout}
NUM_PROMPTS, N_SAMPLES, ROLLOUT_ID = 5, 4, 3  # 5 prompts over 2 engines: shares of 3 and 2


def make_context(engine, tokenizer, *, num_prompts: int = NUM_PROMPTS) -> RolloutContext:
    """The loop's context of rollout ``ROLLOUT_ID``, seed 0, reverse2 (all prompts)."""
    task = get_task("reverse2")
    return RolloutContext(
        rollout_id=ROLLOUT_ID, engine=engine, tokenizer=tokenizer, task=task,
        prompts=task.examples(num_prompts, seed=0, rollout_id=ROLLOUT_ID),
        n_samples_per_prompt=N_SAMPLES, rewarder=Rewarder.build(rm_type="exact"), num_turns=2,
        sampling=SamplingParams(max_new_tokens=task.answer_length, temperature=1.0,
                                seed=rollout_sampling_seed(0, ROLLOUT_ID)))


def batch_columns(batch: RolloutBatch) -> dict:
    """What the equality test compares (log-probs separately, with a tolerance)."""
    return {"tokens": batch.tokens.copy(), "lengths": batch.lengths.copy(),
            "group_ids": batch.original_group_ids(),
            "prompt_groups": batch.prompt_groups.copy(), "rewards": batch.rewards.copy(),
            "advantages": batch.advantages.copy(),
            "rollout_log_probs": batch.rollout_log_probs.copy()}


def init_gloo() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def group_worker(rank: int, hf_dir: str, new_dir: str, cases: list, options: dict) -> dict:
    """Run each case: shares, gather, batch on rank 0, then a bucketed sync of ``new_dir``."""
    init_gloo()
    tokenizer = load_tokenizer(hf_dir)
    new = load_safetensors_dir(new_dir)
    out = {}
    for total, g, fn_name, engine in cases:
        layout = resolve_engine_layout(world_size=dist.get_world_size(), rollout_num_gpus=total,
                                       rollout_num_gpus_per_engine=g, engine=engine)
        group = EngineGroup.build(hf_dir, layout, EngineOptions(engine=engine, **options))
        ctx = make_context(group.engine, tokenizer)
        shares: list[tuple[int, int]] = []

        def produce(share, ctx=ctx, shares=shares, fn=ROLLOUTS[fn_name]):
            shares.append((share.start, share.stop))
            return fn(share_context(ctx, share))
        merged = group.run_shares(produce, NUM_PROMPTS)
        item = {"shares": shares, "engine": group.engine_index, "leader": group.is_leader,
                "merged": None if merged is None else batch_columns(
                    RolloutBatch.from_samples(merged))}
        report = group.sync_weights(iter(new.items()))
        item["sync"] = (report.tensors, report.bytes, report.buckets)
        if group.engine is not None and hasattr(group.engine, "model"):
            params = dict(group.engine.model.named_parameters())
            item["sync_error"] = max(float((params[n] - t).abs().max()) for n, t in new.items())
        group.close()
        dist.barrier()
        out[(total, g, fn_name, engine)] = item
    dist.destroy_process_group()
    return out


def _run_and_close(group, produce, num_prompts: int) -> str:
    """``run_shares`` on every rank; this rank's error as ``"Type: message"`` (or ``"no
    error"``), the group closed and the process group destroyed."""
    try:
        group.run_shares(produce, num_prompts)
        message = "no error"
    except (RuntimeError, EngineGroupError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    group.close()
    dist.destroy_process_group()
    return message


def env_summary() -> dict:
    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


__all__ = ["batch_columns", "group_worker", "make_context", "np", "queue_failure_worker"]


class _StandIn:
    """An engine that generates nothing (the queue test needs none): only ``close``."""

    weight_version = 0

    def close(self) -> None:
        pass


def queue_failure_worker(rank: int, gpus_per_engine: int) -> dict:
    """16 prompts, chunks of 2 (``queue_chunk_size(16, 2)``) over 2 engines: engine 1's leader
    fails on its second chunk while engine 0 still holds its first: engine 0 finishes a chunk
    only once engine 1 has aborted the queue (a key in the job's store, set after
    ``PromptQueue.abort``; a wait, not a sleep), so at any load engine 0 generates at most one
    chunk and engine 1 two. Every rank returns its error message (or ``"no error"``) and the
    chunks its engine generated."""
    init_gloo()
    layout = resolve_engine_layout(world_size=dist.get_world_size(),
                                   rollout_num_gpus_per_engine=gpus_per_engine)
    group = EngineGroup.build("unused", layout, EngineOptions(engine="hf"),
                              factory=lambda *_: _StandIn())
    chunks: list[int] = []
    aborted = "tests/queue-aborted"
    abort = PromptQueue.abort

    def abort_and_say_so(queue: PromptQueue) -> None:
        abort(queue)
        job_store().set(aborted, "1")
    PromptQueue.abort = abort_and_say_so  # this process only: spawn's worker, never pytest's

    def produce(share):
        chunks.append(share.start)
        if group.engine_index == 1 and group.is_leader and len(chunks) == 2:
            raise RuntimeError("tool sandbox unreachable")
        if group.engine_index == 0:
            job_store().wait([aborted], timedelta(seconds=60))
        return [[] for _ in share]
    message = _run_and_close(group, produce, 16)
    return {"message": message, "chunks": chunks, "engine": group.engine_index}
