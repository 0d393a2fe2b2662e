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

import importlib
from typing import Any

from vime_pure.config import BatchingPolicy, ParallelLayout, check_feasible
from vime_pure.errors import ScheduleError, VimeError
from vime_pure.invariants import ScheduleInvariantError
from vime_pure.denominators import group_mask_sums
from vime_pure.schedule import Schedule, StepPlan, build_schedule

# Names whose modules import torch (or are heavier); loaded on first attribute access so that
# ``import vime_pure`` stays torch-free and fast. Maps public name -> defining module.
_LAZY: dict[str, str] = {
    "FlopsModel": "vime_pure.flops",
}

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
    "group_mask_sums",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vime_pure' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
