"""``docs/flags.md`` is generated from the settings records (``vime_shell.cli.flags_doc``):
the committed file equals a fresh rendering, and the rendering names every flag ``vime train``
accepts with its record's default, choices and help line."""

import argparse
from pathlib import Path

import attrs

from vime_shell.cli.flags_doc import REGENERATE, render
from vime_shell.cli.main import build_parser
from vime_shell.settings.slime_flags import UNSUPPORTED
from vime_shell.settings.train_config import TrainConfig

FLAGS_MD = Path(__file__).resolve().parents[1] / "docs" / "flags.md"


def test_docs_flags_md_is_the_rendering_of_the_settings_records():
    """A flag added, renamed or re-documented in a record changes docs/flags.md."""
    assert FLAGS_MD.read_text() == render(), (
        f"docs/flags.md is stale: regenerate it from the repository root with `{REGENERATE}`")


def test_every_train_flag_has_its_row_with_the_records_help_and_default():
    text = render()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for a in sub.choices["train"]._actions for s in a.option_strings
             if s.startswith("--") and s != "--help"}
    missing = sorted(s for s in flags if f"`{s}`" not in text)
    assert not missing, missing
    for f in attrs.fields(TrainConfig):
        row = next(line for line in text.splitlines()
                   if line.startswith(f"| `--{f.name.replace('_', '-')}`"))
        assert f.metadata["help"].replace("|", "\\|") in row, f.name
        if f.default is not None and not isinstance(f.default, bool):
            assert f"| `{f.default}` |" in row, f.name


def test_every_refused_slime_flag_has_its_table_line():
    text = render()
    missing = [flag for flag, why in UNSUPPORTED.items() if f"| `{flag}` | {why} |" not in text]
    assert not missing, missing
