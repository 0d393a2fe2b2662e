"""``docs/schedule.md``'s ``vime schedule`` example prints exactly the output the page shows.

The command (with its continuation line) and its output are read from the page's block that
starts with ``$ vime schedule``, so the documentation and the scheduler cannot drift apart: a change
to packing, balancing, the array-backed ``Schedule`` or the kernel set that alters a schedule
fails here.
"""

import shlex
from pathlib import Path

from vime_shell.cli.main import main

SCHEDULE_MD = Path(__file__).resolve().parents[1] / "docs" / "schedule.md"


def _page_example() -> tuple[list[str], list[str]]:
    text = SCHEDULE_MD.read_text()
    start = text.index("$ vime schedule ")
    lines = text[start:text.index("```", start)].splitlines()
    command = [lines[0]]
    while command[-1].endswith("\\"):
        command.append(lines[len(command)])
    argv = shlex.split(" ".join(c.rstrip("\\") for c in command))[2:]  # past "$ vime"
    return argv, [line for line in lines[len(command):] if line.strip()]


def test_docs_vime_schedule_example_output_is_unchanged(capsys):
    """docs/schedule.md's straggler example (dp 8, VPP 2) is reproduced line for line."""
    argv, expected = _page_example()
    assert argv[0] == "schedule" and "--balance" in argv
    assert main(argv) in (0, None)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert printed == expected
