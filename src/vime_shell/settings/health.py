"""Health checks of the job's ranks (section ``rollout``; slime's and miles' flag names and
defaults): how often ranks are checked, when a silent one has stopped answering, the grace
before the first check. What they do: :mod:`vime_shell.engines.health`.

Example: ``HealthArgs(rollout_health_check_timeout=0)`` raises
``rollout_health_check_timeout=0: must be a positive number of seconds. Fix: ...``.
"""

import attrs

from vime_pure.errors import field_error
from vime_pure.health import FIRST_WAIT_TIMEOUTS, SLACK_TIMEOUTS, HealthPolicy, is_seconds
from vime_shell.settings.common import ConfigError, Record, setting

SECTION = "rollout"


def _f(default, help):
    return setting(default, help, SECTION)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class HealthArgs(Record):
    """slime's ``--rollout-health-check-*`` for every multi-rank job (vime has no
    ``/health_generate``: each rank's heartbeat answers, and each wait on another rank is
    bounded)."""

    rollout_health_check_interval: float = _f(
        30.0, "seconds between two checks of the other ranks' heartbeats (slime: between "
        "/health_generate checks)")
    rollout_health_check_timeout: float = _f(
        30.0, "a rank whose heartbeat stays still this many seconds stopped answering: the "
        "job ends with an error naming it on every rank (slime kills and, with "
        "--use-fault-tolerance, restarts the engine; vime cannot restart a rank of a "
        "torchrun job: resume with --load). A wait on another rank may last the slowest "
        f"such wait so far plus {SLACK_TIMEOUTS} times this")
    rollout_health_check_first_wait: float = _f(
        0.0, "grace in seconds before the first check (compilation, the first generation); "
        f"the first wait of each kind may last this plus {FIRST_WAIT_TIMEOUTS} times "
        "--rollout-health-check-timeout")

    def health_policy(self) -> HealthPolicy:
        return HealthPolicy(interval_s=float(self.rollout_health_check_interval),
                            timeout_s=float(self.rollout_health_check_timeout),
                            first_wait_s=float(self.rollout_health_check_first_wait))

    def _check(self) -> None:
        for name in ("rollout_health_check_interval", "rollout_health_check_timeout",
                     "rollout_health_check_first_wait"):
            zero_ok = name.endswith("first_wait")
            value = getattr(self, name)
            if not is_seconds(value, zero_ok=zero_ok):
                raise field_error(ConfigError, name, value,
                                  f"must be a {'' if zero_ok else 'positive '}number of "
                                  f"seconds{' (0 or more)' if zero_ok else ''}",
                                  f"e.g. {name}={attrs.fields_dict(HealthArgs)[name].default:g}")
