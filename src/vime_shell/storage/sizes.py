"""Byte sizes as users write them (``--save-hf-max-shard-size 5GB``), and the export error.

Torch-free, so launch checks validate sizes before anything heavy is imported.
"""

import re

from vime_pure.errors import VimeError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class ExportError(VimeError):
    """A checkpoint export that cannot proceed (bad target, size limit, or inputs)."""


def parse_size(size: int | str, name: str = "max_shard_size") -> int:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536_870_912, ``1000`` -> 1000; a message
    names the value ``name`` (the flag, at the command line)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE_RE.match(str(size))
        if not match:
            raise ExportError(f"{name}={size!r} is not a size. Fix: pass bytes or a "
                              "string such as '5GB' or '512MiB'.")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value < 1:
        raise ExportError(f"{name}={size!r} must be positive. Fix: e.g. '5GB'.")
    return value
