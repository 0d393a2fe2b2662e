"""CUDA-only parts of the memory and MoE features; every test skips cleanly without CUDA.

- ``--offload-train``: ``offload()`` gives back at least 90% of the bytes it reports to
  ``torch.cuda.memory_allocated``, ``reload()`` is exact, training continues;
- ``--optimizer-cpu-offload`` (Megatron's HybridDeviceOptimizer): a step runs, the weights move,
  and less CUDA memory is held than with the optimizer on the GPU;
- ``--use-precision-aware-optimizer`` (needs TransformerEngine): a step runs;
- MoE with ``--expert-model-parallel-size 2`` on NCCL equals EP1 (DP2) to bf16 precision
  (needs 2 GPUs: NCCL refuses two ranks on one device).

Routing replay and vLLM's expert parallelism on CUDA: ``tests/gpu/test_moe_gpu.py``.
"""

import importlib.util
import math

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

    root = tmp_path_factory.mktemp("gpu-memory")
    dense = TinyModelSpec(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                          intermediate_size=1024, num_layers=4)
    moe = TinyModelSpec(arch="qwen3_moe", hidden_size=256, num_heads=4, num_kv_heads=2,
                        head_dim=64, num_layers=2, num_experts=4, moe_intermediate_size=128)
    return {"dense": str(build_tiny_hf_model(root / "dense", dense)),
            "moe": str(build_tiny_hf_model(root / "moe", moe))}


def test_offload_train_frees_the_trainers_cuda_memory(models):
    from tests.gpu.memory_workers import offload_worker
    from vime_shell.megatron.spawn import spawn

    (out,) = spawn(offload_worker, 1, models["dense"])
    print(f"offload: reported {out['reported']} B, freed {out['freed']} B")
    assert out["freed"] >= 0.9 * out["reported"] > 0
    assert out["roundtrip_max"] == 0.0
    assert all(math.isfinite(x) for x in out["losses"])


def test_optimizer_cpu_offload_steps_and_holds_less_cuda_memory(models):
    from tests.gpu.memory_workers import optimizer_offload_worker
    from vime_shell.megatron.spawn import spawn

    (on_gpu,) = spawn(optimizer_offload_worker, 1, models["dense"], False, False)
    (offloaded,) = spawn(optimizer_offload_worker, 1, models["dense"], True, False)
    print(f"optimizer state on GPU: {on_gpu['allocated']} B, offloaded: "
          f"{offloaded['allocated']} B")
    assert all(math.isfinite(x) for x in offloaded["losses"]) and offloaded["moved"] > 0
    assert offloaded["allocated"] < on_gpu["allocated"]


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="the precision-aware optimizer needs TransformerEngine's FusedAdam")
def test_precision_aware_optimizer_steps(models):
    from tests.gpu.memory_workers import optimizer_offload_worker
    from vime_shell.megatron.spawn import spawn

    (out,) = spawn(optimizer_offload_worker, 1, models["dense"], False, True)
    assert all(math.isfinite(x) for x in out["losses"]) and out["moved"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="EP2 needs 2 GPUs")
def test_expert_parallel_on_nccl_equals_ep1(models):
    from tests.gpu.gpu_workers import bf16_step_worker
    from vime_shell.megatron.spawn import spawn

    ep2 = spawn(bf16_step_worker, 2, models["moe"], 2)[0]
    ep1 = spawn(bf16_step_worker, 2, models["moe"], 1)[0]
    delta = max(float(np.max(np.abs(ep2["final"][k] - ep1["final"][k]))) for k in ep1["final"])
    print(f"EP2 vs EP1 on NCCL (bf16): max |param delta| {delta:.2e}")
    assert max(abs(a - b) for a, b in zip(ep2["losses"], ep1["losses"])) <= 1e-2
    assert delta <= 1e-2
