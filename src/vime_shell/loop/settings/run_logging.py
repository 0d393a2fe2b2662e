"""Where the run's metrics go and how much it prints (section ``logging``).

Example: ``LoggingArgs(log_interval=0)`` raises ``log_interval=0: must be >= 1 ...``.
"""

import attrs

from vime_shell.loop.settings.common import Record, at_least, setting

SECTION = "logging"
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning")


def _f(default, help, choices=None):
    return setting(default, help, SECTION, choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class LoggingArgs(Record):
    """The run directory, the log, TensorBoard and W&B."""

    run_dir: str = _f("runs/train", "metrics.jsonl, TensorBoard and plots go here (vime demo "
                      "uses runs/demo)")
    overwrite_run_dir: bool = _f(False, "a new run in a run dir that holds metrics moves them "
                                 "to <run-dir>/previous-<timestamp>/ (else: an error)")
    log_level: str = _f("info", "log level; debug logs on every rank", LOG_LEVELS)
    log_interval: int = _f(1, "rollouts between progress lines when stderr is not a terminal "
                           "(evals, skipped rollouts and the last rollout always print)")
    use_wandb: bool = _f(False, "also log to Weights & Biases (pip install vime[wandb])")
    wandb_project: str = _f("vime", "W&B project")
    wandb_group: str | None = _f(None, "W&B group")
    wandb_mode: str = _f("offline", "W&B mode; offline needs no network",
                         ("online", "offline", "disabled"))

    def _check(self) -> None:
        at_least("log_interval", self.log_interval, 1)
