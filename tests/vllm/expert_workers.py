"""Process bodies of the vLLM expert-parallel sync tests (importable, so ``spawn`` runs them).

``ep_sync_worker``: one vLLM engine over the world's ranks (tensor parallel with
``enable_expert_parallel``, the external launcher), an :class:`EngineGroup` whose sync sends each
rank only the experts it serves. It records the experts vLLM placed on this rank (every MoE
layer's ``expert_map_manager``), the names the rank's engine received, and (``generate_after``)
greedy tokens after the sync, which the test rescores against the new weights.
"""

import time

import torch.distributed as dist

from tests.shell.engine_group_workers import init_gloo
from vime_shell.engines import SamplingParams
from vime_shell.engines.group import EngineGroup, EngineOptions
from vime_shell.engines.layout import resolve_engine_layout
from vime_shell.engines.sync import expert_of, layer_key
from vime_shell.engines.weights import load_safetensors_dir

PROMPTS = [[3, 9, 27, 81], [5, 6, 7], [100, 2, 50, 1, 8], [11, 12]]


def export_order(tensors: dict) -> list:
    """The checkpoint's tensors in the trainer's export order (mbridge's: a layer's own
    tensors, then its experts one by one), not the file's alphabetical one, which puts
    ``mlp.gate`` after the experts and would split the layer's unit."""
    def key(name: str):
        expert = expert_of(name)
        return layer_key(name), expert is not None, -1 if expert is None else expert, name

    return [(name, tensors[name]) for name in sorted(tensors, key=key)]


def _local_experts(model) -> list[list[int]]:
    """The global expert ids vLLM placed on this rank, per module that maps experts (a MoE
    layer has more than one)."""
    return [list(m.expert_map_manager.get_local_expert_ids()) for m in model.modules()
            if hasattr(m, "expert_map_manager")]


def ep_sync_worker(rank: int, hf_dir: str, new_dir: str, world: int, num_experts: int,
                   dtype: str = "float32", generate_after: bool = True) -> dict:
    """This rank's part of the engine (module docstring; ``dtype``: bfloat16 on CUDA)."""
    if world > 1:
        init_gloo()  # the trainer's group exists before vLLM joins it (external launcher)
    layout = resolve_engine_layout(world_size=world, rollout_num_gpus_per_engine=world,
                                   engine="vllm", num_attention_heads=2)
    start = time.perf_counter()
    group = EngineGroup.build(hf_dir, layout, EngineOptions(
        engine="vllm", dtype=dtype, max_model_len=64, enforce_eager=True,
        update_weight_buffer_size=4096, gpu_memory_utilization=0.3,
        expert_parallel=True, num_experts=num_experts,
        vllm_args=(("skip_tokenizer_init", True),)))
    start_s = time.perf_counter() - start
    placed = group.engine._llm.apply_model(_local_experts)[0]
    received: list[str] = []
    update = group.engine.update_weights_from_tensors

    def recording(bucket):
        bucket = list(bucket)
        received.extend(name for name, _ in bucket)
        update(bucket)

    group.engine.update_weights_from_tensors = recording
    report = group.sync_weights(iter(export_order(load_safetensors_dir(new_dir))))
    after = (group.engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
             if generate_after else [])
    out = {"start_s": start_s, "sync_s": report.seconds, "buckets": report.buckets,
           "received": received, "served": list(group.served_experts()), "placed": placed,
           "after": [(g.token_ids, g.log_probs) for g in after]}
    group.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return out
