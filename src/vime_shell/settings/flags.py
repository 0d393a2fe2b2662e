"""``vime train``'s settings from the command line and config files: one ``--dash-name`` flag
per ``TrainConfig`` field (grouped by section, slime's aliases as extra spellings), a
``--config`` file (YAML, JSON or TOML; flat keys or by section), and the parser hook that turns
slime's ``--vllm-X`` / ``--sglang-X`` engine flags into vLLM engine arguments and takes slime's
unsupported flags at their default (off) value with a note. slime's spellings of values
(``slime_flags.slime_values``) become vime's, with a note, and ``--wandb-key`` (flag or
config key) goes into ``WANDB_API_KEY``, never into the configuration.

Sources, later wins: the defaults, the ``--config`` file, the flags given, then slime's
``--custom-config-path`` file (slime applies it over the flags, and so does vime, with a note
per value it replaces). Example:
``parse_train_config(["--lr", "1e-3", "--sglang-mem-fraction-static", "0.7"])``.
"""

import argparse
import base64
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from vime_pure.errors import field_error
from vime_shell.rollout.functions import SFT_ROLLOUT_FUNCTION
from vime_shell.settings.common import element_type, field_type
from vime_shell.settings.slime_flags import (ALIASES, SLIME_VALUES, default_flags, engine_flags,
                                             slime_values)
from vime_shell.settings.train_config import SECTIONS, ConfigError, TrainConfig

WANDB_KEY_ENV = "WANDB_API_KEY"  # where W&B reads its key; the key is kept nowhere else
BASE64 = "base64:"  # miles' inline config (--custom-config-path base64:<yaml>)


