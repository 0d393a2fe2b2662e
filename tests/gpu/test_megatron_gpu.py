"""CUDA-only checks of the Megatron shell, on a tiny Qwen2 and a tiny Qwen3.5; every test
skips cleanly without CUDA.

- THD packing (TransformerEngine) gives the same log-probs as block-diagonal mask packing
  (local spec), both bf16;
- CP=2 gives the same log-probs, first-step loss and gradient norm as CP=1 (needs 2 GPUs);
- a bf16 train step runs, its loss is finite and the weights move.

Run all of them with ``tests/gpu/run_gpu_suite.sh``.
"""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_LOGP_TOL = 5e-2  # bf16 activations: ~3 significant digits per op


@pytest.fixture(scope="module", params=["qwen2", "qwen3_5"])
def hf_dir(request, tmp_path_factory):
    """A tiny Qwen2, and a tiny Qwen3.5 (its linear-attention layers on TransformerEngine's
    spec: cut at ``cu_seqlens`` under THD, zigzag chunks gathered under CP; 4 layers, 3 of
    them linear)."""
    from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

    # head_dim 64: fused attention kernels want a supported head size.
    spec = TinyModelSpec(arch=request.param, hidden_size=256, num_heads=4, num_kv_heads=2,
                         head_dim=64, intermediate_size=512,
                         num_layers=4 if request.param == "qwen3_5" else 2)
    return str(build_tiny_hf_model(tmp_path_factory.mktemp("gpu") / request.param, spec))


def _te_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(not _te_available(), reason="THD packing needs TransformerEngine")
def test_thd_packing_equals_mask_packing(hf_dir):
    from tests.gpu.gpu_workers import thd_vs_mask_worker
    from vime_shell.megatron.spawn import spawn

    (out,) = spawn(thd_vs_mask_worker, 1, hf_dir)
    print(f"THD vs mask max |dlogp| = {out['max_diff']:.2e} ({out['thd_platform']})")
    assert out["thd_platform"]["packing"] == "thd"
    assert out["max_diff"] <= BF16_LOGP_TOL


def test_bf16_step_runs(hf_dir):
    from tests.gpu.gpu_workers import bf16_step_worker
    from vime_shell.megatron.spawn import spawn

    (out,) = spawn(bf16_step_worker, 1, hf_dir)
    print(f"bf16 step: losses {out['losses']}, max weight change {out['moved']:.2e}")
    assert all(math.isfinite(x) for x in out["losses"])
    assert out["moved"] > 0.0


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not _te_available(),
                    reason="CP=2 needs 2 GPUs and TransformerEngine")
def test_cp2_equals_cp1(hf_dir):
    import numpy as np

    from tests.gpu.gpu_workers import cp_worker
    from vime_shell.megatron.spawn import spawn

    (one,) = spawn(cp_worker, 1, hf_dir, 1)
    two = spawn(cp_worker, 2, hf_dir, 2)
    # Each CP rank scores its own zigzag share of the tokens (NaN elsewhere): merged, all.
    merged = np.where(np.isnan(two[0]["logps"]), two[1]["logps"], two[0]["logps"])
    assert not np.isnan(merged).any() and not np.isnan(one["logps"]).any()
    logp_diff = float(np.max(np.abs(one["logps"] - merged)))
    print(f"CP2 vs CP1: |dlogp| {logp_diff:.2e}, loss {one['loss']} vs {two[0]['loss']}, "
          f"grad norm {one['grad_norm']} vs {two[0]['grad_norm']}")
    assert logp_diff <= BF16_LOGP_TOL
    assert two[0]["loss"] == pytest.approx(one["loss"], rel=2e-2, abs=2e-3)
    assert two[0]["grad_norm"] == pytest.approx(one["grad_norm"], rel=2e-2)
    assert (np.isnan(two[0]["logps"]) != np.isnan(two[1]["logps"])).all()  # disjoint shares
