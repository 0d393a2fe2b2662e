"""The argument parser of every ``vime`` command: no abbreviations, one-line errors.

argparse prints the whole usage before an error and accepts any unambiguous prefix of a flag
(``--global-batch`` silently meaning ``--global-batch-size``). :class:`VimeArgumentParser`
refuses prefixes (``allow_abbrev=False``, passed on to every subparser) and reports an error
as one line naming the command, with the closest flag for an unknown one, then exits with
status 2.

Example: ``vime train --lrr 1`` prints ``vime train: error: unrecognized arguments: --lrr 1
(did you mean --lr?)``.

:func:`report_failure` prints a failed command the same way: one line, the chained cause in
one more when it adds something, the traceback only at debug level, settings spelled as the
command's flags (:func:`as_flags`).
"""

import argparse
import difflib
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar, overload

from vime_pure.errors import VimeError
from vime_shell.cli.launch_verdict import LaunchAgreementError, agree, describe, where

_N = TypeVar("_N")  # a caller's own namespace object, as argparse types it

# What a command reports as one line and exit status 2 (bad input, a file system's refusal).
REPORTED_ERRORS = (VimeError, OSError, UnicodeDecodeError)


class VimeArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``allow_abbrev=False`` and one-line errors."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        choice = re.match(r"argument (--[\w-]+)[^:]*: invalid choice: '([^']*)'", message)
        if choice and self.flag_table is not None:  # a foreign choice: its table line
            message = self.flag_table(f"{choice[1]} {choice[2]}") or message
        try:  # under torchrun every rank has the same flags: one rank prints (launch_verdict)
            verdict = agree(failed=True)
        except LaunchAgreementError:
            self.exit(2, f"{self.prog}: error: {message}\n")
        if verdict.rank != verdict.speaker:
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {where(verdict)}{message}\n")

    # argparse's own overloads: the namespace passed in is the one returned.
    @overload
    def parse_args(self, args: Iterable[str] | None = None,
                   namespace: None = None) -> argparse.Namespace: ...
    @overload
    def parse_args(self, args: Iterable[str] | None, namespace: _N) -> _N: ...
    @overload
    def parse_args(self, *, namespace: _N) -> _N: ...

    def parse_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> Any:
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


# Core (vime_pure) field names whose flag is spelled differently: the batching policy's, and
# the parallel layout's short sizes (``ParallelLayout(pp=2)``; ``dp`` has no flag of its own).
FLAG_ALIASES: Mapping[str, str] = {
    "allow_partial_step": "allow_partial_train_step", "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
    "vpp": "num_virtual_stages_per_pipeline_rank"}


def report_failure(command: str, exc: BaseException, *, flags: set[str],
                   aliases: Mapping[str, str] = FLAG_ALIASES, debug: bool = False) -> None:
    """``exc`` as one line, its chained cause (unless already quoted) as one more, the full
    traceback when ``debug``. Example: ``OSError(28, "No space left on device", "ck/x")``
    prints ``vime train: error: OSError: [Errno 28] No space left on device: 'ck/x'``."""
    raw = describe(exc)
    print_error(command, as_flags(raw, flags, aliases))
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None and _flat(str(cause)) not in raw:
        print(f"vime {command}: caused by: {as_flags(describe(cause), flags, aliases)}",
              file=sys.stderr)
    if debug:
        traceback.print_exception(exc, file=sys.stderr)


def _flat(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text).strip()


def as_flags(message: str, flags: set[str], aliases: Mapping[str, str] = FLAG_ALIASES) -> str:
    """Settings spelled as this command's flags: ``global_batch_size=3`` ->
    ``--global-batch-size=3``, ``allow_partial_step=True`` -> ``--allow-partial-train-step``
    (``aliases`` maps core names to flag names), a bare ``max_tokens_per_gpu`` ->
    ``--max-tokens-per-gpu``. A one-word name (``lr``) changes only before ``=``; names that
    are not flags never change."""
    def spell(match: re.Match) -> str:
        name = aliases.get(match.group(1), match.group(1))
        flag = "--" + name.replace("_", "-")
        value = match.group(2)
        if flag not in flags or value is None and "_" not in name:
            return match.group(0)
        negated = f"--no-{name.replace('_', '-')}"
        if value == "=True":
            return flag
        if value == "=False" and negated in flags:
            return negated
        return flag + (value or "")
    return re.sub(r"(?<![\w.\-'\"\[/])([a-z][a-z0-9]*(?:_[a-z0-9]+)*)\b(=True\b|=False\b|=)?",
                  spell, message)
