"""Loading and calling user functions named by import path (``--rollout-function-path``,
``--custom-rm-path``, ``--dynamic-sampling-filter-path``, ``--custom-generate-function-path``).

Both spellings are accepted: ``"pkg.mod:fn"`` (entry-point style, unambiguous) and slime's dotted
``"pkg.mod.fn"``. A path that does not resolve to a callable raises :class:`PluginError` naming
the flag, the path and what went wrong; an ``Exception`` raised *inside* the user's module while
it is imported propagates unchanged, so its traceback stays useful.

Every call into a plugin goes through :func:`call_plugin`: whatever the plugin raises becomes one
typed error naming the flag, the function and where (prompt, sample), with the cause chained.
That includes ``SystemExit``, ``KeyboardInterrupt`` and other ``BaseException``: a reward that
calls ``sys.exit(0)`` must not end ``vime train`` with status 0, which a job scheduler would read
as success. ``timeout`` (``--reward-timeout``) bounds one call: a watchdog thread interrupts the
main thread with ``SIGUSR1`` when it expires (a signal, so a ``time.sleep`` or a pure-Python loop
is interrupted; ``SIGALRM`` stays free for ``math-verify``'s own parse timeouts).

Example: ``call_plugin(fn, sample, what="reward my.mod:rm", flag="--custom-rm-path",
where="prompt 3, sample 1", error=RewardFunctionError, timeout=5.0)``; a ``fn`` that sleeps 60 s
raises ``PluginTimeoutError: prompt 3, sample 1: reward my.mod:rm did not return within
--reward-timeout 5 s ...``; one that calls ``sys.exit(0)`` raises ``RewardFunctionError: prompt
3, sample 1: reward my.mod:rm exited with SystemExit: 0 ...``.
"""

import contextlib
import importlib
import inspect
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from vime_pure.errors import VimeError, field_error, one_line


class PluginError(VimeError):
    """A user function path that cannot be imported or is not callable, or a plugin call that
    raised or exited."""


class PluginTimeoutError(PluginError):
    """A plugin call that did not return within its time limit."""


class _Expired(BaseException):
    """Raised in the main thread when a call's time limit expires (a BaseException, so that a
    plugin's ``except Exception`` does not swallow it)."""


def call_plugin(fn: Callable[..., Any], *args: Any, what: str, flag: str, where: str,
                error: type[VimeError] = PluginError, timeout: float | None = None) -> Any:
    """``fn(*args)``, with every failure a typed error (module docstring). ``what`` names the
    plugin (``"reward my.mod:rm"``), ``flag`` the flag that chose it, ``where`` the data it was
    given. A ``VimeError`` the plugin raises (e.g. from a vime helper) passes unchanged."""
    try:
        with time_limit(timeout):
            return fn(*args)
    except VimeError:
        raise
    except _Expired:
        raise PluginTimeoutError(
            f"{where}: {what} did not return within --reward-timeout {timeout:g} s. Fix: make "
            f"the function {flag} names faster, or raise --reward-timeout.") from None
    except BaseException as exc:  # noqa: BLE001 - SystemExit(0) must not look like success
        kind = "exited with" if isinstance(exc, (SystemExit, KeyboardInterrupt)) else "raised"
        detail = one_line(str(exc))
        raise error(f"{where}: {what} {kind} {type(exc).__name__}"
                    f"{': ' + detail if detail else ''}. Fix: correct the function {flag} "
                    "names (a plugin returns its result; it may not end the run).") from exc


def is_expired(exc: BaseException) -> bool:
    """True for the exception :func:`time_limit` raises when its time is up."""
    return isinstance(exc, _Expired)


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``_Expired`` in the main thread if the body runs longer than ``seconds`` (None: no
    limit; off the main thread, where no signal handler can run, the body runs unlimited).

    One watchdog thread serves every limit (a limit costs a dict entry, not a thread: the
    launch checks render every dataset prompt under one)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    _start_watchdog()
    token = object()
    with _LOCK:
        _ACTIVE[token] = time.monotonic() + seconds
    _WAKE.set()
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE.pop(token, None)
            _EXPIRED.discard(token)


