"""Muon's orthogonalisation on one matrix: the Newton-Schulz iteration and the update scale.

What Megatron-LM's ``--optimizer muon`` computes per 2-D weight (megatron-core 0.16's
``TensorParallelMuon`` over NVIDIA's ``emerging_optimizers``), written here from its
definition so that vime runs it on Python 3.11, where that package does not install:

- ``newton_schulz(x, steps)``: ``X = x / max(||x||_F, 1e-7)``, transposed when it has more rows
  than columns (the Gram matrix is then the smaller one), then per step ``A = X X^T``,
  ``X = a X + (b A + c A A) X`` with the quintic coefficient sets ``QUINTIC`` taken in turn
  (cycling after the fifth). The result's singular values lie near 1: an approximate
  ``U V^T`` of ``x = U S V^T``. ``bf16=True`` (Megatron's ``--muon-fp32-matmul-prec medium``)
  runs the iterations in bfloat16 after an fp32 normalisation, as Megatron does.
- ``muon_scale(rows, cols, mode)``: the factor on the orthogonalised update: ``spectral``
  ``sqrt(max(rows, cols))``, ``unit_rms_norm`` ``sqrt(rows / cols)``, ``shape_scaling``
  ``sqrt(max(1, rows / cols))``.

Example: ``newton_schulz(torch.randn(8, 4, dtype=torch.float64).float(), 5)`` has singular
values within about 0.3 of 1 (the quintic polynomial trades exactness for speed; Megatron's
choice). No torch.distributed here: the TP gathers are the optimizer's (vime_shell).
"""

import math

import torch
from torch import Tensor

from vime_pure.errors import VimeError, field_error

# (a, b, c) of X <- a X + b (X X^T) X + c (X X^T)^2 X, one set per step, cycled: the quintic
# sets of modded-nanogpt (K. Jordan), optimised by F. Cesista: Megatron's "quintic" default
QUINTIC: tuple[tuple[float, float, float], ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
NORM_EPS = 1e-7  # the normalisation's floor on the Frobenius norm


class MuonMathError(VimeError):
    """A Muon input that is not a float32 matrix, or an unknown scale mode."""


def newton_schulz(x: Tensor, steps: int, *, bf16: bool = False) -> Tensor:
    """The orthogonalised ``x`` (a float32 matrix), in float32 (module docstring)."""
    if x.ndim != 2 or x.dtype != torch.float32:
        raise field_error(MuonMathError, "x", f"{tuple(x.shape)} {x.dtype}",
                          "is not a float32 matrix", "pass the 2-D fp32 momentum")
    if steps < 1:
        raise field_error(MuonMathError, "steps", steps, "must be >= 1", "use 5")
    transpose = x.shape[0] > x.shape[1]
    X = x.T if transpose else x
    X = X / X.norm().clamp_min(NORM_EPS)
    if bf16:
        X = X.to(torch.bfloat16)
    for i in range(steps):
        a, b, c = QUINTIC[i % len(QUINTIC)]
        gram = X @ X.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A A, one rounding
        X = torch.addmm(X, poly, X, beta=a)
    X = X.to(torch.float32)
    return X.T if transpose else X


def muon_scale(rows: int, cols: int, mode: str) -> float:
    """The update scale of a ``rows x cols`` weight under ``mode`` (module docstring)."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    raise field_error(MuonMathError, "mode", mode,
                      "is not spectral, unit_rms_norm or shape_scaling", "use spectral")
