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

import math
from collections import Counter

import numpy as np

from vime_pure.errors import VimeError

COUNTS: Counter = Counter()  # inputs tried per entry point
REJECTIONS: Counter = Counter()  # of those, how many raised a VimeError
REJECTED = object()  # the call raised a VimeError (checked by ``outcome``)


def tried(entry: str) -> None:
    COUNTS[entry] += 1


def check_message(exc: VimeError) -> None:
    """The house format: one line that says how to fix it."""
    text = str(exc)
    assert "\n" not in text, text
    assert "Fix:" in text, text


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
