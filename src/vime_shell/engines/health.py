"""Health checks of a multi-rank job: heartbeats, a watcher that ends the job when a rank stops
answering, and waits on other ranks in short slices with a bound (slime's and miles'
``--rollout-health-check-interval`` / ``-timeout`` / ``-first-wait``; the decisions are
:mod:`vime_pure.health`).

**Heartbeats.** Every rank of a job with separate engine ranks (from
:func:`vime_shell.engines.remote.open_sides`) or with a colocated engine group of more than one
rank (:meth:`vime_shell.engines.group.EngineGroup.build`) runs one :class:`HealthMonitor`: a
daemon thread adds 1 to ``vime/health/beat/<global rank>`` in the job's store, on a store
connection of its own (a main thread waiting in the store never delays a beat). SIGSTOP, a
crash, or a call that holds the GIL stops the beats; a rank blocked in a C-level wait that
releases the GIL (gloo, NCCL, the store) keeps beating, which is why waits are bounded too.

**Watching.** While a run watches (:meth:`HealthMonitor.watch`, with the run's flags and how
to name a rank), global rank 0 checks every other rank and every other rank checks rank 0,
every ``interval`` seconds. A rank that stopped answering (``vime_pure.health.stopped_ranks``)
gets a :class:`HealthCheckError` naming it by role (``engine rank 1 (global rank 2)``),
published once under ``vime/health/verdict`` (the first verdict wins); every watching rank
reads the verdict at its next check. A rank whose process ends normally marks itself left
(``atexit``), so finishing first is never a failure.

**Ending a rank.** gloo cannot abort a wait (``ProcessGroupGloo.abort`` is a no-op on CPU,
measured on torch 2.13), so vime's own waits on another rank never block for long: they run in
slices of :data:`SLICE_S` (:func:`wait_until`; a collective's work waits with a timeout, which
leaves it running; a point-to-point wait, whose timeout would close the pair, waits in a thread
of its own), and between slices the verdict is raised in the main thread, as a typed error the
CLI prints as one line. Waits outside vime's code (Megatron's collectives, ``gather_object``)
cannot be sliced, and a process group whose peer is stopped blocks its destructor at exit. So
on a verdict the monitor also starts a non-daemon *reaper*: as soon as the main thread has
finished (the error printed), or after a grace of ``interval + timeout`` (at least
:data:`MIN_GRACE_S`) if it is still blocked, the reaper flushes the logs and ends the process
with ``os._exit(2)`` (the CLI's status for a typed error), after printing the verdict itself
when the main thread could not. Global rank 0, which serves the job's store when ``torchrun``
did not launch the job, first stays up one check interval, so every rank reads the verdict.
slime's ``--use-fault-tolerance`` restarts a dead engine; a rank of a ``torchrun`` job cannot
be restarted, so vime accepts the flag with a note and ends the job (resume with ``--load``).

**Bounds.** A wait passes its bound (``vime_pure.health.WaitHistory``: the slowest wait of its
kind so far plus 10 timeouts, the first one the first wait plus 120 timeouts) -> a
:class:`HealthCheckError` saying who waited, for what, on which rank, how the bound was
derived and which flag raises it, published as the job's verdict (every rank ends).

Example: engine rank 1 (global rank 2) of a 3-rank ``--fully-async`` job is stopped with
SIGSTOP; at most ``timeout + interval`` later rank 0 publishes ``engine rank 1 (global rank 2)
stopped answering: no heartbeat for 5.3 s ...``; trainer rank 0, waiting for that rank's part,
raises it; engine rank 0 raises it in its pool loop; each prints it and exits with status 2.
"""

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import attrs
import torch.distributed as dist

from vime_pure.errors import VimeError
from vime_pure.health import (HealthPolicy, Liveness, WaitHistory, liveness_from, observe,
                              stopped_ranks)
from vime_shell.engines.reaper_mark import ENDS_PROCESS, REAPER_NAME

log = logging.getLogger("vime.train")

SLICE_S = 0.25  # the longest a vime wait on another rank blocks between two health checks
MIN_GRACE_S = 10.0  # the least time a blocked main thread gets to raise a verdict itself
EXIT_STATUS = 2  # a typed error's status (vime_shell.cli.main)
STORE_TIMEOUT_S = 5.0  # one store operation of the monitor's own connection
PG_BACKSTOP_S = 3 * 3600.0  # process groups' own timeout: a backstop the bounded waits preempt
_KEYS = "vime/health"
VERDICT_KEY = f"{_KEYS}/verdict"



class HealthCheckError(VimeError):
    """A rank of the job stopped answering, or a wait on one passed its bound (named by role
    and global rank, with the flag that raises the bound)."""


