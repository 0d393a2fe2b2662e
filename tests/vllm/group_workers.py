"""Process bodies of the vLLM engine-group tests (importable, so ``spawn`` can run them).

``vllm_group_worker`` builds this rank's part of an :class:`EngineGroup` of vLLM engines (with
``distributed_executor_backend="external_launcher"`` when the world has 2 ranks), generates a
rollout's shares, gathers them, syncs new weights from memory in buckets, and generates greedily
again so the test can measure the gap against the new weights.
"""

import time

import torch.distributed as dist

from tests.shell.engine_group_workers import NUM_PROMPTS, batch_columns, init_gloo, make_context
from vime_pure import RolloutBatch
from vime_shell.engines import SamplingParams
from vime_shell.engines.group import EngineGroup, EngineOptions
from vime_shell.engines.layout import resolve_engine_layout
from vime_shell.engines.weights import load_safetensors_dir
from vime_shell.models.tokenizer import load_tokenizer
from vime_shell.rollout.functions import share_context, single_turn_rollout

GREEDY_PROMPTS = ["12>", "34>", "56>", "78>", "90>", "3+4="]


def vllm_group_worker(rank: int, hf_dir: str, new_dir: str, world: int, per_engine: int) -> dict:
    if world > 1:
        init_gloo()  # the trainer's group exists before vLLM joins it (external launcher)
    layout = resolve_engine_layout(world_size=world, rollout_num_gpus_per_engine=per_engine,
                                   engine="vllm", num_attention_heads=2)
    start = time.perf_counter()
    group = EngineGroup.build(hf_dir, layout, EngineOptions(
        engine="vllm", max_model_len=64, enforce_eager=True, update_weight_buffer_size=16384))
    start_s = time.perf_counter() - start
    tokenizer = load_tokenizer(hf_dir)
    ctx = make_context(group.engine, tokenizer)
    t0 = time.perf_counter()
    merged = group.run_shares(lambda share: single_turn_rollout(share_context(ctx, share)),
                              NUM_PROMPTS)
    generate_s = time.perf_counter() - t0
    new = load_safetensors_dir(new_dir)
    t0 = time.perf_counter()
    report = group.sync_weights(iter(new.items()))
    sync_s = time.perf_counter() - t0
    ids = [tokenizer(p)["input_ids"] for p in GREEDY_PROMPTS]
    after = group.engine.generate(ids, SamplingParams(max_new_tokens=4, temperature=0.0))
    out = {"engine": group.engine_index, "leader": group.is_leader, "start_s": start_s,
           "generate_s": generate_s, "sync_s": sync_s, "buckets": report.buckets,
           "merged": None if merged is None else batch_columns(RolloutBatch.from_samples(merged)),
           "greedy_ids": ids, "after": [(g.token_ids, g.log_probs) for g in after]}
    group.close()
    out["group_survives_close"] = dist.is_initialized()
    if dist.is_initialized():
        dist.destroy_process_group()
    return out
