"""``--optimizer muon``: its flags reach the trainer's ``MuonSettings``, the combinations it
does not run with fail at launch in one line naming the field, the value and the fix, and
the orthogonalisation (``vime_pure.torch_ops.muon``) has the properties Muon relies on.
The training itself (one step against a float64 reference, TP, resume): tests/shell/test_muon.py.
"""

import math

import pytest
import torch

from vime_pure.torch_ops.muon import MuonMathError, muon_scale, newton_schulz
from vime_shell.cli.main import main
from vime_shell.megatron.config import MuonSettings, OptimConfig, OptimConfigError
from vime_shell.run.components import trainer_config
from vime_shell.settings.flags import parse_train_config


def _exit(argv, capsys, tmp_path) -> tuple[int, str]:
    try:
        status = main(["train", "--dry-run", "--run-dir", str(tmp_path), *argv])
    except SystemExit as exc:  # argparse's own errors exit from the parser
        status = exc.code
    return status, capsys.readouterr().err.strip()


def test_muon_flags_reach_the_trainer():
    cfg = parse_train_config(["--optimizer", "muon", "--muon-momentum", "0.95",
                              "--muon-no-split-qkv", "--muon-nesterov", "--muon-scale-mode",
                              "unit_rms_norm", "--muon-fp32-matmul-prec", "high",
                              "--muon-num-ns-steps", "6", "--muon-tp-mode", "blockwise",
                              "--muon-extra-scale-factor", "0.2"])
    optim = trainer_config(cfg).optim
    assert optim.optimizer == "muon"
    assert optim.muon == MuonSettings(momentum=0.95, split_qkv=False, nesterov=True,
                                      scale_mode="unit_rms_norm", fp32_matmul_prec="high",
                                      num_ns_steps=6, tp_mode="blockwise",
                                      extra_scale_factor=0.2)
    assert trainer_config(parse_train_config([])).optim.optimizer == "adam"


@pytest.mark.parametrize("argv, line", [
    (["--optimizer", "muon", "--use-distributed-optimizer"],
     "--optimizer='muon': runs without the distributed optimizer"),
    (["--optimizer", "muon", "--train-backend", "fsdp"],  # miles' FSDP turns it on
     "--optimizer='muon': runs without the distributed optimizer"),
    (["--optimizer", "muon", "--lora-rank", "8", "--target-modules", "all-linear"],
     "--optimizer='muon': does not train LoRA adapters (--lora-rank 8)"),
    (["--optimizer", "muon", "--muon-momentum", "1.0"],
     "--muon-momentum=1.0: must be in [0, 1). Fix: use e.g. 0.9 or 0.95."),
    (["--optimizer", "muon", "--muon-num-ns-steps", "0"],
     "--muon-num-ns-steps=0: must be in [1, 100]. Fix: use 5."),
    (["--muon-tp-mode", "distributed"], "--muon-tp-mode distributed: not supported in vime "
     "(Newton-Schulz with all-reduced Gram matrices; --muon-tp-mode duplicated gives"),
    (["--muon-fp32-matmul-prec", "low"], "--muon-fp32-matmul-prec low: not supported in vime"),
    (["--optimizer", "dist_muon"], "--optimizer dist_muon: not supported in vime (Megatron's "
     "layer-wise distributed Muon; vime's Muon runs without the distributed optimizer: use "
     "--optimizer muon)"),
])
def test_unsupported_combinations_fail_at_launch_in_one_line(argv, line, capsys, tmp_path):
    status, err = _exit(argv, capsys, tmp_path)
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"vime train: error: {line}"), err


def test_muon_with_cpu_offload_names_the_fix():
    with pytest.raises(OptimConfigError, match=r"^optimizer='muon': has no CPU-offloaded form "
                       r".*Fix: drop --optimizer-cpu-offload, or use --optimizer adam\.$"):
        OptimConfig(optimizer="muon", optimizer_cpu_offload=True)


def test_muon_flags_at_their_defaults_change_nothing_under_adam(capsys, tmp_path):
    """miles' script passes --muon-momentum 0.9 only with MILES_OPTIMIZER=muon; with Adam a
    Muon flag is a setting no step reads, never an error."""
    status, err = _exit(["--muon-momentum", "0.9"], capsys, tmp_path)
    assert status == 0, err


@pytest.mark.parametrize("shape", [(48, 16), (16, 16), (16, 48)])
def test_newton_schulz_gives_singular_values_near_one(shape):
    """The quintic iteration's output: ``U S' V^T`` with ``S'`` near 1 (about 0.7 - 1.2 for
    Megatron's coefficients), the singular vectors of the input kept."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g)
    out = newton_schulz(x, 5).double()
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    s = torch.linalg.svdvals(out)
    assert float(s.min()) > 0.6 and float(s.max()) < 1.25, s
    projected = u.T @ out @ vh.T  # diagonal when the singular vectors are kept
    off = projected - torch.diag(torch.diagonal(projected))
    assert float(off.abs().max()) < 1e-5


def test_newton_schulz_transposes_a_tall_matrix_and_ignores_its_norm():
    x = torch.randn(40, 12, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(newton_schulz(x, 5), newton_schulz(x.T.contiguous(), 5).T,
                          atol=1e-6)
    assert torch.allclose(newton_schulz(x, 5), newton_schulz(x * 1e3, 5), atol=1e-5)
    bf16 = newton_schulz(x, 5, bf16=True)
    assert bf16.dtype == torch.float32 and 0 < float((bf16 - newton_schulz(x, 5)).abs().max()) < 0.05


def test_update_scale_by_mode():
    assert muon_scale(128, 32, "spectral") == math.sqrt(128)
    assert muon_scale(32, 128, "unit_rms_norm") == 0.5
    assert muon_scale(32, 128, "shape_scaling") == 1.0
    assert muon_scale(128, 32, "shape_scaling") == 2.0
    with pytest.raises(MuonMathError, match="mode='rms'"):
        muon_scale(4, 4, "rms")
    with pytest.raises(MuonMathError, match="is not a float32 matrix"):
        newton_schulz(torch.zeros(2, 2, 2), 5)
