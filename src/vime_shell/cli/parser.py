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
from collections.abc import Callable, Sequence
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
        owner = self._subcommand(parsed) or self
        if extras and owner.extras_hook is not None:  # e.g. vime train's engine flags
            extras = owner.extras_hook(extras, parsed)
        if extras:
            for token in extras:  # a known foreign flag: its table line, not a guess
                line = owner.flag_table(token.split("=", 1)[0]) if owner.flag_table else None
                if line is not None:
                    owner.error(line)
            owner.error(f"unrecognized arguments: {' '.join(extras)}{owner.suggest(extras)}")
        return parsed

    # Set on a (sub)parser: extras_hook(extras, namespace) -> extras it did not absorb;
    # flag_table(flag) -> the one-line explanation of a flag this command does not take.
    extras_hook: Callable[[list[str], argparse.Namespace], list[str]] | None = None
    flag_table: Callable[[str], str | None] | None = None

    def suggest(self, unknown: Sequence[str]) -> str:
        """`` (did you mean --lr?)`` for the first unknown flag with a close match, or ``""``.

        Only near-misses are suggested: an abbreviation (the typed name is most of the flag),
        or a spelling at least 85% similar. Unrelated flags that share words
        (``--rm-url`` / ``--min-lr``) are not."""
        flags = [s for action in self._actions for s in action.option_strings]
        for token in unknown:
            if token.startswith("-"):
                name = token.split("=", 1)[0]
                close = sorted((f for f in flags if f.startswith(name)
                                and len(name) >= 0.6 * len(f)), key=len) or \
                    difflib.get_close_matches(name, flags, n=1, cutoff=0.85)
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
