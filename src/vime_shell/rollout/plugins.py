"""Loading and calling user functions named by import path (``--rollout-function-path``,
``--custom-rm-path``, ``--dynamic-sampling-filter-path``, ``--custom-generate-function-path``).

Both spellings are accepted: ``"pkg.mod:fn"`` (entry-point style, unambiguous) and slime's dotted
``"pkg.mod.fn"``. A path that does not resolve to a callable, or whose module fails to import
(its own imports included: a plugin written for slime that imports ``slime.rollout``), raises
:class:`PluginError` naming the flag, the module and what went wrong, the cause chained (its
traceback under ``--log-level debug``).

Every call into a plugin goes through :func:`call_plugin`: whatever the plugin raises becomes one
typed error naming the flag, the function and where (prompt, sample), with the cause chained.
That includes ``SystemExit`` and other ``BaseException``: a reward that calls ``sys.exit(0)``
must not end ``vime train`` with status 0, which a job scheduler would read as success. A
``KeyboardInterrupt`` raised in the main thread passes unchanged: it is the user's Ctrl-C (a
plugin's own ``raise KeyboardInterrupt`` there cannot be told apart from it; the run then ends
as interrupted, status 130, never 0); raised in any other thread it is the plugin's own, and
typed.

Deadlines (:func:`run_within`, one mechanism for every thread): ``timeout`` (``--reward-timeout``)
runs the call on a daemon worker thread and waits for it at most that long, so a call that
sleeps, blocks on I/O or spins is given up on time in the main thread, a fully-async pool
thread or an event loop's thread alike (signals, which only the main thread receives, are not
used). A call given up on is a fatal :class:`PluginTimeoutError`; its worker is abandoned and,
if it still runs Python code (a spinning loop), interrupted there by an asynchronous exception,
so it stops using the CPU; a daemon thread never keeps the process alive. Not enforceable: a C
call that holds the GIL (a catastrophic regular expression) stops every thread, the waiting one
too.

Example: ``call_plugin(fn, sample, what="reward my.mod:rm", flag="--custom-rm-path",
where="prompt 3, sample 1", error=RewardFunctionError, timeout=5.0)``; a ``fn`` that sleeps 60 s
raises ``PluginTimeoutError: prompt 3, sample 1: reward my.mod:rm did not return within
--reward-timeout 5 s ...``; one that calls ``sys.exit(0)`` raises ``RewardFunctionError: prompt
3, sample 1: reward my.mod:rm exited with SystemExit: 0 ...``.
"""

import contextvars
import ctypes
import importlib
import inspect
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

from vime_pure.errors import VimeError, field_error, one_line


class PluginError(VimeError):
    """A user function path that cannot be imported or is not callable, or a plugin call that
    raised or exited."""


class PluginTimeoutError(PluginError):
    """A plugin call that did not return within its time limit."""


class DeadlineExpired(Exception):
    """A :func:`run_within` call that did not return in time (the caller names what and why)."""


class _Interrupt(BaseException):
    """Raised asynchronously in an abandoned worker that still runs Python code (a
    BaseException, so that a plugin's ``except Exception`` does not swallow it)."""


def call_plugin(fn: Callable[..., Any], *args: Any, what: str, flag: str, where: str,
                error: type[VimeError] = PluginError, timeout: float | None = None,
                timeout_flag: str = "--reward-timeout") -> Any:
    """``fn(*args)``, with every failure a typed error (module docstring). ``what`` names the
    plugin (``"reward my.mod:rm"``), ``flag`` the flag that chose it, ``where`` the data it was
    given; ``timeout`` seconds (``timeout_flag``) bound the call. A ``VimeError`` the plugin
    raises (e.g. from a vime helper) passes unchanged."""
    try:
        return run_within(timeout, _typed_call, fn, args, what, flag, where, error)
    except DeadlineExpired:
        raise PluginTimeoutError(
            f"{where}: {what} did not return within {timeout_flag} {timeout:g} s. Fix: make "
            f"the function {flag} names return sooner, or raise {timeout_flag}.") from None


