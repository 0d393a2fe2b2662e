"""Which share of slime's / miles' example launch scripts does ``vime train`` accept, flag by flag?

For each launch script (``scripts/**.sh`` and ``examples/**.sh`` that start ``train.py`` or
``train_async.py``) it collects the flags the training command passes: the bash arrays it
expands (``${PERF_ARGS[@]}``), the flags on the command line itself, and ``MODEL_ARGS`` from
the ``scripts/models/*.sh`` file it sources (or miles' ``tests/snapshots/model_args/*.txt``),
slime's Weights & Biases flags included (vime takes them). A flag is
*refused* when ``vime train`` has no such option or its table of unsupported flags names it,
when the script gives it a literal value outside the flag's choices (``--train-backend fsdp``),
when ``--spec`` names a layer spec vime does not build (the script's or its model file's), when
a plugin path names a module of slime's or miles' own that vime has no counterpart of, or
when the script turns on a switch slime reads from the job's environment that vime refuses
(``UNSUPPORTED_ENV``: int4 QAT);
``--sglang-*`` / ``--vllm-*`` are accepted (mapped or warned about). A script is *accepted*
when it has no refused flag.

Run against local checkouts (a work tree or a bare mirror; the anchors' files stay there):
``PYTHONPATH=src python -m benchmarks.slime_flag_coverage --repo slime=/path/to/slime
--repo miles=/path/to/miles [--top 30]``. Prints per repository ``accepted scripts / scripts``,
the median and range of refused flags per script, and the most frequent refused flags with
vime's table line.
"""

import argparse
import re
import statistics
import subprocess
from collections import Counter
from pathlib import Path

from vime_shell.cli.main import build_parser
from vime_shell.settings.megatron_args import SPEC_MODEL_TYPES, spec_refusal
from vime_shell.settings.slime_flags import (FULLY_ASYNC_ROLLOUTS, SLIME_VALUES, UNSUPPORTED,
                                             UNSUPPORTED_ENV, unsupported_line)

FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])")
ARRAY_START = re.compile(r"([A-Z_][A-Z0-9_]*)\+?=\(")


def arrays_of(text: str) -> list[tuple[str, str]]:
    """``(name, body)`` of every bash array assignment ``NAME=( ... )`` / ``NAME+=( ... )``;
    the body ends at the parenthesis that closes the array, so an arithmetic ``$((a + b))``
    or a ``$(command)`` inside it does not end it early."""
    out = []
    for found in ARRAY_START.finditer(text):
        depth, end = 1, found.end()
        while end < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        out.append((found.group(1), text[found.end():end - 1]))
    return out


class Repo:
    """Files of a work tree, or of a bare git directory at HEAD."""

    def __init__(self, path: Path):
        self.path = path
        self.bare = not (path / ".git").exists() and (path / "HEAD").is_file()

    def names(self) -> list[str]:
        if self.bare:
            out = subprocess.run(["git", f"--git-dir={self.path}", "ls-tree", "-r",
                                  "--name-only", "HEAD"], capture_output=True, text=True)
            return out.stdout.split()
        return [str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file()]

    def read(self, name: str) -> str:
        if self.bare:
            return subprocess.run(["git", f"--git-dir={self.path}", "show", f"HEAD:{name}"],
                                  capture_output=True, text=True).stdout
        return (self.path / name).read_text(errors="replace")


def _code(text: str) -> str:
    """The script without comment lines and trailing comments."""
    lines = (re.sub(r"\s#.*$", "", line) for line in text.splitlines()
             if not line.lstrip().startswith("#"))
    return "\n".join(lines)


def _command(text: str) -> tuple[list[str], list[str]] | None:
    """Flags and expanded arrays of the ``train.py`` command (with its continuation lines)."""
    found = re.search(r"\btrain(_async)?\.py\b", text)
    if found is None:
        return None
    lines = []
    for line in text[found.end():].splitlines():
        lines.append(line)
        if not line.rstrip().endswith("\\"):
            break
    cmd = "\n".join(lines)
    return FLAG.findall(cmd), re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)\[@\]\}?", cmd)


def _model_files(repo: Repo, names: set[str], text: str) -> list[str]:
    """The ``scripts/models/*.sh`` files a script sources, as code."""
    return [_code(repo.read(f"scripts/models/{model}.sh"))
            for model in re.findall(r"models/([\w.\-]+)\.sh", text)
            if f"scripts/models/{model}.sh" in names]


def script_flags(repo: Repo, names: set[str], name: str) -> list[str] | None:
    text = _code(repo.read(name))
    command = _command(text)
    if command is None:
        return None
    flags, used = command
    arrays: dict[str, list[str]] = {}
    for array, body in arrays_of(text):
        arrays.setdefault(array, []).extend(FLAG.findall(body))
    for used_name in used:
        flags += arrays.get(used_name, [])
    if "MODEL_ARGS" in used and "MODEL_ARGS" not in arrays:
        for body in _model_files(repo, names, text):
            flags += [f for a, b in arrays_of(body) if a == "MODEL_ARGS"
                      for f in FLAG.findall(b)]
        for model in re.findall(r"model_args_utils\.py\"?\s+\"?([\w.\-]+)", text):
            snapshot = f"tests/snapshots/model_args/{model}.txt"
            if snapshot in names:
                flags += FLAG.findall(repo.read(snapshot))
    return flags


