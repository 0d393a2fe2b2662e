"""A step-time estimate from a schedule and a FLOPs model: the slowest DP rank's training
FLOPs over the peak rate, stretched by the pipeline bubble.

- bubble fraction of a 1F1B pipeline with ``p`` stages, ``v`` virtual stages per rank and
  ``m`` micro-batches per rank: ``(p - 1) / (v * m + p - 1)`` of the step is idle (Megatron's
  interleaved schedule divides the bubble by ``v``);
- training FLOPs ~ 3 x forward (backward ~ 2 x forward); a DP rank's model-parallel group of
  ``pp * cp`` GPUs shares them (TP divides them further: pass the per-TP-rank peak);
- ``time = 3 * max_rank_forward_flops / (pp * cp * peak) / (1 - bubble)``; ``mfu`` scales the
  peak (0.4 is a typical achieved fraction).

Example: one rank of 2 micro-batches holding 3e15 forward FLOPs, pp 2, peak 1000 TFLOP/s,
mfu 1: the bubble is 1 / 3, the compute 4.5 s, the estimate 6.75 s.
"""

import attrs
import numpy as np

from vime_pure.errors import ScheduleError, field_error
from vime_pure.scheduling.flops import FlopsModel
from vime_pure.scheduling.schedule import Schedule


def bubble_fraction(pp: int, vpp: int, microbatches_per_rank: int) -> float:
    """Idle share of a pipelined step. Example: ``(2, 1, 2) == 1/3``, ``(1, 1, 8) == 0``."""
    if pp < 1 or vpp < 1 or microbatches_per_rank < 1:
        raise field_error(ScheduleError, "pp, vpp, microbatches",
                          (pp, vpp, microbatches_per_rank), "must all be >= 1",
                          "pass a valid layout and a non-empty step")
    return (pp - 1) / (vpp * microbatches_per_rank + pp - 1)


@attrs.frozen(kw_only=True)
class StepTime:
    step: int
    max_rank_flops: float  # forward FLOPs of the slowest DP rank
    bubble: float
    seconds: float


def step_times(schedule: Schedule, flops: FlopsModel, *, peak_tflops: float,
               mfu: float = 1.0) -> tuple[StepTime, ...]:
    """The estimate (module docstring) for every step of ``schedule``."""
    if not (peak_tflops > 0 and 0 < mfu <= 1):
        raise field_error(ScheduleError, "peak_tflops, mfu", (peak_tflops, mfu),
                          "need peak > 0 and 0 < mfu <= 1", "pass e.g. --peak-tflops 989")
    work = flops.per_sample(np.asarray(schedule.lengths, dtype=np.int64))
    lay = schedule.layout
    rate = peak_tflops * 1e12 * mfu * lay.pp * lay.cp
    out = []
    for k, step in enumerate(schedule.steps):
        ranks = [sum(float(work[list(mb)].sum()) for mb in rank) for rank in step.microbatches]
        top = max(ranks)
        bubble = bubble_fraction(lay.pp, lay.vpp, max(len(r) for r in step.microbatches))
        out.append(StepTime(step=k, max_rank_flops=top, bubble=bubble,
                            seconds=3.0 * top / rate / (1.0 - bubble)))
    return tuple(out)
