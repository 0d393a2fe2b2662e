"""CUDA-only MoE checks: routing replay (R3) in the bf16 trainer, vLLM's routed experts, and
vLLM's expert-parallel weight reload. Every test skips cleanly without CUDA (and without vllm,
or with one GPU where two are needed); ``tests/gpu/run_gpu_suite.sh`` runs them.

- the trainer obeys given routes in every router (forward hooks), with full recompute too;
- CUDA vLLM with ``enable_return_routed_experts`` (Model Runner V2) returns one route per token
  and MoE layer that agrees with transformers' router top-k (fp32) on >= 90% of (token, layer)
  pairs (bf16 near-ties may differ), and the trainer replays them;
- an ``enable_expert_parallel`` engine reloads from a sync that sends each rank only its
  experts, then scores tokens as transformers does with the new weights (EP over 2 GPUs when
  there are 2; on one GPU the reload path with EP on, every expert local).

The CPU versions: ``tests/shell/test_routing_replay.py``, ``tests/vllm/test_vllm_expert_parallel.py``.
"""

import importlib.util

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm (CUDA build)")
# vLLM needs a supported head size (64); 2 layers, 4 experts, top-2 (routing_workers' shapes).
MOE = dict(arch="qwen3_moe", hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64,
           num_layers=2, num_experts=4)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

    root = tmp_path_factory.mktemp("gpu-moe")
    return (str(build_tiny_hf_model(root / "old", TinyModelSpec(**MOE, seed=5))),
            str(build_tiny_hf_model(root / "new", TinyModelSpec(**MOE, seed=6))))


@pytest.fixture(scope="module")
def vllm_generations(moe_dirs):
    if importlib.util.find_spec("vllm") is None:
        return None
    from tests.gpu.moe_workers import vllm_routes_worker
    from vime_shell.megatron.spawn import spawn

    (gens,) = spawn(vllm_routes_worker, 1, moe_dirs[0])
    return gens


@pytest.fixture(scope="module")
def replay(moe_dirs, vllm_generations):
    from tests.gpu.moe_workers import replay_worker
    from vime_shell.megatron.spawn import spawn

    (out,) = spawn(replay_worker, 1, moe_dirs[0], vllm_generations)
    return out


def _obeyed(run) -> None:
    assert run["recorded"] and len(run["recorded"]) == len(run["given"])
    for (layer, chosen), given in zip(run["recorded"], run["given"]):
        assert np.array_equal(chosen, given), f"layer {layer}"


def test_routing_replay_obeys_the_given_routes_on_cuda(replay):
    _obeyed(replay["forced"])
    assert all(np.isfinite(replay["forced"]["losses"]))
    delta = max(float(np.max(np.abs(replay["forced_recompute"]["final"][k]
                                    - replay["forced"]["final"][k])))
                for k in replay["forced"]["final"])
    print(f"R3 on CUDA: recompute vs none, max |param delta| {delta:.2e}; losses free "
          f"{replay['free']['losses']} replay {replay['replay']['losses']}")
    assert delta <= 1e-2  # bf16; the recomputed routers replay the same routes


@needs_vllm
def test_vllm_returns_routed_experts_that_the_trainer_replays(moe_dirs, vllm_generations,
                                                              replay):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dirs[0], dtype=torch.float32)
    agree = total = 0
    for g in vllm_generations:
        seq = g["prompt"] + g["tokens"]
        routes = g["routes"]
        assert routes.shape[0] in (len(seq), len(seq) - 1) and routes.shape[1:] == (2, 2)
        with torch.no_grad():
            logits = model(torch.tensor([seq]), output_router_logits=True).router_logits
        for layer, lg in enumerate(logits):
            ref = lg.topk(2, dim=-1).indices.sort(dim=-1).values.numpy()[:routes.shape[0]]
            agree += int((np.sort(routes[:, layer], axis=1) == ref).all(axis=1).sum())
            total += routes.shape[0]
    print(f"vLLM routes agree with transformers' router top-k on {agree}/{total}")
    assert agree >= 0.9 * total
    _obeyed(replay["vllm"])
    assert all(np.isfinite(replay["vllm"]["losses"]))


@needs_vllm
def test_vllm_expert_parallel_reload_sends_each_rank_its_experts(moe_dirs):
    from tests.vllm.expert_workers import ep_sync_worker
    from tests.vllm.test_vllm_expert_parallel import _rescore
    from vime_shell.engines.layout import logprob_gap_tolerance
    from vime_shell.engines.sync import expert_of
    from vime_shell.megatron.spawn import spawn

    world = min(2, torch.cuda.device_count())
    ranks = spawn(ep_sync_worker, world, moe_dirs[0], moe_dirs[1], world, 4, "bfloat16")
    expected = [[0, 1], [2, 3]] if world == 2 else [[0, 1, 2, 3]]
    assert [list(r["served"]) for r in ranks] == expected
    for r, experts in zip(ranks, expected):
        # vLLM's own placement, in every module of both MoE layers that maps experts
        assert len(r["placed"]) >= 2 and all(p == experts for p in r["placed"])
        assert {expert_of(n) for n in r["received"]} - {None} == set(experts)
        gap = _rescore(moe_dirs[1], r["after"])
        print(f"vLLM EP{world} reload on CUDA: experts {experts}, {r['buckets']} buckets, "
              f"{r['sync_s'] * 1e3:.1f} ms, gap {gap:.1e}")
        assert gap < 10 * logprob_gap_tolerance("bfloat16")
