"""Every message says how to fix it once and names what the user typed (issue 31).

Mechanical checks over the source (no message holds two ``Fix:``; no message of the shell calls
a vime function by name) and over what ``vime train`` prints for a corpus of bad launches (each
line passes ``tests.fuzz.harness.check_cli_line``: one ``Fix:``, flags rather than Python names,
no vime function). The fuzz harness applies the same rules to every error it provokes
(``check_message``, and ``check_cli_line`` for command lines).
"""

import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from tests.fuzz.harness import SRC, VIME_NAMES, check_cli_line
from vime_shell.cli.main import main
from vime_shell.cli.parser import as_flags

# Shell messages where naming a Python function is the fix: errors of a Python API that only
# library code reaches (``vime train`` builds these objects itself), and the signature a
# plugin must have. (file, name): why.
PYTHON_API_NAMES = {
    ("vime_shell/engines/hf.py", "build_embedded"): "HfEngine(model_path) of a library user",
    ("vime_shell/engines/hf.py", "from_model"): "HfEngine built from a model object",
    ("vime_shell/megatron/trainer.py", "scheduler_layout"): "MegatronTrainer.train's records",
    ("vime_shell/megatron/trainer.py", "rank_batch"): "MegatronTrainer.train's records",
    ("vime_shell/megatron/trainer.py", "load_frozen"): "MegatronTrainer's frozen models",
    ("vime_shell/rollout/generate.py", "use_runtime"): "generate() outside a rollout",
    ("vime_shell/rollout/generate.py", "GenerateRuntime"): "generate() outside a rollout",
    ("vime_shell/rollout/per_sample.py", "RolloutContext"): "generate_rollout outside vime",
    ("vime_shell/rollout/per_sample.py", "PerSample"): "generate_rollout outside vime",
    ("vime_shell/rollout/plugins.py", "generate"): "the signature a generate plugin must have",
    ("vime_shell/agents/agent.py", "run_agent"): "the signature an agent function must have",
}


def _literal(node: ast.AST) -> str | None:
    """The literal text of a string expression (an f-string's values as ``{}``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left), _literal(node.right)
        if left is not None or right is not None:
            return (left or "{}") + (right or "{}")
    return None


def _messages(root: Path):
    """``(file, line, text)`` of every call whose string arguments carry a ``Fix:`` or that
    builds a ``field_error`` (its ``fix`` argument is the Fix clause)."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            texts = [t for t in map(_literal, [*node.args, *(k.value for k in node.keywords)])
                     if t]
            field_error = ast.unparse(node.func).endswith("field_error")
            text = " ".join(texts)
            if field_error or "Fix:" in text:
                yield (path.relative_to(SRC).as_posix(), node.lineno,
                       text + (" Fix:" if field_error else ""))


def test_no_message_in_the_source_has_two_fix_clauses():
    twice = [(f, n, t) for f, n, t in _messages(SRC) if t.count("Fix:") > 1]
    assert not twice, twice


def test_no_shell_message_calls_a_vime_function_by_name():
    calls = [(f, n, name) for f, n, t in _messages(SRC / "vime_shell")
             for name in re.findall(r"\b([A-Za-z_]\w*)\((?!s\))", t)  # not "set(s)"
             if name in VIME_NAMES and (f, name) not in PYTHON_API_NAMES]
    assert not calls, calls


# Bad launches, each refused with one line: (WORLD_SIZE, flags).
BAD_LAUNCHES = [
    (1, "--num-rollout 0"), (1, "--lr -1"), (1, "--seed -1"), (1, "--global-batch-size 0"),
    (1, "--max-weight-staleness 2"), (1, "--rollout-num-gpus 2"), (1, "--eval-interval 0"),
    (1, "--n-samples-per-prompt 0"), (1, "--use-kl-loss --kl-coef -1"),
    (1, "--over-sampling-batch-size 2"), (1, "--save-interval 0"), (1, "--reward-timeout 0"),
    (1, "--rollout-temperature -1"), (1, "--eps-clip -1"), (1, "--tensor-model-parallel-size 3"),
    (1, "--global-batch-size 3 --micro-batch-size 2 --max-tokens-per-gpu none"),
    (2, "--global-batch-size 1 --max-tokens-per-gpu 200 --allow-partial-train-step"),
    (2, "--global-batch-size 2 --micro-batch-size 2 --max-tokens-per-gpu none"),
    (2, "--fully-async --rollout-num-gpus 1 --debug-rollout-only"),
    (2, "--fully-async --rollout-num-gpus 1 --max-weight-staleness 0 "
        "--update-weights-interval 2"),
    (2, "--rollout-num-gpus-per-engine 3"), (2, "--context-parallel-size 2"),
    (2, "--fully-async --train-async --rollout-num-gpus 1"), (2, "--fully-async"),
    (3, "--tensor-model-parallel-size 2"), (3, "--pipeline-model-parallel-size 3"),
    (4, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2"),
    (2, "--expert-model-parallel-size 2"),
]


@pytest.mark.parametrize("world, flags", BAD_LAUNCHES)
def test_a_bad_launch_is_one_line_in_flags(world, flags, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["train", "--dry-run", "--run-dir", str(tmp_path / "run"),
                       *shlex.split(flags)])
    lines = [x for x in err.getvalue().splitlines() if not x.startswith("vime train: note:")]
    assert status == 2 and len(lines) == 1, err.getvalue()
    assert lines[0].startswith("vime train: error: ")
    check_cli_line(lines[0])


def test_the_cores_layout_names_read_as_the_commands_flags():
    flags = {"--pipeline-model-parallel-size", "--context-parallel-size",
             "--global-batch-size"}
    assert as_flags("global_batch_size=3 with pp=2, cp=2 and dp=4", flags) == \
        "--global-batch-size=3 with --pipeline-model-parallel-size=2, --context-parallel-size=2 " \
        "and dp=4"  # dp: the ranks left over, no flag of its own