def _typed_call(fn: Callable[..., Any], args: tuple, what: str, flag: str, where: str,
                error: type[VimeError]) -> Any:
    """``fn(*args)`` in the thread that runs it, its failure typed there: only that thread
    knows whether a ``KeyboardInterrupt`` can be the user's Ctrl-C (the main thread's)."""
    try:
        return fn(*args)
    except VimeError:
        raise
    except _Interrupt:
        raise  # an abandoned call: nobody waits for its outcome
    except KeyboardInterrupt as exc:
        if threading.current_thread() is threading.main_thread():
            raise  # the user's Ctrl-C: the CLI reports the interrupted run
        raise error(plugin_failure(where, what, flag, exc)) from exc
    except BaseException as exc:  # noqa: BLE001 - SystemExit(0) must not look like success
        raise error(plugin_failure(where, what, flag, exc)) from exc


def plugin_failure(where: str, what: str, flag: str, exc: BaseException) -> str:
    """The one-line message of a plugin call that raised or exited (one "Fix:")."""
    detail = one_line(str(exc).split(" Fix: ")[0]).rstrip(". ")
    name = type(exc).__name__ + (f": {detail}" if detail else "")
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return (f"{where}: {what} exited with {name}. Fix: return a result from the function "
                f"{flag} names (a plugin may not end the run).")
    if _needs_main_thread(exc):
        return (f"{where}: {what} raised {type(exc).__name__}: it sets a signal (signal.alarm: "
                "math-verify's default timeouts do), which works only in the main thread, and "
                "--fully-async pools and --reward-timeout run plugins on other threads. Fix: in "
                f"the function {flag} names, pass parsing_timeout=None and timeout_seconds=None "
                "to math-verify (and bound the call with --reward-timeout), or drop the signal.")
    if flag == "--rm-type":  # vime's own reward: nothing for the user to correct
        return (f"{where}: {what} raised {name}. Fix: report it with this response (its "
                "traceback: --log-level debug); meanwhile score with --custom-rm-path.")
    return (f"{where}: {what} raised {name}. Fix: correct the function {flag} names for this "
            "input (its traceback: --log-level debug).")


def _needs_main_thread(exc: BaseException | None) -> bool:
    """Python's "signal only works in main thread" (also as the cause math-verify rewords)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ValueError) and "signal only works in main thread" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


# -- deadlines ------------------------------------------------------------------------------------
def run_within(seconds: float | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or :class:`DeadlineExpired` once ``seconds`` have passed (None: no limit,
    ``fn`` runs here). Works in any thread (module docstring): the call runs on a pooled daemon
    worker, in a copy of the caller's context (``contextvars``), and its exception, if any, is
    raised here. Example: ``run_within(0.1, time.sleep, 3600)`` raises after 0.1 s."""
    if seconds is None:
        return fn(*args)
    worker = _Worker.take()
    job = _Job(fn, args, contextvars.copy_context())
    worker.jobs.put(job)
    finished = False
    try:
        finished = job.done.wait(seconds)
    finally:
        if finished:
            worker.give_back()
        else:  # expired, or the wait itself was interrupted (Ctrl-C in the main thread)
            worker.abandon(job)
    if not finished:
        raise DeadlineExpired(f"did not return within {seconds:g} s")
    return job.outcome()


class _Job:
    """One call handed to a worker, and its outcome."""

    def __init__(self, fn: Callable[..., Any], args: tuple, context: contextvars.Context):
        self.fn, self.args, self.context = fn, args, context
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.context.run(self.fn, *self.args)
        except BaseException as exc:  # noqa: BLE001 - raised again in the waiting thread
            self.error = exc
        finally:
            self.done.set()

    def outcome(self) -> Any:
        if self.error is not None:
            error, self.error = self.error, None  # no cycle through this frame
            raise error
        return self.result


