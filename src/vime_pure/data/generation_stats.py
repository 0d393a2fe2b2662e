"""How one rollout's responses ended and how long they ran: the truncation rate and the
response-length distribution, per sample.

Why: a response that never meets a stop token runs to the length limit and is graded on what
follows the end of its turn; a truncation rate near 1 is the visible sign.
Example: response lengths [2, 8, 8, 4] with statuses completed, truncated, truncated,
completed give ``truncated_frac 0.5``, ``response_len_p50 6.0``, ``response_len_max 8``.
"""

import numpy as np
from jaxtyping import Int64, UInt8

from vime_pure.data.sample import STATUSES, Status

_TRUNCATED = STATUSES.index(Status.TRUNCATED)
_ABORTED = STATUSES.index(Status.ABORTED)


def response_length_stats(response_lengths: Int64[np.ndarray, " n"],
                          statuses: UInt8[np.ndarray, " n"]) -> dict[str, float | None]:
    """``truncated_frac``, ``aborted_frac`` and the response length's min, p10, p50, p90 and
    max over samples (None for an empty batch: nothing measured, never a NaN)."""
    lengths = np.asarray(response_lengths, dtype=np.float64)
    codes = np.asarray(statuses)
    if not lengths.size:
        return dict.fromkeys(("truncated_frac", "aborted_frac", "response_len_min",
                              "response_len_p10", "response_len_p50", "response_len_p90",
                              "response_len_max"))
    p10, p50, p90 = np.percentile(lengths, [10, 50, 90])
    return {"truncated_frac": float(np.mean(codes == _TRUNCATED)),
            "aborted_frac": float(np.mean(codes == _ABORTED)),
            "response_len_min": float(lengths.min()), "response_len_p10": float(p10),
            "response_len_p50": float(p50), "response_len_p90": float(p90),
            "response_len_max": float(lengths.max())}
