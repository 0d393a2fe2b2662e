"""Loading user functions named by import path (``--rollout-function-path``, ``--custom-rm-path``,
``--custom-generate-function-path``).

Both spellings are accepted: ``"pkg.mod:fn"`` (entry-point style, unambiguous) and slime's dotted
``"pkg.mod.fn"``. A path that does not resolve to a callable raises :class:`PluginError` naming
the flag, the path and what went wrong; an exception raised *inside* the user's module while it
is imported propagates unchanged, so its traceback stays useful.
"""

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from vime_pure.errors import VimeError, field_error


class PluginError(VimeError):
    """A user function path that cannot be imported or is not callable."""


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