class _Worker:
    """A daemon thread that runs :class:`_Job` s one at a time; idle ones are pooled."""

    _IDLE: list["_Worker"] = []
    _LOCK = threading.Lock()
    _NUMBER = itertools.count()

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: stop serving
        self.abandoned = False
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"vime-deadline-{next(self._NUMBER)}")
        self.thread.start()

    @classmethod
    def take(cls) -> "_Worker":
        with cls._LOCK:
            while cls._IDLE:
                worker = cls._IDLE.pop()
                if worker.thread.is_alive():  # a pooled worker does not survive a fork
                    return worker
        return cls()

    def give_back(self) -> None:
        with self._LOCK:
            self._IDLE.append(self)

    def abandon(self, job: _Job) -> None:
        """Never used again; a job still running Python code is interrupted where it is."""
        self.abandoned = True
        self.jobs.put(None)  # ends the serving loop once the job returns
        ident = self.thread.ident  # set since start(): None never reaches the call
        if not job.done.is_set() and self.thread.is_alive() and ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                       ctypes.py_object(_Interrupt))

    def _serve(self) -> None:
        try:
            while not self.abandoned:
                job = self.jobs.get()
                if job is None:
                    return
                job.run()
        except _Interrupt:  # aimed at an abandoned job that had just returned
            return


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
    module = _import_module(module_name, path, flag)
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


def _import_module(module_name: str, path: str, flag: str) -> Any:
    """The plugin's module; any failure while importing it is one typed line (the module's
    own traceback chained: ``--log-level debug``), but the user's Ctrl-C."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise _import_error(exc, path, module_name, flag) from exc
    except KeyboardInterrupt:
        if threading.current_thread() is threading.main_thread():
            raise  # the user's Ctrl-C during a slow import
        raise field_error(PluginError, flag, path, f"module {module_name!r} exited with "
                          "KeyboardInterrupt while being imported",
                          "remove the exit from the module's top level") from None
    except SystemExit as exc:  # an import may not end the run either
        raise field_error(PluginError, flag, path, f"module {module_name!r} exited with "
                          f"{type(exc).__name__}({exc}) while being imported",
                          "remove the exit from the module's top level") from exc
    except Exception as exc:  # noqa: BLE001 - the module's own code failed: one typed line
        raise field_error(PluginError, flag, path, f"module {module_name!r} raised "
                          f"{type(exc).__name__} while being imported: "
                          f"{one_line(str(exc)).rstrip('. ')}", f"correct {module_name} (its "
                          "traceback: --log-level debug)") from exc


# Packages a plugin written for slime or miles imports, and where vime's counterparts are.
_ANCHORS = ("slime", "miles", "sglang")
_COUNTERPARTS = ("vime_pure.Sample for slime.utils.types.Sample, "
                 "vime_shell.rollout.functions.generate for slime's sglang_rollout generate")


def _import_error(exc: ImportError, path: str, module_name: str, flag: str) -> PluginError:
    """The typed error of a plugin module that cannot be imported: the module itself is not
    found, or its own imports fail (a package that is not installed, a missing name)."""
    missing = exc.name or ""
    if isinstance(exc, ModuleNotFoundError) and missing and \
            (module_name == missing or module_name.startswith(missing + ".")):
        return field_error(PluginError, flag, path, f"module {module_name!r} is not importable",
                           "check the spelling and that its directory is on PYTHONPATH")
    package = missing.split(".")[0]
    if isinstance(exc, ModuleNotFoundError) and package in _ANCHORS:
        fix = (f"{module_name} is written for {package}, which vime does not include: import "
               f"vime's counterparts instead ({_COUNTERPARTS}; README \"Coming from slime\")")
    elif isinstance(exc, ModuleNotFoundError) and package:
        fix = f"install {package}, or remove that import from {module_name}"
    else:
        fix = f"correct that import in {module_name}"
    return field_error(PluginError, flag, path, f"module {module_name!r} fails to import: "
                       f"{type(exc).__name__}: {one_line(str(exc))}", fix)


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
