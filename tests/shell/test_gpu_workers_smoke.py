"""The GPU suite, exercised on CPU: it collects, and every GPU worker runs with CUDA mocked.

A worker that calls itself, names a function that moved, or passes the wrong arguments fails
here, in CPU CI, instead of on the rare machine with a GPU. The mock is the CPU compatibility
layer (``vime_shell.megatron.cuda_compat``: ``torch.cuda.*`` calls and ``device="cuda"`` go to
the CPU) plus ``init_process_group("nccl")`` turned into gloo. The workers' numbers are not
checked against GPU values (bf16 on CPU, no TransformerEngine): only that each runs to the end
and returns what its test reads.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from vime_shell.megatron.spawn import spawn
from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = {"test_thd_packing_equals_mask_packing", "test_bf16_step_runs", "test_cp2_equals_cp1",
             "test_vime_train_end_to_end_on_one_gpu",
             "test_a_missed_sync_is_visible_above_the_tolerance",
             "test_offload_train_frees_the_trainers_cuda_memory",
             "test_optimizer_cpu_offload_steps_and_holds_less_cuda_memory",
             "test_expert_parallel_on_nccl_equals_ep1"}


def mocked_cuda_workers(rank: int, hf_dir: str, out_dir: str, moe_dir: str) -> dict:
    """Every worker of ``tests.gpu.gpu_workers`` and ``memory_workers`` in turn, in this
    process, CUDA mocked (not the optimizer CPU offload: Megatron's HybridDeviceOptimizer
    fails on CPU, which is why the flag is CUDA-only)."""
    import torch.distributed as dist

    from tests.gpu import gpu_workers, memory_workers
    from vime_shell.megatron import cuda_compat

    cuda_compat.install()
    real_init = dist.init_process_group

    def gloo_init(backend=None, *args, **kwargs):
        return real_init("gloo", *args, **kwargs)

    dist.init_process_group = gloo_init
    out = {"thd": gpu_workers.thd_vs_mask_worker(rank, hf_dir),
           "bf16": gpu_workers.bf16_step_worker(rank, hf_dir),
           "cp1": gpu_workers.cp_worker(rank, hf_dir, 1),
           "offload": memory_workers.offload_worker(rank, hf_dir),
           "moe": gpu_workers.bf16_step_worker(rank, moe_dir, 1)}
    # Last: the loop leaves its process group initialised.
    small = {"rollout_batch_size": 8, "n_samples_per_prompt": 8}  # 64 samples: some reward
    out["e2e"] = gpu_workers.e2e_worker(rank, f"{out_dir}/e2e.json", 3, small)
    out["stale"] = gpu_workers.e2e_worker(rank, f"{out_dir}/e2e_stale.json", 3, small, True)
    return out


def test_the_gpu_suite_collects_on_cpu():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "tests/gpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    collected = {line.split("::")[-1].split("[")[0] for line in proc.stdout.splitlines()
                 if "::" in line}
    assert GPU_TESTS <= collected, collected


def test_every_gpu_worker_runs_with_cuda_mocked(tmp_path):
    hf_dir = build_tiny_hf_model(tmp_path / "tiny", TinyModelSpec(
        hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
        num_layers=2))
    moe_dir = build_tiny_hf_model(tmp_path / "moe", TinyModelSpec(arch="qwen3_moe"))
    (out,) = spawn(mocked_cuda_workers, 1, str(hf_dir), str(tmp_path), str(moe_dir))
    # On CPU the "thd" side is the detected fp32 platform (mask packing), the other bf16.
    assert out["thd"]["thd_platform"]["packing"] == "mask" and out["thd"]["max_diff"] < 5e-2
    assert out["bf16"]["moved"] > 0 and out["bf16"]["dtype"] == "torch.float32"  # CPU platform
    assert len(out["cp1"]["logps"]) > 0 and out["cp1"]["grad_norm"] > 0
    assert out["offload"]["reported"] > 0 and out["offload"]["roundtrip_max"] == 0.0
    assert any(".mlp.experts.3." in k for k in out["moe"]["final"])
    e2e = out["e2e"]
    assert (tmp_path / "e2e.json").is_file() and len(e2e["rollouts"]) == 3
    assert e2e["engine"] == "hf" and e2e["trainer_dtype"] == "float32"
    assert e2e["logprob_gap_tolerance"] == 1e-4 and max(e2e["gap_after_sync"]) < 1e-5
    assert e2e["generation_tokens_per_s"] > 0 and e2e["peak_host_rss_bytes"] > 0
    assert max(e2e["reward_per_rollout"]) > 0  # the weights move, so syncs carry something
    # The control: a missed sync shows as a gap far above fp32 noise and the 1e-4 tolerance.
    assert max(out["stale"]["gap_after_sync"]) > 10 * e2e["logprob_gap_tolerance"]
