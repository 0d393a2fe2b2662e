"""The design card, checked: the core is torch-free and never imports the shell, and one flag
means one thing in both CLIs (the same ``Schedule`` from ``vime train`` and ``vime schedule``).
"""

import argparse
import ast
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
