"""Ctrl-C ends ``vime train`` with ``interrupted at rollout k; resume with --load DIR`` (or why
there is nothing to resume) and exit status 130 (``vime_shell.run.interrupts``)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vime_shell.cli import main as cli_main
from vime_shell.rollout.plugins import PluginError
from vime_shell.run.checkpoint_index import LOOP_STATE, TRACKER
from vime_shell.run.interrupts import (RunInterrupted, catch_interrupts, interrupt_line,
                                       is_interrupt, raise_if_interrupted)

ROOT = Path(__file__).resolve().parents[1]


def _checkpoint(root: Path, done: int) -> None:
    (root / f"rollout_{done:06d}").mkdir(parents=True)
    (root / f"rollout_{done:06d}" / LOOP_STATE).write_text(json.dumps({"rollouts_done": done}))
    (root / TRACKER).write_text(f"{done}\n")


def test_an_interrupt_names_the_rollout_and_the_load_dir_to_resume_from(tmp_path):
    _checkpoint(tmp_path / "ck", 6)
    assert interrupt_line(RunInterrupted(7, str(tmp_path / "ck"), 3)) == (
        f"interrupted at rollout 7; resume with --load {tmp_path / 'ck'} (it continues at "
        "rollout 6)")


def test_an_interrupt_without_a_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    assert interrupt_line(RunInterrupted(2, None)) == (
        "interrupted at rollout 2; no checkpoint to resume from (no --save): rerun to start over")
    assert interrupt_line(RunInterrupted(0, str(tmp_path / "ck"), 5)) == (
        f"interrupted at rollout 0; no checkpoint in --save {tmp_path / 'ck'} yet, written "
        "every --save-interval 5 rollouts: rerun to start over")
    assert interrupt_line(KeyboardInterrupt()).startswith("interrupted before the first rollout")


def test_a_ctrl_c_a_plugin_wrapper_turned_into_an_error_is_still_an_interrupt():
    try:
        try:
            raise KeyboardInterrupt
        except BaseException as exc:
            raise PluginError("prompt 0: reward m:f exited with KeyboardInterrupt") from exc
    except PluginError as wrapped:
        assert is_interrupt(wrapped)
        assert interrupt_line(wrapped).startswith("interrupted before the first rollout")
    assert not is_interrupt(PluginError("a plain failure"))


def _wrapped_interrupt() -> PluginError:
    error = PluginError("prompt 0: reward m:f exited with KeyboardInterrupt")
    error.__cause__ = RunInterrupted(4, None)
    return error


@pytest.mark.parametrize("raised", [lambda: RunInterrupted(4, None), _wrapped_interrupt])
def test_the_cli_turns_an_interrupt_into_one_line_and_exit_130(raised, monkeypatch, capsys):
    def interrupted(args):
        raise raised()

    monkeypatch.setattr(cli_main.train_cmd, "run", interrupted)
    monkeypatch.delenv("RANK", raising=False)
    assert cli_main.main(["train"]) == 130
    err = capsys.readouterr().err
    assert err == ("vime train: interrupted at rollout 4; no checkpoint to resume from (no "
                   "--save): rerun to start over\n")


BLOCKING_REWARD = """
import threading, time

CALLS = []

def reward(sample):
    CALLS.append(1)
    if len(CALLS) > 128:  # rollout 1 (16 prompts x 8 samples each): wait for the Ctrl-C
        time.sleep(3600)
    return float(sample.metadata["response"] == sample.metadata["label"])
"""


@pytest.mark.slow
def test_ctrl_c_during_a_run_exits_130_naming_the_rollout_and_the_resume_flag(tmp_path):
    """A real `vime train` on the embedded default gets SIGINT once its first checkpoint is
    saved, while rollout 1's reward waits (so the signal lands inside the run whatever the
    load; read from its own log lines, no sleeps): one line, status 130. Every wait is
    bounded: a run that ignored the Ctrl-C fails the test instead of hanging it."""
    (tmp_path / "blocking.py").write_text(BLOCKING_REWARD)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT / 'src'}",
               OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vime_shell.cli", "train", "--run-dir", "run", "--save", "ck",
         "--save-interval", "1", "--num-rollout", "3", "--custom-rm-path", "blocking:reward"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # ends when the process does: at most 3 rollouts
            seen.append(line)
            if "checkpoint after 1 rollouts saved" in line:
                break
        assert any("rollout    0" in x for x in seen), "".join(seen)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest
    lines = [x for x in rest.splitlines() if "interrupted" in x]
    assert len(lines) == 1 and "Traceback" not in rest, rest
    assert lines[0] == "vime train: interrupted at rollout 1; resume with --load ck (it " \
        "continues at rollout 1)", lines


def test_a_ctrl_c_whose_keyboard_interrupt_was_lost_stops_the_run_at_the_next_rollout():
    """Python raises the Ctrl-C wherever the main thread is; in a ``__del__`` or a library's
    ``except BaseException`` it is dropped (a run went on for 4,600 rollouts). The signal is
    recorded, so the next rollout boundary raises it."""
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a process started in the background
    with catch_interrupts():
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # what a library that swallows it does
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
    raise_if_interrupted()  # outside a run: nothing pending, the handler from before again
    assert signal.getsignal(signal.SIGINT) is before
