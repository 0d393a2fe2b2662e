"""Ctrl-C during a run: where it stopped and how to resume.

The loop turns a ``KeyboardInterrupt`` (SIGINT) into :class:`RunInterrupted`, which names the
rollout it was at and the ``--save`` directory; the CLI prints :func:`interrupt_line` once and
exits with status 130 (128 + SIGINT, the shell's convention). A Ctrl-C that some wrapper turned
into an error on its way up (a plugin's error naming ``KeyboardInterrupt`` as its cause) counts
as the interrupt it was: :func:`is_interrupt` reads the chain.

A Ctrl-C must stop the run even when its ``KeyboardInterrupt`` is lost: Python raises it at
whatever bytecode runs next, which may be a ``__del__``, a weakref callback or a library's
``except BaseException`` (torch's distributed checkpoint wraps it), where it is printed or
wrapped and dropped; a run was seen to go on for 4,600 rollouts after one. So the loops install
:func:`catch_interrupts`, whose handler also records the signal, and call
:func:`raise_if_interrupted` between rollouts: a lost interrupt stops the run at the next
rollout boundary. A second Ctrl-C while the first is pending ends the process at once (status
130), for a run stuck where no boundary comes.

SIGTERM keeps Python's default: the process ends at once. torchrun sends it to every rank when
one rank failed, and a scheduler when a job is cancelled; a resume then starts from the newest
checkpoint in ``--save``, as after Ctrl-C.

Example: ``interrupt_line(RunInterrupted(7, "ck", 5))`` with ``ck/`` holding the checkpoint after
6 rollouts is ``"interrupted at rollout 7; resume with --load ck (it continues at rollout 6)"``.
"""

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from vime_pure.errors import VimeError
from vime_shell.run.checkpoint_index import latest

INTERRUPTED = 130  # 128 + SIGINT: a shell's status for a command ended by Ctrl-C


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during rollout ``rollout_id`` of a run that checkpoints to ``save`` every
    ``save_interval`` rollouts; ``unsaved`` says why there is no checkpoint when ``save`` is
    None."""

    def __init__(self, rollout_id: int, save: str | None, save_interval: int | None = None,
                 *, unsaved: str = "no --save"):
        super().__init__(f"interrupted at rollout {rollout_id}")
        self.rollout_id, self.save, self.save_interval = rollout_id, save, save_interval
        self.unsaved = unsaved


_PENDING = threading.Event()  # a Ctrl-C arrived and no rollout boundary has seen it yet


def _on_sigint(signum: int, frame: object) -> None:
    if _PENDING.is_set():  # the second Ctrl-C: the first one was lost or is stuck
        print("vime train: interrupted again; exiting now", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)
    _PENDING.set()
    raise KeyboardInterrupt


@contextlib.contextmanager
def catch_interrupts() -> Iterator[None]:
    """Record every Ctrl-C (module docstring) while the body runs; Python's handler again
    after. Outside the main thread (an in-process test's worker) signals cannot be handled:
    nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    _PENDING.clear()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _PENDING.clear()


def raise_if_interrupted() -> None:
    """A rollout boundary: raise the Ctrl-C that arrived since, even if its own
    ``KeyboardInterrupt`` was lost on the way."""
    if _PENDING.is_set():
        raise KeyboardInterrupt


def is_interrupt(exc: BaseException) -> bool:
    """``exc`` is a Ctrl-C, or an error raised while handling one or caused by one."""
    return interrupt_in(exc) is not None


def interrupt_in(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The innermost-known ``KeyboardInterrupt`` in ``exc``'s chain (a :class:`RunInterrupted`
    first: it knows the rollout), or None."""
    seen, found = set(), None
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RunInterrupted):
            return exc
        if isinstance(exc, KeyboardInterrupt) and found is None:
            found = exc
        exc = exc.__cause__ or exc.__context__
    return found


def interrupt_line(exc: BaseException) -> str:
    """What an interrupted run says (module docstring): the rollout and how to resume, or that
    there is no checkpoint to resume from."""
    found = interrupt_in(exc)
    if not isinstance(found, RunInterrupted):
        return "interrupted before the first rollout; rerun the same command to start again"
    head = f"interrupted at rollout {found.rollout_id}"
    if found.save is None:
        return f"{head}; no checkpoint to resume from ({found.unsaved}): rerun to start over"
    try:
        newest = latest(Path(found.save).expanduser())
    except VimeError as error:  # a damaged tracker: say so rather than fail the report
        return f"{head}; the checkpoint in --save {found.save} cannot be read ({error})"
    if newest is None:
        every = "" if found.save_interval is None else \
            f", written every --save-interval {found.save_interval} rollouts"
        return (f"{head}; no checkpoint in --save {found.save} yet{every}: rerun to start "
                "over")
    done = int(newest.name.split("_")[-1])
    return f"{head}; resume with --load {found.save} (it continues at rollout {done})"
