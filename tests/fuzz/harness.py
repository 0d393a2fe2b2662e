"""The fuzz harness's contract and its counter: every public entry point, fed anything, either
returns (and the test then checks the documented invariants) or raises a ``VimeError`` whose
message is one line with a fix. Any other exception fails the test as a bug.

``COUNTS`` records how many inputs each entry point tried in this process (``REJECTIONS`` how
many of them it rejected); ``tests/conftest.py`` prints the totals at the end of the session,
merged over xdist workers.

Example::

    result = outcome("build_schedule", build_schedule, lengths, group_ids, layout, policy)
    if result is not REJECTED:
        ...  # the schedule's invariants
"""

import ast
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np

from vime_pure.errors import VimeError

COUNTS: Counter = Counter()  # inputs tried per entry point
REJECTIONS: Counter = Counter()  # of those, how many raised a VimeError
REJECTED = object()  # the call raised a VimeError (checked by ``outcome``)


def tried(entry: str) -> None:
    COUNTS[entry] += 1


def check_message(exc: VimeError) -> None:
    """The house format: one line that says how to fix it, once (exactly one ``Fix:``, no
    ``..`` where two sentences were glued)."""
    text = str(exc)
    assert "\n" not in text, text
    assert text.count("Fix:") == 1, text
    assert not GLUED.search(text), text


GLUED = re.compile(r"(?<!\.)\.\.(?=\s|$)")  # "run).. Fix": not "..." nor "../x"
SRC = Path(__file__).resolve().parents[2] / "src"


def _vime_names() -> frozenset[str]:
    """Every function and class vime defines (a message must never call one by name)."""
    names = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
    return frozenset(names)


VIME_NAMES = _vime_names()
# A Python name of a setting left in a command's line (``world_size=3``): ``as_flags`` turns
# every one that is a flag into the flag, so what is left names no flag.
PYTHON_SETTING = re.compile(r"(?<![\w\-'\"\[/])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)=")


def check_cli_line(line: str) -> None:
    """A ``vime`` command's error line: ``check_message``'s rules, and it names flags, never a
    vime function (``resolve_engine_layout(...)``) or a Python name of a setting
    (``layout.world_size=1``). Messages of the core's own API (``vime_pure``) may name its
    functions; a command's may not."""
    assert "\n" not in line and line.count("Fix:") == 1 and not GLUED.search(line), line
    called = [n for n in re.findall(r"\b([A-Za-z_]\w*)\(", line) if n in VIME_NAMES]
    assert not called, (called, line)
    assert not PYTHON_SETTING.findall(line), (PYTHON_SETTING.findall(line), line)


def outcome(entry: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or ``REJECTED`` when it raised a well-formed ``VimeError``."""
    tried(entry)
    try:
        return fn(*args, **kwargs)
    except VimeError as exc:
        check_message(exc)
        REJECTIONS[entry] += 1
        return REJECTED


def no_nan(value) -> None:
    """No NaN anywhere in a float, an array, a tensor or a dict of them (None, a metric over
    zero observations, is no value rather than a NaN)."""
    if value is None:
        return
    if isinstance(value, dict):
        for v in value.values():
            no_nan(v)
        return
    if hasattr(value, "detach"):
        value = value.detach().double().numpy()
    arr = np.asarray(value, dtype=np.float64)
    assert not np.isnan(arr).any(), value


def canonical_groups(group_ids) -> list:
    """The documented meaning of group ids: numpy ints are ints, each None its own group."""
    ids = group_ids.tolist() if isinstance(group_ids, np.ndarray) else list(group_ids)
    return [("own", i) if g is None else g for i, g in enumerate(ids)]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
