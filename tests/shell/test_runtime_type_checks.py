"""A real training run under the core's runtime shape and type checks.

``make test`` checks every annotated function of ``vime_pure`` at runtime (jaxtyping + beartype,
``--jaxtyping-packages`` in ``pyproject.toml``), but only in the pytest process: the loop's
multi-process tests run in children where the import hook is not installed, so a shell call that
hands the core the wrong record (a ``BatchMeta`` where the annotation says ``RolloutBatch``)
would go unnoticed. These runs install the hook in the child before anything of vime is
imported, and fail on the first check that does not hold.
"""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

_CHILD = """
import sys
from jaxtyping import install_import_hook
with install_import_hook(["vime_pure"], "beartype.beartype"):
    import vime_pure.staleness
    from vime_shell.cli.main import main
try:  # the hook is live: a wrong record is refused
    vime_pure.staleness.staleness_metrics(object(), 0)
    sys.exit("the jaxtyping import hook did not wrap vime_pure")
except Exception as exc:
    assert type(exc).__name__ == "TypeCheckError", exc
sys.exit(main(["train", *sys.argv[1:]]))
"""

RUNS = {
    "default": [],
    "steps_and_dynamic_sampling": [
        "--num-steps-per-rollout", "2", "--over-sampling-batch-size", "24",
        "--dynamic-sampling-filter-path", "vime_shell.rollout.filters:nonzero_reward_std",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--use-tis"],
}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_training_run_passes_the_cores_runtime_type_checks(tmp_path, name):
    argv = ["--num-rollout", "2", "--run-dir", str(tmp_path / "run"), *RUNS[name]]
    done = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "done: 2 rollouts" in done.stderr
