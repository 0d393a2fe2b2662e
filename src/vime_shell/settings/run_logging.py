"""Where the run's metrics go and how much it prints (section ``logging``). The W&B flags are
slime's; its ``--wandb-key`` is no setting: it goes to ``WANDB_API_KEY`` only
(``settings.flags``), so no dump of the settings can hold it.

Example: ``LoggingArgs(log_interval=0)`` raises ``log_interval=0: must be >= 1 ...``.
"""

import attrs

from vime_shell.settings.common import Record, at_least, setting

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
    wandb_team: str | None = _f(None, "W&B entity (team or user)")
    wandb_host: str | None = _f(None, "W&B server URL (default W&B's own)")
    wandb_dir: str | None = _f(None, "where W&B writes its files; default the run directory")
    wandb_run_id: str | None = _f(None, "W&B run id to log into (resumed if it exists; slime "
                                  "sets it itself for its other ranks, vime logs from rank 0)")
    disable_wandb_random_suffix: bool = _f(False, "use --wandb-group as given for the W&B "
                                           "group and run name (else, as slime, a random "
                                           "6-character suffix is added)")

    def _check(self) -> None:
        at_least("log_interval", self.log_interval, 1)