def beat_key(rank: int) -> str:
    return f"{_KEYS}/beat/{rank}"


def left_key(rank: int) -> str:
    return f"{_KEYS}/left/{rank}"


def rank_name(rank: int) -> str:
    """How a rank is named when nothing more is known. Example: ``"global rank 3"``."""
    return f"global rank {rank}"


class HealthMonitor:
    """This process's heartbeat and, while a run watches, its judge of other ranks (module
    docstring). ``tick(now)`` is one beat (and a check when one is due): the thread calls it,
    tests call it with their own clock and store (and ``reap=False``: a verdict then ends
    nothing)."""

    def __init__(self, store: Any, rank: int, world: int, *,
                 clock: Callable[[], float] = time.monotonic, reap: bool = True):
        self.store, self.rank, self.world, self.clock = store, rank, world, clock
        self.reap = reap
        self.watched = tuple(range(1, world)) if rank == 0 else (0,)
        self.policy = HealthPolicy()
        self.name_of: Callable[[int], str] = rank_name
        self.watching = False
        self.liveness: Liveness | None = None
        self.verdict: HealthCheckError | None = None
        self._next_check = 0.0
        self._store_failing_since: float | None = None
        self._retry_at = 0.0
        self._pause = 0.0  # after a store failure: how long until the next try
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._reaper: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "HealthMonitor":
        """Beat now (a rank that ever started is known to watchers, however soon it stops)
        and from now on, in a daemon thread; mark this rank left when the process exits."""
        self.tick(self.clock())
        threading.Thread(target=self._run, daemon=True, name="vime-health").start()
        atexit.register(self.leave)
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self.policy.beat_s):
            self.tick(self.clock())

    def watch(self, policy: HealthPolicy, name_of: Callable[[int], str] = rank_name) -> None:
        """A run starts: judge the watched ranks under ``policy`` from now on."""
        with self._lock:
            self.policy, self.name_of = policy, name_of
            now = self.clock()
            self.liveness = liveness_from(self.watched, now)
            self._next_check = now + policy.interval_s
            self.watching = True

    def unwatch(self) -> None:
        """The run ends here: judge nobody (other ranks may finish later, or first)."""
        with self._lock:
            self.watching = False

    def leave(self) -> None:
        """This process ends normally: watchers stop judging it."""
        self._stopped.set()
        with contextlib.suppress(Exception):  # the store may be gone already
            self.store.set(left_key(self.rank), "1")

    # -- one beat -----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self.verdict is not None or now < self._retry_at:
            return  # the process is ending; or the store failed a moment ago
        try:
            self.store.add(beat_key(self.rank), 1)
            if self.watching and now >= self._next_check:
                self._check(now)
            self._store_failing_since = None
        except Exception as exc:  # noqa: BLE001 - a store that stops answering is judged too
            self._store_failed(now, exc)

    def _check(self, now: float) -> None:
        with self._lock:
            if not self.watching or self.liveness is None:  # watch() sets both together
                return
            self._next_check = now + self.policy.interval_s
            counts = {r: int(self.store.add(beat_key(r), 0)) for r in self.watched}
            self.liveness = observe(self.liveness, counts, now)
            stopped = [(r, s) for r, s in stopped_ranks(self.liveness, now, self.policy)
                       if not self.store.check([left_key(r)])]
        if stopped:
            self.fail(HealthCheckError(self._stopped_message(stopped)))
        elif self.store.check([VERDICT_KEY]):
            self._learn(self.store.get(VERDICT_KEY).decode())

    def _stopped_message(self, stopped: list[tuple[int, float]]) -> str:
        p = self.policy
        who = " and ".join(self.name_of(r) for r, _ in stopped)
        silences = " and ".join(f"{s:.1f} s" for _, s in stopped)
        return (f"{who} stopped answering: no heartbeat for {silences} "
                f"(--rollout-health-check-timeout={p.timeout_s:g}, checked every "
                f"{p.interval_s:g} s by {self.name_of(self.rank)}). Fix: see that rank's own "
                "log and process (a crash, SIGSTOP, or a call that holds the GIL); resume with "
                "--load from the last checkpoint, or raise --rollout-health-check-timeout if "
                "it is only slow")

    def _store_failed(self, now: float, exc: Exception) -> None:
        """Retry after a pause (each failed operation logs a C++ warning): a beat's period
        while watching, doubling up to a minute between runs (a store gone with the process
        that served it). While watching, a store silent for a timeout is a verdict of its own
        (it cannot be published)."""
        self._pause = (min(self.policy.interval_s, self.policy.beat_s) if self.watching
                       else min(max(2 * self._pause, 1.0), 60.0))
        self._retry_at = now + self._pause
        if not self.watching:
            return
        if self._store_failing_since is None:
            self._store_failing_since = now
        elif now - self._store_failing_since > self.policy.timeout_s:
            self._learn(f"the job's store (served by global rank 0's process or torchrun's "
                        f"agent) stopped answering {self.name_of(self.rank)} for "
                        f"{now - self._store_failing_since:.1f} s ({type(exc).__name__}: "
                        f"{str(exc)[:120]}). Fix: see global rank 0's log and process; resume "
                        "with --load from the last checkpoint")

    # -- verdicts -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the job's verdict here, if there is one (a wait's slice ended)."""
        if self.verdict is not None:
            raise self.verdict

    def fail(self, error: HealthCheckError) -> None:
        """Publish ``error`` as the job's verdict (unless one came first: that one stands),
        then end this rank (module docstring)."""
        message = str(error)
        with contextlib.suppress(Exception):  # a store that is gone: the verdict stays local
            message = self.store.compare_set(VERDICT_KEY, "", message).decode()
        self._learn(message)

    def _learn(self, message: str) -> None:
        with self._lock:
            if self.verdict is not None:
                return
            self.verdict = HealthCheckError(message)
            if not self.reap:
                return
            grace = max(self.policy.interval_s + self.policy.timeout_s, MIN_GRACE_S)
            self._reaper = threading.Thread(target=self._reap, args=(grace,), daemon=False,
                                            name=REAPER_NAME)
            setattr(self._reaper, ENDS_PROCESS, True)
            self._reaper.start()

    def _reap(self, grace_s: float) -> None:
        """End the process once the main thread is done, or ``grace_s`` after the verdict
        if it is still blocked (in a wait vime cannot slice, or in a destructor). A process
        that serves the job's store (global rank 0 outside torchrun, whose agent serves it
        otherwise) first stays up one check interval, so every rank reads the verdict."""
        start = time.monotonic()
        main = threading.main_thread()
        main.join(grace_s)
        if serves_store(self.rank):
            time.sleep(max(0.0, self.policy.interval_s + 1.0 - (time.monotonic() - start)))
        if main.is_alive():
            print(f"vime train [rank {self.rank}]: error: {self.verdict} (ending "
                  f"{self.name_of(self.rank)}: {grace_s:.0f} s after the verdict it was "
                  "still blocked in a call that waits on that rank)", file=sys.stderr)
        _flush()
        os._exit(EXIT_STATUS)


