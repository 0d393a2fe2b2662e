"""``LaunchPlan``: what ``vime_shell.run.launch_checks`` resolved before a model is built (the
model directory, the layouts, the batching policy, the prompts and eval sets), read by the
rollout side, the step and the driver alike, so it sits with the settings below all three.
"""

from pathlib import Path

import attrs

from vime_pure.config import BatchingPolicy
from vime_pure.errors import field_error
from vime_shell.engines.layout import EngineLayout
from vime_shell.engines.roles import RankRoles
from vime_shell.megatron.layout import TrainLayout
from vime_shell.rollout.tasks import DigitTask, TaskExample
from vime_shell.settings.common import ConfigError


@attrs.frozen(kw_only=True)
class LaunchPlan:
    """What the checks resolved: the model directory, the layout, the batching policy, and
    the prompts (dataset rows, or the built-in task) and eval sets."""

    hf_dir: Path
    layout: TrainLayout
    policy: BatchingPolicy
    prompts: tuple[TaskExample, ...] | None
    task: DigitTask | None
    eval_sets: tuple[tuple[str, tuple[TaskExample, ...]], ...]
    num_rollout: int  # --num-rollout, or what --num-epoch needs for the dataset
    engine_layout: EngineLayout | None  # None: a train-only replay builds no engine
    run_id: str  # the checkpoint's when resuming, else new (vime_shell.run.ownership)
    prompts_dropped: int = 0  # dataset rows longer than --rollout-max-prompt-len
    vocab_size: int | None = None  # the model's embedding rows: every token id is below it
    roles: RankRoles | None = None  # separate trainer and engine ranks (engines/roles.py)

    def built_engine_layout(self, what: str) -> EngineLayout:
        """The engine layout, for ``what``, which builds the engines (a train-only replay has
        none). Example: ``plan.built_engine_layout("--debug-rollout-only")``."""
        if self.engine_layout is None:
            raise field_error(ConfigError, "--load-rollout-data-mode", "train-only",
                              f"builds no rollout engine, which {what} needs",
                              "pass --load-rollout-data-mode forge, or drop --load-rollout-data")
        return self.engine_layout
