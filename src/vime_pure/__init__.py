"""vime_pure: the functional core of vime.

Pure, side-effect-free functions and frozen records. The scheduler imports neither torch nor
Megatron, so analysis scripts import it in milliseconds; torch-based parts (loss accounting)
load lazily on first use of their names.

Example::

    from vime_pure import BatchingPolicy, ParallelLayout, build_schedule
    sched = build_schedule([900, 300, 700, 200], ["a", "a", "b", "c"],
                           ParallelLayout(dp=2), BatchingPolicy(global_batch_size=3,
                                                                max_tokens_per_gpu=1000))
    sched.steps[0].num_microbatches  # 2 micro-batches per rank
"""

from vime_pure.config import BatchingPolicy, ParallelLayout, check_feasible
from vime_pure.errors import ScheduleError, VimeError
from vime_pure.invariants import ScheduleInvariantError
from vime_pure.schedule import Schedule, StepPlan, build_schedule

__all__ = [
    "BatchingPolicy",
    "ParallelLayout",
    "Schedule",
    "ScheduleError",
    "ScheduleInvariantError",
    "StepPlan",
    "VimeError",
    "build_schedule",
    "check_feasible",
]
