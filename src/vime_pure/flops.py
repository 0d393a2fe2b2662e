"""Per-sample workload estimates used by FLOPs packing and balancing.

Forward FLOPs of a decoder on a sequence of ``L`` tokens have the form ``a*L + b*L**2``: the
linear term covers the projections, MLP and LM head, the quadratic term attention scores.
``proxy_flops`` uses the ratio ``b/a`` of a dense ~8B decoder (a = 1.514e10, b = 2.949e5),
normalised to ``a = 1``, for callers that do not pass a model-specific estimate.
"""

import numpy as np
from jaxtyping import Float64, Int

# b / a of a dense 8B decoder (hidden 4096, 36 layers, GQA 32/8, FFN 12288, vocab 151936).
PROXY_QUADRATIC_PER_LINEAR = 2.949e5 / 1.514e10


def proxy_flops(lengths: Int[np.ndarray, " n"]) -> Float64[np.ndarray, " n"]:
    """Relative forward cost ``L + (b/a) * L**2``; e.g. L=4096 gives 4096 * 1.0798 = 4422.8."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths + PROXY_QUADRATIC_PER_LINEAR * lengths * lengths
