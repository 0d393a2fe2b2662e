"""The design card, checked: the core is torch-free and never imports the shell, the shell's
packages import one way only (``cli -> run -> train -> sources -> settings -> agents, engines,
rollout, megatron, models, storage``), and one flag means one thing in both CLIs (the same ``Schedule``
from ``vime train`` and ``vime schedule``).
"""

import argparse
import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from vime_pure import ParallelLayout, RolloutBatch, Sample, build_schedule, schedule_for
from vime_shell.cli.schedule import add_arguments, load_workload, policy_from_args
from vime_shell.settings.flags import parse_train_config
from vime_shell.storage.dump import save_rollout_batch

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "vime_pure"
SHELL = ROOT / "src" / "vime_shell"
# The shell's packages, each above the ones after it: a module may import its own package and
# those below it, never one above. The leaves (engines, rollout, megatron, models, storage) own
# their choice lists and layouts, which the settings records read; they read no settings.
LEVELS = {"cli": 5, "run": 4, "train": 3, "sources": 2, "settings": 1,
          "agents": 0, "engines": 0, "rollout": 0, "megatron": 0, "models": 0, "storage": 0}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_no_core_module_imports_the_shell_and_only_torch_ops_imports_torch(path):
    imported = _imports(path)
    assert not any(name.split(".")[0] == "vime_shell" for name in imported)
    if "torch_ops" not in path.parts:
        assert not any(name.split(".")[0] in ("torch", "megatron") for name in imported)


def _shell_packages(path: Path) -> set[str]:
    """The ``vime_shell`` packages ``path`` imports, inside functions too."""
    packages = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "vime_shell":
            names = [f"vime_shell.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        else:
            continue
        packages |= {n.split(".")[1] for n in names
                     if n.startswith("vime_shell.") and n.count(".") >= 1}
    return packages


def test_every_shell_module_sits_in_a_package_of_the_order():
    packages = {p.relative_to(SHELL).parts[0] for p in SHELL.rglob("*.py")} - {"__init__.py"}
    assert packages == set(LEVELS)


@pytest.mark.parametrize("path", sorted(p for p in SHELL.rglob("*.py") if p.parent != SHELL),
                         ids=lambda p: str(p.relative_to(SHELL)))
def test_shell_packages_import_only_their_own_and_those_below(path):
    own = path.relative_to(SHELL).parts[0]
    above = {p for p in _shell_packages(path) if p in LEVELS and LEVELS[p] > LEVELS[own]}
    assert not above, f"{path.relative_to(SHELL)} ({own}) imports {sorted(above)}, above it"


def test_the_loop_package_is_gone():
    """No module is left in ``vime_shell/loop`` (a checkout from before the split may keep an
    empty folder of byte-code caches: that is no package)."""
    assert not list((SHELL / "loop").rglob("*.py"))
    spec = importlib.util.find_spec("vime_shell.loop")
    assert spec is None or spec.origin is None  # at most a namespace of leftover caches


def test_importing_the_core_and_star_loads_no_torch():
    code = ("import sys; import vime_pure; from vime_pure import *; "
            "import vime_pure.scheduling.planner, vime_pure.data.microbatch; "
            "bad = [m for m in ('torch', 'megatron', 'transformers', 'vime_shell') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={"PYTHONPATH": str(ROOT / "src")})


@pytest.mark.parametrize("flags", [["--balance-by-flops"], ["--balance-data"],
                                   ["--balance", "straggler"], ["--packing", "first_fit"],
                                   ["--packing", "flops", "--balance-data"]])
def test_train_and_schedule_flags_give_the_same_schedule_on_a_dump(tmp_path, flags):
    output = [[Sample(tokens=[1] * (4 + (3 * p + k) % 11), response_length=2,
                      reward=float(k % 2), group_id=f"p{p}-{k}", prompt_group=p)
               for k in range(4)] for p in range(8)]
    batch = RolloutBatch.from_samples(output)
    dump = save_rollout_batch(tmp_path / "rollout_0.npz", batch)
    common = ["--global-batch-size", "16", "--max-tokens-per-gpu", "24", *flags]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--input", str(dump), "--dp", "2", *common])
    layout, schedule_policy = policy_from_args(args)
    lengths, groups = load_workload(args)
    train_policy = parse_train_config(common).batching_policy()
    assert train_policy == schedule_policy
    assert build_schedule(lengths, groups, layout, schedule_policy) == schedule_for(
        batch, ParallelLayout(dp=2), train_policy)