def serves_store(rank: int) -> bool:
    """Whether this process serves the job's TCP store: global rank 0 of an ``env://`` job
    that ``torchrun`` did not launch (torchrun's agent serves it then)."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _flush() -> None:
    for handler in logging.getLogger("vime").handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class _NoMonitor:
    """A single-rank job: nothing to watch, nothing can stop answering."""

    rank, watching, verdict = 0, False, None
    policy = HealthPolicy()

    @staticmethod
    def name_of(rank: int) -> str:
        return rank_name(rank)

    def check(self) -> None:
        pass

    def fail(self, error: HealthCheckError) -> None:
        pass

    def unwatch(self) -> None:
        pass


_MONITOR: HealthMonitor | None = None


def current() -> "HealthMonitor | _NoMonitor":
    """This process's monitor (a stand-in that never fails in a single-rank job)."""
    return _MONITOR or _NoMonitor()


def ensure_monitor(store: Any, rank: int, world: int) -> HealthMonitor | None:
    """This process's monitor, started on the first call with a world of more than one rank
    (``rank`` and ``world`` global: a later call from inside one side of the job, an engine
    group on the engine ranks' own group, finds the job's monitor)."""
    global _MONITOR
    if _MONITOR is None and world > 1:
        _MONITOR = HealthMonitor(monitor_store(store), rank, world).start()
    return _MONITOR


def monitor_store(store: Any) -> Any:
    """A connection of the monitor's own to the job's TCP store (its keys unprefixed), so a
    main thread waiting in the store never delays a beat; other stores are shared."""
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        return dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=STORE_TIMEOUT_S))
    return base


def begin_watch(policy: HealthPolicy, name_of: Callable[[int], str]) -> bool:
    """A run starts watching, unless it already does (an engine group inside a run with
    separate engine ranks): True when this call started it (end it with :func:`end_watch`)."""
    monitor = current()
    if not isinstance(monitor, HealthMonitor) or monitor.watching:
        return False
    monitor.watch(policy, name_of)
    return True


def end_watch(started: bool) -> None:
    """The run that ``begin_watch`` returned ``started`` for ends."""
    if started:
        current().unwatch()


