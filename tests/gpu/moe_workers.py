"""Code the GPU MoE tests run in spawned processes (module level, so it pickles): routing
replay on CUDA, vLLM's routed experts, and vLLM's expert-parallel reload."""

import attrs
import numpy as np

from tests.gpu.gpu_workers import _init_nccl

PROMPTS = [[3, 9, 27, 81, 4], [5, 6, 7], [100, 2, 50, 1, 8, 8, 1], [11, 12, 13, 14]]


def vllm_routes_worker(rank: int, hf_dir: str) -> list[dict]:
    """Greedy generations of CUDA vLLM with ``enable_return_routed_experts`` (bf16)."""
    from vime_shell.engines.base import SamplingParams
    from vime_shell.engines.vllm import VllmEngine

    engine = VllmEngine(hf_dir, dtype="bfloat16", max_model_len=128, enforce_eager=True,
                        gpu_memory_utilization=0.3, skip_tokenizer_init=True,
                        enable_return_routed_experts=True)
    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    engine.close()
    return [{"prompt": p, "tokens": list(g.token_ids), "log_probs": list(g.log_probs),
             "routes": np.asarray(g.routed_experts)} for p, g in zip(PROMPTS, gens)]


def _vllm_batch(generations: list[dict]):
    from vime_pure import RolloutBatch, Sample

    rng = np.random.default_rng(0)
    return RolloutBatch.from_samples([[Sample(
        tokens=g["prompt"] + g["tokens"], response_length=len(g["tokens"]),
        reward=float(rng.random()), group_id=i, prompt_group=0,
        rollout_log_probs=g["log_probs"], rollout_routed_experts=g["routes"])
        for i, g in enumerate(generations)]])


def replay_worker(rank: int, hf_dir: str, vllm_generations: list[dict] | None) -> dict:
    """Routing replay in the CUDA trainer (bf16): the HF engine's routes and random ones
    (recorded by router hooks, with and without full recompute); with ``vllm_generations``,
    also a step on vLLM's routes."""
    import torch.distributed as dist

    from tests.shell.routing_workers import FULL_RECOMPUTE, _random_routes, engine_batch, train

    _init_nccl(rank)
    batch, _ = engine_batch(hf_dir)
    forced = attrs.evolve(batch, rollout_routed_experts=_random_routes(batch))
    out = {"free": train(hf_dir, batch, replay=False),
           "replay": train(hf_dir, batch, replay=True),
           "forced": train(hf_dir, forced, replay=True, record=True),
           "forced_recompute": train(hf_dir, forced, replay=True, options=FULL_RECOMPUTE)}
    if vllm_generations is not None:
        out["vllm"] = train(hf_dir, _vllm_batch(vllm_generations), replay=True, record=True)
    dist.destroy_process_group()
    return out