def _train_actions() -> list:
    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and a.choices
               and "train" in a.choices)
    return sub.choices["train"]._actions


def accepted_flags() -> set[str]:
    return {s for a in _train_actions() for s in a.option_strings}


def flag_choices() -> dict[str, tuple]:
    """Each ``vime train`` flag with a choice list -> its choices."""
    return {s: tuple(map(str, a.choices)) for a in _train_actions() if a.choices
            for s in a.option_strings}


def refused_values(repo: Repo, name: str, choices: dict[str, tuple]) -> set[str]:
    """Flags the script passes a literal value vime's choice list lacks (``--train-backend
    fsdp``); values from shell variables are not judged."""
    pairs = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)[ \t]+([A-Za-z0-9_.\-]+)(?=[\s\\)])",
                       _code(repo.read(name)))
    return {f"{flag} {value}" for flag, value in pairs
            if flag in choices and value not in choices[flag] and not value.startswith("-")}


def refused_specs(repo: Repo, names: set[str], name: str) -> set[str]:
    """``--spec MODULE FUNCTION`` values (in the script or the model file it sources) that
    vime does not build (``SPEC_MODEL_TYPES``), as ``--spec MODULE``."""
    text = _code(repo.read(name))
    found = re.findall(r'--spec\s+"?([\w.]+)"?\s+"?(\w+)"?',
                       "\n".join([text, *_model_files(repo, names, text)]))
    return {f"--spec {module}" for module, function in found
            if f"{module} {function}" not in SPEC_MODEL_TYPES}


def refused_paths(repo: Repo, name: str, choices: dict[str, tuple]) -> set[str]:
    """Plugin paths (``--*-path`` / ``--*-function`` values) naming slime's or miles' own
    modules that vime has no counterpart of: they fail at launch ("not importable"), as
    slime's dynamic-sampling filter did before it was mapped. vime's counterparts are
    ``SLIME_VALUES``, a flag's own choices (the OPD post-process paths) and slime's
    fully-async rollout function; a user plugin (``examples.``) is the user's to put on
    PYTHONPATH, as with slime."""
    found = re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*(?:-path|-function))[ \t=]+"
                       r"((?:slime|miles)\.[\w.:]+)", _code(repo.read(name)))
    mapped = {(setting, value) for setting, value in SLIME_VALUES}
    return {f"--{flag} {value}" for flag, value in found
            if (flag.replace("-", "_"), value) not in mapped
            and value not in (*choices.get(f"--{flag}", ()), *FULLY_ASYNC_ROLLOUTS)}


def refused_env(repo: Repo, name: str) -> set[str]:
    """slime switches the script turns on in its job's environment (``UNSUPPORTED_ENV``: the
    int4 QAT flag in the Ray runtime env), as ``env NAME``."""
    text = _code(repo.read(name))
    return {f"env {var}" for var in UNSUPPORTED_ENV
            if re.search(rf'{var}\\?"?\s*[:=]\s*\\?"?1', text)}


def coverage(repo: Repo, accepted: set[str]) -> dict:
    choices = flag_choices()
    names = repo.names()
    known = set(names)
    refused_per_script, refused = [], Counter()
    for name in sorted(names):
        if not (name.endswith(".sh") and re.match(r"(scripts|examples)/", name)
                and "/models/" not in name):
            continue
        flags = script_flags(repo, known, name)
        if flags is None:
            continue
        bad = {f for f in set(flags) if f in UNSUPPORTED or (
            f not in accepted and not f.startswith(("--sglang-", "--vllm-")))}
        bad |= refused_values(repo, name, choices) | refused_specs(repo, known, name)
        bad |= refused_env(repo, name) | refused_paths(repo, name, choices)
        refused_per_script.append(len(bad))
        refused.update(bad)
    return {"scripts": len(refused_per_script),
            "accepted": sum(n == 0 for n in refused_per_script),
            "median": statistics.median(refused_per_script) if refused_per_script else 0,
            "range": (min(refused_per_script, default=0), max(refused_per_script, default=0)),
            "refused": refused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--top", type=int, default=30, help="refused flags to list")
    args = ap.parse_args()
    accepted = accepted_flags()
    for spec in args.repo:
        label, _, path = spec.partition("=")
        result = coverage(Repo(Path(path).expanduser()), accepted)
        print(f"{label}: {result['accepted']}/{result['scripts']} launch scripts fully accepted;"
              f" refused flags per script: median {result['median']}, range "
              f"{result['range'][0]}-{result['range'][1]}")
        for flag, count in result["refused"].most_common(args.top):
            env = UNSUPPORTED_ENV.get(flag.removeprefix("env "))
            line = (f"{flag}: not supported in vime ({env})" if env else None) or \
                unsupported_line(flag) or (
                f"{flag}: {spec_refusal(flag.removeprefix('--spec '))}"
                if flag.startswith("--spec ") else f"{flag}: not one of vime's choices"
                if " " in flag else f"{flag}: no vime option")
            print(f"  {count:3d}  {line}")


if __name__ == "__main__":
    main()