def load_config_file(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """Read a ``.yaml`` / ``.yml`` / ``.json`` / ``.toml`` file into a mapping; errors name
    ``flag`` (``--config`` or ``--custom-config-path``)."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise field_error(ConfigError, flag, str(p), f"cannot be read ({exc})",
                          "pass an existing YAML, JSON or TOML file (UTF-8 text)") from None
    return parse_config_text(text, p.suffix, str(p), flag)


def parse_config_text(text: str, suffix: str, where: str, flag: str) -> dict[str, Any]:
    """A config file's text (its kind by ``suffix``) as a mapping of setting names; ``where``
    and ``flag`` name it in errors."""
    try:
        if suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise field_error(ConfigError, flag, where, "has an unknown extension",
                              "name it .yaml, .yml, .json or .toml")
    except (ValueError, yaml.YAMLError, RecursionError) as exc:
        if isinstance(exc, ConfigError):
            raise
        # yaml.safe_load builds plain data only: a !!python/object tag fails here, unrun.
        raise field_error(ConfigError, flag, where, f"does not parse ({exc})",
                          "fix the file's syntax") from None
    if not isinstance(data, dict):
        raise field_error(ConfigError, flag, where, "does not hold a mapping",
                          "write one key: value per setting")
    odd = next((k for k in data if not isinstance(k, str)), None)
    if odd is not None or None in data:
        raise field_error(ConfigError, f"{flag} {where} key", odd, "is not a setting name",
                          "write setting names as keys, e.g. global_batch_size: 64")
    return data


def custom_config(path: str, fields: set[str]) -> dict[str, Any]:
    """``--custom-config-path``'s settings (slime's and miles': applied over the flags): a
    file as ``--config`` reads it, or miles' inline ``base64:<yaml>``. Every key must be a
    setting (slime's spelling or vime's); slime sets any key on its args, vime names the
    stray one. Example: slime's mis.yaml gives ``{"use_tis": True, "tis_level": "token",
    ...}``."""
    flag = "--custom-config-path"
    if path.startswith(BASE64):
        source = path[:40] + "..."
        try:
            text = base64.b64decode(path[len(BASE64):], validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError) as exc:
            raise field_error(ConfigError, flag, source, f"is not base64 ({exc})",
                              "pass base64:<the base64 of a YAML file>, or a file path") from None
        data = parse_config_text(text, ".yaml", source, flag)
    else:
        source = path
        data = load_config_file(path, flag)
    out = {}
    for key, value in flatten_sections(data, source).items():
        name = ALIASES.get("--" + str(key).replace("_", "-"), str(key).replace("-", "_"))
        if name not in fields:
            raise field_error(ConfigError, f"{flag} {source} key", key,
                              "is not a vime setting (slime would set it on its args for a "
                              "plugin; vime's plugins read settings only)",
                              "drop it, or spell it as a flag of vime train --help")
        out[name] = value
    return out


def flatten_sections(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A config file's keys, flat (``lr: 1e-6``) or by section (``optimizer: {lr: 1e-6}``, the
    sections of ``vime train --help``); a key under the wrong section is an error naming it."""
    owner = {f.name: f.metadata["section"] for f in attrs.fields(TrainConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in SECTIONS or not isinstance(value, Mapping):
            out[key] = value
            continue
        for inner, v in value.items():
            name = str(inner).replace("-", "_")
            if owner.get(name, key) != key:
                raise field_error(ConfigError, f"--config {source} key", f"{key}.{inner}",
                                  f"belongs to section {owner[name]!r}",
                                  f"move it under {owner[name]}: (or write it flat)")
            out[inner] = v
    return out


def _optional(kind: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__
    return parse


class _OrUnset(tuple):
    """A choice list that also takes None: ``--moe-router-dtype none`` (unset) passes
    argparse's choice check, which runs after the type turned "none" into None; ``--help``
    lists the choices only."""

    def __contains__(self, value: object) -> bool:
        return value is None or tuple.__contains__(self, value)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one ``--dash-name`` flag per field, grouped by section, choices
    shown as choices; unset flags stay absent (defaults and the config file fill them).

    Build the parser with ``allow_abbrev=False``: a typo such as ``--global-batch`` must fail,
    not silently mean ``--global-batch-size``.
    """
    parser.add_argument("--config", default=None, help="YAML / JSON / TOML file of settings")
    parser.add_argument(
        "--custom-config-path", default=None, metavar="FILE",
        help="slime's and miles' config file (e.g. mis.yaml): settings applied over the flags, "
        "each override noted; YAML, JSON or TOML, or miles' inline base64:<yaml>")
    groups = {name: parser.add_argument_group(name) for name in SECTIONS}
    # section order (the Megatron records are base classes, so their fields come first)
    order = {name: i for i, name in enumerate(SECTIONS)}
    fields: tuple[attrs.Attribute, ...] = attrs.fields(TrainConfig)
    for f in sorted(fields, key=lambda f: order[f.metadata["section"]]):
        group = groups[f.metadata["section"]]
        flags = ["--" + f.name.replace("_", "-"),
                 *(alias for alias, name in ALIASES.items() if name == f.name)]
        help_text = f"{f.metadata['help']} (default: {f.default})"
        base, optional = field_type(f)
        if base is bool and f.name.startswith("no_"):  # Megatron's --no-X switches: argparse's
            # BooleanOptionalAction reads any --no-... spelling as False
            group.add_argument(*flags, action="store_const", const=True,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        if base is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        kind = element_type(f) if base is tuple else base
        choices = f.metadata["choices"]
        if choices is not None:  # slime's spellings of a choice (SLIME_VALUES) are choices
            choices = (*choices, *(v for n, v in SLIME_VALUES if n == f.name))
        # "none" means unset, unless it is one of the choices (--moe-router-load-balancing-type)
        unset = optional and "none" not in (choices or ())
        if unset and choices is not None:
            choices = _OrUnset(choices)
        group.add_argument(*flags, type=_optional(kind) if unset else kind,
                           choices=choices, nargs=f.metadata["nargs"],
                           default=argparse.SUPPRESS, help=help_text)
    groups["checkpoint"].add_argument(
        "--load-forge-rollout-data", action=_ForgeReplay, metavar="PATH",
        default=argparse.SUPPRESS, help="slime's alias: --load-rollout-data PATH "
        "--load-rollout-data-mode forge")
    groups["logging"].add_argument(
        "--wandb-key", action=_WandbKey, metavar="KEY", default=argparse.SUPPRESS,
        help=f"W&B API key: set as {WANDB_KEY_ENV} for W&B, never written to the run's "
        "configuration, checkpoints or logs")
    parser.set_defaults(engine_warnings=(), flag_notes=())


class _ForgeReplay(argparse.Action):
    """``--load-forge-rollout-data PATH``: two settings, as slime's one flag means."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.load_rollout_data = values
        namespace.load_rollout_data_mode = "forge"


class _WandbKey(argparse.Action):
    """``--wandb-key KEY``: into W&B's environment at once, kept in no setting (so no dump,
    checkpoint, report or W&B config can hold it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        os.environ[WANDB_KEY_ENV] = values


def absorb_engine_flags(extras: list[str], namespace: argparse.Namespace) -> list[str]:
    """The parser's hook for ``--vllm-X`` / ``--sglang-X`` (``slime_flags.engine_flags``):
    mapped ones extend ``--vllm-engine-args``, the rest become launch warnings; slime's
    unsupported flags at their default value (``slime_flags.default_flags``) become notes."""
    engine, warnings, rest = engine_flags(extras)
    if engine:
        given = getattr(namespace, "vllm_engine_args", None) or ()
        namespace.vllm_engine_args = [*given, *engine]
    namespace.engine_warnings = (*namespace.engine_warnings, *warnings)
    notes, rest = default_flags(rest)
    namespace.flag_notes = (*getattr(namespace, "flag_notes", ()), *notes)
    return rest


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the ``--config`` file, then the flags that were given; slime's spellings
    of values are vime's (their notes join ``args.flag_notes`` for the launch log)."""
    values = dict(vars(args))
    path = values.pop("config", None)
    merged = flatten_sections(load_config_file(path), str(path)) if path else {}
    merged = {ALIASES.get("--" + str(k).replace("_", "-"), str(k).replace("-", "_")): v
              for k, v in merged.items()}  # slime's spellings of vime settings too
    key = merged.pop("wandb_key", None)
    if key is not None:  # a config file's W&B key: the environment, as the flag's
        os.environ[WANDB_KEY_ENV] = str(key)
    fields = {f.name for f in attrs.fields(TrainConfig)}
    merged.update({k: v for k, v in values.items() if k in fields})
    custom = values.pop("custom_config_path", None)
    overrides = custom_config(custom, fields) if custom else {}
    notes = [f"--custom-config-path: {k}={v!r} replaces {merged[k]!r} (the file wins, as in "
             "slime)" for k, v in overrides.items() if k in merged and merged[k] != v]
    merged.update(overrides)
    merged, value_notes = slime_values(merged)
    notes += value_notes
    if merged.get("rollout_function_path") == SFT_ROLLOUT_FUNCTION:
        # one sample per conversation: slime's default n (vime's 8 is for RL groups)
        merged.setdefault("n_samples_per_prompt", 1)
    args.flag_notes = (*getattr(args, "flag_notes", ()), *notes)
    return TrainConfig.from_mapping(merged, source=f"--config {path}" if path else "flags")


def parse_train_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse ``vime train`` arguments. Example: ``parse_train_config(["--lr", "1e-3"]).lr``."""
    parser = argparse.ArgumentParser(prog="vime train", allow_abbrev=False)
    add_train_arguments(parser)
    args, extras = parser.parse_known_args(argv)
    extras = absorb_engine_flags(extras, args)  # --vllm-X / --sglang-X, as `vime train` does
    if extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return config_from_args(args)
