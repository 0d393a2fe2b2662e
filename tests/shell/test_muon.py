"""``--optimizer muon`` on Megatron-core (CPU, gloo, the tiny GQA Qwen2 with QKV biases).

- One step (no clipping) equals a float64 reference computed from the update rule's
  definition (``muon_workers.reference_muon_update``: momentum, Newton-Schulz per Q / K / V
  part, spectral scale, decoupled weight decay): with ``--muon-fp32-matmul-prec high`` to
  1e-5 of the update's norm; with ``medium`` (bf16 iterations, Megatron's default) to 0.15 of
  it (measured: 0.084, bf16 rounding amplified along the gradient's small singular
  directions). Nesterov with the QKV weight whole and ``unit_rms_norm`` likewise. The Adam(W)
  parameters (embedding, output layer, norms, biases) equal plain AdamW to 1e-4 of lr per
  entry (measured 3e-5: the fp32 rounding of weights near 1).
- TP2 ``duplicated`` and DP2 with overlapped gradient reduce end two rollouts (four steps,
  lr 2e-3) at TP1's weights to 1e-5 (measured 1.8e-6 and 8.5e-7, both at Adam parameters:
  ``lm_head`` and a ``k_proj`` bias, where Adam turns round-off into updates); a TP2 ``blockwise`` step equals the reference applied to each
  rank's shard alone (Megatron's blockwise: the shard's own shape sets the scale).
- Two rollouts straight equal one rollout + save + load + one rollout, bit for bit (same
  layout), and the TP2 checkpoint loaded at TP1 continues to TP1's weights to 1e-5; an Adam
  trainer refuses a Muon checkpoint, naming the field and the fix.
- bf16 (on CPU): Muon runs in Megatron's Float16 wrapper on fp32 main parameters.
"""

import numpy as np
import pytest

from tests.shell.muon_workers import muon_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow
STEP_TOL_HIGH, STEP_TOL_MEDIUM, ADAM_TOL, LAYOUT_TOL = 1e-5, 0.15, 1e-4, 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    from vime_shell.models.tiny_model import TinyModelSpec, build_tiny_hf_model

    root = tmp_path_factory.mktemp("muon")
    hf_dir = build_tiny_hf_model(root / "tiny-qwen2", TinyModelSpec(num_layers=2))
    return spawn(muon_worker, 2, str(hf_dir), str(root))


def _delta(a: dict, b: dict) -> float:
    """Max |a - b| over every weight (printed with the weight where it is reached)."""
    assert a.keys() == b.keys()
    deltas = {k: float(np.max(np.abs(a[k] - b[k]))) for k in a}
    worst = max(deltas, key=deltas.__getitem__)
    print(f"max |delta| = {deltas[worst]:.1e} at {worst}")
    return deltas[worst]


@pytest.mark.parametrize("name, tol", [("step_high", STEP_TOL_HIGH),
                                       ("step_high_nesterov_unsplit", STEP_TOL_HIGH),
                                       ("step_medium", STEP_TOL_MEDIUM)])
def test_one_step_equals_the_reference(runs, name, tol):
    out = runs[0][name]
    print(f"{name}: {out}")
    assert out["counts"] == {"muon": 8, "adam": 9}  # 4 matrices per layer; the rest Adam
    assert out["errors"]["muon_relative"] <= tol
    assert out["errors"]["adam"] <= ADAM_TOL


def test_blockwise_orthogonalises_each_tp_shard(runs):
    for rank in (0, 1):
        out = runs[rank]["tp2_blockwise_step"]
        assert out["counts"]["muon"] == 8
        assert out["errors"]["muon_relative"] <= STEP_TOL_HIGH
        assert out["errors"]["adam"] <= ADAM_TOL


@pytest.mark.parametrize("name", ["tp2", "dp2_overlap"])
def test_layouts_train_to_tp1_weights(runs, name):
    tp1 = runs[0]["tp1"]
    for rank in (0, 1):
        run = runs[rank][name]
        assert _delta(run["final"], tp1["final"]) <= LAYOUT_TOL
        assert np.allclose(run["losses"], tp1["losses"], rtol=0, atol=LAYOUT_TOL)


def test_resume_is_bit_identical(runs):
    for rank in (0, 1):
        run = runs[rank]["tp2"]
        resumed = run["resumed"]
        assert resumed["rng_restored"] and resumed["steps_done"] == 4
        assert resumed["losses"] == run["losses"][2:]
        for key, value in run["final"].items():
            assert np.array_equal(resumed["final"][key], value), key


def test_checkpoint_reshards_into_tp1(runs):
    out = runs[0]["tp2_into_tp1"]
    assert not out["rng_restored"] and out["steps_done"] == 4
    assert _delta(out["final"], runs[0]["tp1"]["final"]) <= LAYOUT_TOL


def test_adam_refuses_a_muon_checkpoint(runs):
    message = runs[0]["adam_refusal"]
    assert message.startswith("optimizer='adam': differs from the checkpoint's muon"), message
    assert "Fix: pass --optimizer muon" in message


def test_bf16_muon_updates_fp32_main_parameters(runs):
    """bf16 (the CUDA dtype; here on CPU): Muon sits in Megatron's Float16 wrapper, whose fp32
    main copies keep each weight's orthogonalisation layout, and the steps run finite."""
    out = runs[0]["bf16"]
    assert out["wrappers"] == ["Float16OptimizerWithFloat16Params"] * 2
    assert out["inner"] == ["Muon", "AdamW"]
    assert out["main_fp32_with_layout"]
    assert len(out["losses"]) == 2 and np.all(np.isfinite(out["losses"] + out["grad_norms"]))
