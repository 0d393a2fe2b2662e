"""Qwen3.5 on CUDA: TransformerEngine's spec with the linear-attention layers, never run on a
GPU before; every test skips cleanly without CUDA.

- THD packing on TE's spec (the delta net cut at ``cu_seqlens``; gated attention and the
  (1 + w) norms in TE's kernels; a ``TENorm`` before each linear-attention layer) gives the
  log-probs of the local spec with block-mask packing, both bf16;
- CP=2 (the delta net gathers its zigzag chunks over CP) gives CP=1's log-probs, first loss
  and gradient norm (needs 2 GPUs);
- a bf16 training step runs, its loss is finite and the weights move.

Run with ``tests/gpu/run_gpu_suite.sh -k qwen3_5``.
"""

import math

import numpy as np
import pytest
import torch

from tests.gpu.test_megatron_gpu import BF16_LOGP_TOL, _te_available

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

    # head_dim 64: fused attention kernels want a supported head size; 4 layers: 3 linear
    spec = TinyModelSpec(arch="qwen3_5", hidden_size=256, num_heads=4, num_kv_heads=2,
                         head_dim=64, intermediate_size=512, num_layers=4)
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("gpu") / "qwen3_5", spec))


@pytest.mark.skipif(not _te_available(), reason="THD packing needs TransformerEngine")
def test_qwen3_5_thd_on_te_equals_mask_packing(hf_dir):
    from tests.gpu.gpu_workers import thd_vs_mask_worker
    from vime_shell.megatron.spawn import spawn

    (out,) = spawn(thd_vs_mask_worker, 1, hf_dir)
    print(f"Qwen3.5 THD (TE) vs mask max |dlogp| = {out['max_diff']:.2e}")
    assert out["thd_platform"]["packing"] == "thd"
    assert out["max_diff"] <= BF16_LOGP_TOL


def test_qwen3_5_bf16_step_runs(hf_dir):
    from tests.gpu.gpu_workers import bf16_step_worker
    from vime_shell.megatron.spawn import spawn

    (out,) = spawn(bf16_step_worker, 1, hf_dir)
    print(f"Qwen3.5 bf16 step: losses {out['losses']}, max weight change {out['moved']:.2e}")
    assert all(math.isfinite(x) for x in out["losses"]) and out["moved"] > 0.0


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not _te_available(),
                    reason="CP=2 needs 2 GPUs and TransformerEngine")
def test_qwen3_5_cp2_equals_cp1(hf_dir):
    from tests.gpu.gpu_workers import cp_worker
    from vime_shell.megatron.spawn import spawn

    (one,) = spawn(cp_worker, 1, hf_dir, 1)
    two = spawn(cp_worker, 2, hf_dir, 2)
    merged = np.where(np.isnan(two[0]["logps"]), two[1]["logps"], two[0]["logps"])
    logp_diff = float(np.max(np.abs(one["logps"] - merged)))
    print(f"Qwen3.5 CP2 vs CP1: |dlogp| {logp_diff:.2e}, loss {one['loss']} vs "
          f"{two[0]['loss']}, grad norm {one['grad_norm']} vs {two[0]['grad_norm']}")
    assert logp_diff <= BF16_LOGP_TOL
    assert two[0]["loss"] == pytest.approx(one["loss"], rel=2e-2, abs=2e-3)
    assert two[0]["grad_norm"] == pytest.approx(one["grad_norm"], rel=2e-2)
