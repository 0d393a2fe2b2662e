"""The argument parser of every ``vime`` command: no abbreviations, one-line errors.

argparse prints the whole usage before an error and accepts any unambiguous prefix of a flag
(``--global-batch`` silently meaning ``--global-batch-size``). :class:`VimeArgumentParser`
refuses prefixes (``allow_abbrev=False``, passed on to every subparser) and reports an error
as one line naming the command, with the closest flag for an unknown one, then exits with
status 2.

Example: ``vime train --lrr 1`` prints ``vime train: error: unrecognized arguments: --lrr 1
(did you mean --lr?)``.
"""

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import NoReturn


class VimeArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``allow_abbrev=False`` and one-line errors."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args: Sequence[str] | None = None,
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """Unknown flags are reported by the subcommand that was given, with a suggestion."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self._subcommand(parsed) or self
            owner.error(f"unrecognized arguments: {' '.join(extras)}{owner.suggest(extras)}")
        return parsed

    def suggest(self, unknown: Sequence[str]) -> str:
        """`` (did you mean --lr?)`` for the first unknown flag with a close match, or ``""``."""
        flags = [s for action in self._actions for s in action.option_strings]
        for token in unknown:
            if token.startswith("-"):
                name = token.split("=", 1)[0]
                # A prefix is the usual typo (an abbreviation); else the closest spelling.
                close = sorted((f for f in flags if f.startswith(name)), key=len) or \
                    difflib.get_close_matches(name, flags, n=1)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""

    def _subcommand(self, parsed: argparse.Namespace) -> "VimeArgumentParser | None":
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(chosen, VimeArgumentParser):
                    return chosen._subcommand(parsed) or chosen
        return None


def print_error(command: str, message: str) -> None:
    """The one line every ``vime`` error is reported as (stderr)."""
    print(f"vime {command}: error: {message}", file=sys.stderr)
