"""What every settings record shares: ``ConfigError``, the field makers that carry a knob's
help text and section, and the checks (types, choices, ranges) a record runs on its own fields.

A field made here is one ``vime train`` flag: ``setting(0.2, "PPO ratio clip", "loss")`` in a
record becomes ``--eps-clip`` under the ``loss`` heading of ``--help`` and the ``loss:`` section
of a config file. Example: ``check_record_fields(record, ["eps_clip"])`` with ``eps_clip="x"``
raises ``eps_clip='x': must be a float. Fix: e.g. eps_clip=0.2.``
"""

import math
from collections.abc import Iterable, Sequence
from typing import Any, get_args, get_origin

import attrs

from vime_pure.errors import VimeError, field_error


class ConfigError(VimeError):
    """A training setting that is invalid, unknown or inconsistent with another one."""


def setting(default: Any, help: str, section: str, choices: Sequence[Any] | None = None,
         nargs: str | None = None) -> Any:
    """One setting: its default, its ``--help`` line, its section, its choice list."""
    return attrs.field(default=default, metadata={"help": help, "section": section,
                                                  "choices": choices, "nargs": nargs})


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def setting_list(help: str, section: str) -> Any:
    """An optional list setting (``--flag A B``, a list in a config file), stored as a tuple."""
    return attrs.field(default=None, converter=_as_tuple,
                       metadata={"help": help, "section": section, "choices": None,
                                 "nargs": "+"})


def field_type(f: attrs.Attribute) -> tuple[Any, bool]:
    """The field's base type (``tuple`` for ``tuple[str, ...]``) and whether None is allowed."""
    args = get_args(f.type)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else f.type
    return get_origin(base) or base, optional


def element_type(f: attrs.Attribute) -> type:
    """``int`` for a ``tuple[int, ...]`` setting, ``str`` for ``tuple[str, ...]``."""
    args = get_args(f.type)
    base = next(a for a in args if a is not type(None)) if type(None) in args else f.type
    return get_args(base)[0]


def _type_ok(f: attrs.Attribute, value: Any) -> bool:
    base, optional = field_type(f)
    if value is None and optional:
        return True
    ok = (isinstance(value, base) and not (base is int and isinstance(value, bool))
          or base is float and isinstance(value, int) and not isinstance(value, bool))
    if ok and base is tuple:
        kind = element_type(f)
        ok = all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
    return ok


def check_record_fields(record: Any, names: Iterable[str] | None = None) -> None:
    """Types and choice lists of ``record``'s fields (all of them, or ``names``)."""
    fields = attrs.fields_dict(type(record))
    for name in fields if names is None else names:
        f, value = fields[name], getattr(record, name)
        if not _type_ok(f, value):
            _, optional = field_type(f)
            raise field_error(ConfigError, f.name, value,
                              f"must be {'None or ' if optional else ''}"
                              f"a {field_type(f)[0].__name__}", f"e.g. {f.name}={f.default!r}")
        choices = f.metadata.get("choices")
        if choices is not None and value is not None:
            one_of(name, value, choices)


def at_least(name: str, value: int | None, lo: int) -> None:
    """``value >= lo`` (None passes: an unset optional setting)."""
    if value is not None and value < lo:
        raise field_error(ConfigError, name, value, f"must be >= {lo}", f"pass {name} >= {lo}")


def in_range(name: str, value: float | None, lo: float, hi: float, fix: str) -> None:
    """``lo <= value <= hi`` and finite (None passes)."""
    if value is not None and not (math.isfinite(value) and lo <= value <= hi):
        raise field_error(ConfigError, name, value, f"must be in [{lo}, {hi}]", fix)


def one_of(name: str, value: object, options: Sequence[object]) -> None:
    if value not in options:
        raise field_error(ConfigError, name, value, "is not a valid choice",
                          f"use one of {[o for o in options if o is not None]}")


def flag(name: str) -> str:
    """A field's flag: ``eps_clip`` -> ``--eps-clip``."""
    return "--" + name.replace("_", "-")


class Record:
    """A settings record: built alone it checks its own fields' types and choices, then its
    ``_check`` (the rules among its own fields). ``TrainConfig`` composes the records and runs
    each ``_check`` once, then the rules that span records."""

    def __attrs_post_init__(self) -> None:
        check_record_fields(self)
        self._check()

    def _check(self) -> None:
        """The record's own rules (none by default)."""
