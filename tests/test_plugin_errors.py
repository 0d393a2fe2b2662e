"""Plugin errors are one line that names the plugin, its flag and the prompt or sample, with
exactly one "Fix:" (issue 31): a plugin module whose own imports fail (a plugin written for
slime), a malformed sample a plugin returned (the core names only ``output[0][0][0]``), rewards
scored together, and a rank's error line wrapped by the rank that reports it.
"""

import sys
import textwrap

import pytest

from vime_pure import RolloutValidationError, Sample
from vime_pure.data.rewards import RewardNormalization
from vime_pure.errors import relayed
from vime_shell.cli.main import main
from vime_shell.rollout.plugins import PluginError, load_callable
from vime_shell.rollout.rewards import Rewarder, RewardFunctionError
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.rollouts import batch_of, output_source


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Modules as users write them: one ported from slime unchanged, one importing a package
    that is not installed, one that fails at its top level."""
    (tmp_path / "retool_port.py").write_text(textwrap.dedent("""
        from slime.rollout.sglang_rollout import GenerateState  # noqa: F401

        async def generate(args, sample, sampling_params):
            return sample
    """))
    (tmp_path / "needs_pkg.py").write_text("import surely_not_installed_pkg\n"
                                           "def rm(sample):\n    return 0.0\n")
    (tmp_path / "breaks.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield
    for name in ("retool_port", "needs_pkg", "breaks"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("flag, path, words", [
    ("--custom-generate-function-path", "retool_port:generate",
     ["module 'retool_port' fails to import: ModuleNotFoundError: No module named 'slime'",
      "retool_port is written for slime, which vime does not include"]),
    ("--custom-rm-path", "needs_pkg:rm",
     ["No module named 'surely_not_installed_pkg'", "install surely_not_installed_pkg"]),
    ("--custom-rm-path", "breaks:rm",
     ["module 'breaks' raised RuntimeError while being imported: no GPU here"])])
def test_a_plugin_whose_imports_fail_is_one_line_and_exit_2(plugins, capsys, flag, path, words):
    """A plugin whose module fails to import (its own imports included): one typed line naming
    the flag, the module and the missing package; exit 2, no traceback."""
    with pytest.raises(PluginError) as info:
        load_callable(path, flag=flag)
    assert isinstance(info.value.__cause__, Exception)  # chained: --log-level debug shows it
    assert main(["train", flag, path, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith(f"vime train: error: {flag}='{path}': ") and err.count("Fix:") == 1
    assert all(w in err for w in words), err


def test_a_plugin_import_failure_keeps_its_traceback_under_debug(plugins, capsys):
    assert main(["train", "--custom-rm-path", "needs_pkg:rm", "--dry-run",
                 "--log-level", "debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "import surely_not_installed_pkg" in err


def _sample(**fields) -> Sample:
    return Sample(**{"tokens": [1, 2, 3], "response_length": 2, "reward": 1.0,
                     "metadata": {"prompt": "47>"}, **fields})


def test_a_malformed_sample_names_the_plugin_and_its_prompt():
    """The core names only the sample's place (``output[0][0][0]``); the loop adds the rollout,
    the plugin with its flag, and the sample's prompt."""
    source = output_source(TrainConfig(custom_generate_function_path="my.mod:gen"))
    assert source == "--custom-generate-function-path my.mod:gen"
    output = [[[_sample(loss_mask=[1, 1, 1, 1, 1])]]]
    with pytest.raises(RolloutValidationError) as info:
        batch_of(output, RewardNormalization(), 3, source)
    message = str(info.value)
    assert message.startswith("rollout 3, prompt '47>' (output[0][0][0]): the sample "
                              "--custom-generate-function-path my.mod:gen returned: "
                              "len(loss_mask)=5 but response_length=2")
    assert message.count("Fix:") == 1
    assert output_source(TrainConfig()) == ("--rollout-function-path "
                                            "vime_shell.rollout.functions:single_turn_rollout")


def test_rewards_scored_together_are_named_without_dots():
    """An async per-sample reward scores every prompt at once: its error names the span."""
    rewarder = Rewarder(fn=lambda samples: [1.0], name="my.mod:rm", concurrent=True)
    groups = [[_sample()], [_sample()], [_sample()]]
    with pytest.raises(RewardFunctionError) as info:
        rewarder.score_groups(groups, lambda p: f"prompt {p}")
    message = str(info.value)
    assert message.startswith("prompt 0 to prompt 2 (scored together): reward my.mod:rm "
                              "returned [1.0] for 3 samples. Fix: make the function "
                              "--custom-rm-path names return one float per sample")
    assert ".." not in message and message.count("Fix:") == 1


def test_a_ranks_error_line_wrapped_by_another_keeps_one_fix():
    """The trainer reports an engine rank's line (which has its own Fix) without a second
    Fix, a ".." or a traceback it does not show; the other failing ranks are named."""
    line = relayed("rollout generation", [
        ("engine rank 0 (global rank 1)", "RewardFunctionError: prompt 1, sample 0: reward math "
         "raised ValueError: x. Fix: correct it."),
        ("engine rank 1 (global rank 2)", "Boom")], "see the error line that rank printed")
    assert line == ("rollout generation failed on engine rank 0 (global rank 1) (and on engine "
                    "rank 1 (global rank 2)): RewardFunctionError: prompt 1, sample 0: reward "
                    "math raised ValueError: x. Fix: correct it.")
    assert relayed("weight sync", [("rank 1", "Boom")], "see rank 1") == \
        "weight sync failed on rank 1: Boom. Fix: see rank 1."