_LOCK = threading.RLock()  # re-entrant: the signal handler runs in the main thread, which
# may hold it (inside ``time_limit``) when the signal lands
_ACTIVE: dict[object, float] = {}  # live limits -> their deadline (time.monotonic)
_EXPIRED: set[object] = set()  # limits whose deadline passed while still live
_WAKE = threading.Event()
_WATCHDOG: list[threading.Thread] = []


def _watch() -> None:
    main = threading.main_thread().ident
    while True:
        _WAKE.clear()  # before reading the deadlines: a later set() ends the wait at once
        with _LOCK:
            now = time.monotonic()
            due = [t for t, d in _ACTIVE.items() if d <= now and t not in _EXPIRED]
            _EXPIRED.update(due)
            pending = [d for t, d in _ACTIVE.items() if t not in _EXPIRED]
        if due:
            signal.pthread_kill(main, signal.SIGUSR1)
        _WAKE.wait(max(min(pending) - time.monotonic(), 0.0) if pending else None)


def _on_signal(signum: int, frame: Any) -> None:
    """Raise for a live expired limit; a late signal (its limit already left) is ignored."""
    with _LOCK:
        live = bool(_EXPIRED)
        _EXPIRED.clear()
    if live:
        raise _Expired()


def _start_watchdog() -> None:
    # The handler is installed once and left in place: a signal that arrives just as its
    # call returns must find it, not SIGUSR1's default action (which ends the process).
    if signal.getsignal(signal.SIGUSR1) is not _on_signal:
        signal.signal(signal.SIGUSR1, _on_signal)
    if not (_WATCHDOG and _WATCHDOG[-1].is_alive()):  # none yet, or lost in a fork
        _WATCHDOG.append(threading.Thread(target=_watch, name="vime-time-limit", daemon=True))
        _WATCHDOG[-1].start()


def load_callable(path: str, *, flag: str) -> Callable[..., Any]:
    """Import ``path`` and return the callable it names.

    Example: ``load_callable("vime_shell.rollout.tasks:exact_match", flag="--custom-rm-path")``.
    """
    if not isinstance(path, str) or not path.strip():
        raise field_error(PluginError, flag, path, "is not an import path",
                          'pass "package.module:function"')
    module_name, sep, attr = path.strip().partition(":")
    if not sep:
        module_name, _, attr = module_name.rpartition(".")
    if not module_name or not attr:
        raise field_error(PluginError, flag, path, "names no module and function",
                          'pass "package.module:function" (or "package.module.function")')
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise  # the user's module imports something missing: keep its traceback
        raise field_error(PluginError, flag, path, f"module {module_name!r} is not importable",
                          "check the spelling and that its directory is on PYTHONPATH") from exc
    except (SystemExit, KeyboardInterrupt) as exc:  # an import may not end the run either
        raise field_error(PluginError, flag, path, f"module {module_name!r} exited with "
                          f"{type(exc).__name__}({exc}) while being imported",
                          "remove the exit from the module's top level") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise field_error(PluginError, flag, path,
                              f"module {module_name!r} has no attribute {attr!r}",
                              f"define {attr} in {module_name} or fix the name")
        obj = getattr(obj, part)
    if not callable(obj):
        raise field_error(PluginError, flag, path, f"names a {type(obj).__name__}, not a function",
                          "point it at a function")
    return obj


GENERATE_PARAMETERS = ("args", "sample", "sampling_params")


def load_generate_function(path: str, *,
                           flag: str = "--custom-generate-function-path") -> Callable[..., Any]:
    """``--custom-generate-function-path``: slime's per-sample generate,
    ``async def generate(args, sample, sampling_params) -> Sample | list[Sample]``.

    Checked at load by signature: a coroutine function taking exactly three positional
    arguments. Example: ``load_generate_function("vime_shell.rollout.functions:generate")``.
    """
    fn = load_callable(path, flag=flag)
    if not inspect.iscoroutinefunction(fn):
        raise field_error(PluginError, flag, path, "is not an async function",
                          "define it as `async def generate(args, sample, sampling_params)`")
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        raise field_error(PluginError, flag, path,
                          f"does not take {GENERATE_PARAMETERS} (it takes "
                          f"{tuple(inspect.signature(fn).parameters)})",
                          "define it as `async def generate(args, sample, sampling_params)`"
                          ) from None
    return fn
