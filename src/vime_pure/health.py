"""When a silent rank counts as stopped, and how long a wait on another rank may last: the
pure decisions of the health checks (the monitor that beats, watches and ends ranks is
:mod:`vime_shell.engines.health`).

slime's and miles' flags (``--rollout-health-check-*``), as vime reads them. Every rank of a
multi-rank job beats: a thread adds 1 to its counter in the job's store every
:attr:`HealthPolicy.beat_s`. A watcher reads the counters of the ranks it watches every
``interval_s`` (``--rollout-health-check-interval``); a rank whose counter has not moved for
more than ``timeout_s`` (``--rollout-health-check-timeout``) has **stopped answering**. No
rank is judged before ``first_wait_s`` (``--rollout-health-check-first-wait``) has passed
since the watcher started, and silence is counted from then at the earliest, so a rank is
judged at most ``first_wait + timeout + interval`` seconds after its last beat. A rank that
has never beaten (it is still importing or building) is judged only after
``first_wait + FIRST_WAIT_TIMEOUTS x timeout`` (an hour at the default timeout).

A heartbeat proves a rank alive, not that it makes progress (a rank stuck in a driver call
keeps beating). So every wait on another rank's reply is bounded too, by what was seen
before (:class:`WaitHistory`): the first wait of its kind may last ``first_wait +
FIRST_WAIT_TIMEOUTS x timeout`` (engine start, compilation, the first long rollout), every
later one the slowest of its kind so far plus ``SLACK_TIMEOUTS x timeout`` (five minutes
past the slowest at the default timeout of 30 s). Raising the timeout raises every bound.

Example: policy ``(interval 1, timeout 5, first wait 0)``; ranks 1 and 2 watched from t=0;
rank 1 beats at t=3, rank 2 never after t=0 with count 4: at t=6, rank 2 is stopped (silent
6 s > 5), rank 1 is not (silent 3 s). A kind whose slowest wait took 2 s may wait 52 s.
"""

import math
from collections.abc import Iterable, Mapping

import attrs

FIRST_WAIT_TIMEOUTS = 120  # the first wait of a kind: first wait + 120 x timeout (1 h at 30 s)
SLACK_TIMEOUTS = 10  # a later wait: the slowest so far + 10 x timeout (5 min at 30 s)
BEAT_MAX_S = 1.0  # a rank beats at least this often (cheap: one store add)


@attrs.frozen
class HealthPolicy:
    """The three health-check flags, in seconds (module docstring). Defaults: slime's and
    miles' (``30``, ``30``, ``0``)."""

    interval_s: float = 30.0
    timeout_s: float = 30.0
    first_wait_s: float = 0.0

    @property
    def beat_s(self) -> float:
        """How often a rank beats: four beats per timeout, at least one a second."""
        return min(BEAT_MAX_S, self.timeout_s / 4)

    @property
    def first_bound_s(self) -> float:
        """The first wait of a kind, and the longest a rank may go without a first beat."""
        return self.first_wait_s + FIRST_WAIT_TIMEOUTS * self.timeout_s


@attrs.frozen
class Liveness:
    """What a watcher knows of the ranks it watches: each one's last heartbeat count (0: none
    yet) and the watcher's time when that count last changed (``started_s`` until then)."""

    started_s: float
    counts: Mapping[int, int]
    changed_s: Mapping[int, float]


def liveness_from(ranks: Iterable[int], now_s: float) -> Liveness:
    """Start watching ``ranks`` at ``now_s``: nothing seen yet."""
    ranks = tuple(ranks)
    return Liveness(started_s=now_s, counts={r: 0 for r in ranks},
                    changed_s={r: now_s for r in ranks})


def observe(liveness: Liveness, counts: Mapping[int, int], now_s: float) -> Liveness:
    """The heartbeat counts read at ``now_s`` (ranks not read keep what was known): a count
    that moved marks its rank alive at ``now_s``. Clocks never cross ranks: only this
    watcher's clock and the counters' changes are compared."""
    new_counts = dict(liveness.counts)
    changed = dict(liveness.changed_s)
    for rank, count in counts.items():
        if count != new_counts.get(rank, 0):
            new_counts[rank], changed[rank] = count, now_s
    return attrs.evolve(liveness, counts=new_counts, changed_s=changed)


def stopped_ranks(liveness: Liveness, now_s: float, policy: HealthPolicy
                  ) -> tuple[tuple[int, float], ...]:
    """``(rank, seconds silent)`` of every watched rank that has stopped answering at
    ``now_s``, rank order (module docstring: silence counts from the end of the first wait;
    a rank that never beat gets :attr:`HealthPolicy.first_bound_s`)."""
    checks_from = liveness.started_s + policy.first_wait_s
    if now_s < checks_from:
        return ()
    out = []
    for rank in sorted(liveness.counts):
        if liveness.counts[rank] == 0:  # never beat: still starting, or dead before its first
            silent = now_s - liveness.started_s
            if silent > policy.first_bound_s:
                out.append((rank, silent))
            continue
        silent = now_s - max(liveness.changed_s[rank], checks_from)
        if silent > policy.timeout_s:
            out.append((rank, now_s - liveness.changed_s[rank]))
    return tuple(out)


@attrs.frozen
class WaitHistory:
    """The slowest completed wait of one kind so far (None: none yet), and the bound it
    gives the next one (module docstring). Example: ``WaitHistory().seen(2.0).bound_s(
    HealthPolicy(timeout_s=5))`` is ``52.0``."""

    slowest_s: float | None = None

    def seen(self, elapsed_s: float) -> "WaitHistory":
        """After a wait of ``elapsed_s`` completed."""
        if self.slowest_s is not None and self.slowest_s >= elapsed_s:
            return self
        return WaitHistory(slowest_s=float(elapsed_s))

    def bound_s(self, policy: HealthPolicy) -> float:
        if self.slowest_s is None:
            return policy.first_bound_s
        return self.slowest_s + SLACK_TIMEOUTS * policy.timeout_s

    def explain(self, policy: HealthPolicy) -> str:
        """How :meth:`bound_s` was derived, in flags. Example: ``"the slowest such wait so far
        (2.0 s) plus 10 x --rollout-health-check-timeout=5 (52.0 s)"``."""
        timeout = f"--rollout-health-check-timeout={policy.timeout_s:g}"
        bound = f"{self.bound_s(policy):.1f} s"
        if self.slowest_s is None:
            return (f"the first wait of its kind: --rollout-health-check-first-wait="
                    f"{policy.first_wait_s:g} plus {FIRST_WAIT_TIMEOUTS} x {timeout} ({bound})")
        return (f"the slowest such wait so far ({self.slowest_s:.1f} s) plus {SLACK_TIMEOUTS} x "
                f"{timeout} ({bound})")


def is_seconds(value: object, *, zero_ok: bool) -> bool:
    """A finite number of seconds, positive (or >= 0 with ``zero_ok``); bools are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