@contextlib.contextmanager
def watching(policy: HealthPolicy, name_of: Callable[[int], str]) -> Iterator[None]:
    """:func:`begin_watch` for the block."""
    started = begin_watch(policy, name_of)
    try:
        yield
    finally:
        end_watch(started)


# -- bounded waits --------------------------------------------------------------------------
@attrs.frozen
class WaitBound:
    """A wait's limit: ``limit_s`` seconds from ``start`` (monotonic), as ``why`` explains.
    Build with :func:`wait_bound`."""

    start: float
    limit_s: float
    why: str

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def wait_bound(history: WaitHistory, policy: HealthPolicy) -> WaitBound:
    """The bound of a wait that starts now, from its kind's history."""
    return WaitBound(start=time.monotonic(), limit_s=history.bound_s(policy),
                 why=history.explain(policy))


def wait_until(done: Callable[[float], bool], what: str | Callable[[], str],
               bound: WaitBound | None = None) -> None:
    """Call ``done(slice_s)`` (True once the awaited thing happened; it may block up to the
    slice) until it returns True. Between slices: the job's verdict is raised; past
    ``bound`` a :class:`HealthCheckError` naming ``what`` (or what it returns, then) is
    published and raised. Without a bound only the health checks end the wait (e.g. an
    engine rank waiting for the trainer's next command: training, saving and evaluating come
    between two commands)."""
    monitor = current()
    monitor.check()  # never start a wait on a job that is ending
    while not done(SLICE_S):
        monitor.check()
        if bound is not None and bound.elapsed() > bound.limit_s:
            awaited = what() if callable(what) else what
            error = HealthCheckError(
                f"{monitor.name_of(monitor.rank)} waited {bound.elapsed():.1f} s for {awaited}, "
                f"longer than {bound.why}. Fix: raise --rollout-health-check-timeout if that "
                "rank is only slow, or see why it makes no progress (its log; a call that "
                "never returns)")
            monitor.fail(error)
            raise error


def collective_done(work: Any) -> Callable[[float], bool]:
    """``done`` for a collective's work (a gloo broadcast): its own wait with a timeout, which
    leaves the operation running (a real failure is raised).

    A timed wait that raises says only that the slice ran out, not that the operation failed:
    it may complete between that wait and ``is_completed`` (seen about once per 130 slices of
    1 ms on a loaded machine). So a work found completed is waited for again, untimed: that
    returns at once, or raises the operation's own failure. Raising the slice's "timed out"
    instead failed a healthy bridge on one rank while its peer went on, and the peer then
    read the next message into the wrong buffer (gloo: "27 vs 8 ... collective mismatch")."""
    def done(slice_s: float) -> bool:
        try:
            work.wait(timedelta(seconds=slice_s))
        except RuntimeError:
            if not work.is_completed():
                return False
            work.wait()
        return True

    return done


def polled_done(work: Any) -> Callable[[float], bool]:
    """``done`` for an NCCL work: ``is_completed`` polled (it queries the GPU, never blocks;
    NCCL's own timed wait may tear the communicator down), then ``wait`` (the current stream
    waits for the operation's)."""
    def done(slice_s: float) -> bool:
        end = time.monotonic() + slice_s
        pause = 0.0005
        while not work.is_completed():
            if time.monotonic() >= end:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        work.wait()
        return True

    return done


def thread_done(wait: Callable[[], Any]) -> Callable[[float], bool]:
    """``done`` for a blocking ``wait()`` that cannot time out without harm (a gloo send or
    recv: a timed-out wait closes the pair), run in a daemon thread of its own; a wait the
    caller gives up on stays blocked there until the process ends."""
    finished = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            wait()
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread below
            failure.append(exc)
        finally:
            finished.set()

    threading.Thread(target=run, daemon=True, name="vime-wait").start()

    def done(slice_s: float) -> bool:
        if not finished.wait(slice_s):
            return False
        if failure:
            raise failure[0]
        return True

    return done


def keys_done(store: Any, keys: list[str], *, max_pause_s: float = 0.05
              ) -> Callable[[float], bool]:
    """``done`` once every key of ``keys`` is in ``store``: polled with ``check``, pauses
    doubling from 1 ms to ``max_pause_s`` (a ``store.wait`` that times out logs a warning
    per slice)."""
    def done(slice_s: float) -> bool:
        end = time.monotonic() + slice_s
        pause = 0.001
        while not store.check(keys):
            if time.monotonic() >= end:
                return False
            time.sleep(pause)
            pause = min(pause * 2, max_pause_s)
        return True

    return done
