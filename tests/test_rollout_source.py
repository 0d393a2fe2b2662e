"""One rollout side: every source kind (colocated, replayed dumps, engine ranks of their own)
is a ``RolloutSource``; the step and rank 0's planning never tell sources apart or read the mode
(an AST walk); the mode is spelled once, as ``Asynchrony``; a source without an engine syncs
nothing, and the probe follows the asynchrony alone.

The sources' behaviour in real runs: colocated ``tests/shell/test_train_loop.py``, replayed
``tests/shell/test_replay.py``, engine ranks of their own ``tests/shell/test_async_ranks.py``
and ``tests/shell/test_fully_async_ranks.py`` (and ``tests/test_health.py``'s remote source).
"""

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from vime_pure.async_pool import Asynchrony, SyncMode
from vime_pure.data.rewards import RewardNormalization
from vime_shell.sources.base import Produced, RolloutSource, SyncReport
from vime_shell.sources.colocated import ColocatedSource
from vime_shell.settings.launch_plan import LaunchPlan
from vime_shell.settings.train_config import ConfigError
from vime_shell.sources.remote import RemoteRollouts, _Server, needs_probe
from vime_shell.sources.replay import ReplaySource
from vime_shell.sources.replayed import ReplayedRollouts
from vime_shell.sources.rollouts import GenerationStats
from vime_shell.train.planning import PlanInputs, plan_rollout

SHELL = Path(__file__).resolve().parents[1] / "src" / "vime_shell"
SOURCES = (ColocatedSource, ReplayedRollouts, RemoteRollouts)
METHODS = ("next", "sync", "evaluate", "holder_name", "state", "restore", "close")


@pytest.mark.parametrize("kind", SOURCES, ids=lambda k: k.__name__)
def test_every_source_kind_has_the_protocols_methods_with_its_parameters(kind):
    for name in METHODS:
        wanted = list(inspect.signature(getattr(RolloutSource, name)).parameters)
        have = list(inspect.signature(getattr(kind, name)).parameters)
        if have[:1] != ["self"]:  # a staticmethod (holder_name = rank_name)
            have = ["self", *have]
        assert have == wanted, (kind.__name__, name)


@pytest.mark.parametrize("kind", SOURCES, ids=lambda k: k.__name__)
def test_every_source_kind_says_its_engine_normalization_exchange_and_whether_it_generates(
        kind):
    """Class attributes, properties or ``__init__`` assignments (what the step reads)."""
    init = ast.parse(inspect.getsource(kind))
    assigned = {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Attribute)}
    for name in ("engine", "normalization", "generates", "exchange_group"):
        assert hasattr(kind, name) or name in assigned, (kind.__name__, name)


def test_a_replay_is_a_rollout_source_that_never_generates():
    source = ReplayedRollouts(ReplaySource(template="dumps/r{rollout_id}.npz"))
    assert isinstance(source, RolloutSource)
    assert (source.generates, source.engine, source.state()) == (False, None, None)
    assert source.normalization == RewardNormalization()


def test_a_source_without_an_engine_syncs_nothing_and_never_exports():
    def export():
        raise AssertionError("a train-only replay must not run the trainer's export")

    report = ReplayedRollouts(ReplaySource(template="d.npz")).sync(export, 3)
    assert report == SyncReport() and not report.probed


@pytest.mark.parametrize("asynchrony, probed", [
    (Asynchrony(mode=SyncMode.SYNC), False),
    (Asynchrony(mode=SyncMode.SYNC, update_weights_interval=2), True),
    (Asynchrony(mode=SyncMode.ONE_STEP_OFF), True),
    (Asynchrony(mode=SyncMode.ONE_STEP_OFF, max_staleness=0), False),  # synchronous again
    (Asynchrony(mode=SyncMode.FULLY_ASYNC, max_staleness=0), False),
    (Asynchrony(mode=SyncMode.FULLY_ASYNC, max_staleness=2), True),
])
def test_a_sync_is_probed_exactly_when_the_next_batch_may_be_older(asynchrony, probed):
    assert needs_probe(asynchrony) is probed


def test_planning_a_rollout_with_nothing_left_skips_it():
    inputs = PlanInputs(rollout_id=4, produced=Produced(), weight_version=4, generates=True,
                        logprob_check=True, max_staleness=None,
                        normalization=RewardNormalization(), layout=None, policy=None,
                        flops=lambda lengths: None, rollout_function="f")
    assert plan_rollout(inputs, None) == (None, {"stats": {}})


class _Filtered:
    """A producer whose filter removed every prompt group of the rollout (no batch)."""

    source = SimpleNamespace(offset=16, draws=1)  # where the prompt source stands
    sharded = False  # the whole batch on engine rank 0 (a rollout-log hook)

    def produce(self, rid):
        return None, GenerationStats(rounds=8, prompts_generated=128, prompts_kept=0,
                                     prompts_filtered=128)

    def partial_state(self):
        return {}


def test_an_engine_rank_replies_no_batch_when_the_filter_removed_every_group():
    reply = _Server(_Filtered(), SimpleNamespace(bridge=SimpleNamespace(rank=1)))._generate(3, None)
    assert reply[:3] == ("batch", 3, None)  # the trainer skips the rollout (Produced.whole)
    assert reply[3]["prompts_filtered"] == 128 and reply[3]["weight_version"] == 0


def test_a_train_only_replay_plan_names_its_flag_when_asked_for_engines():
    plan = LaunchPlan(hf_dir=Path("m"), layout=None, policy=None, prompts=None, task=None,
                      eval_sets=(), num_rollout=1, engine_layout=None, run_id="r")
    with pytest.raises(ConfigError, match=r"^--load-rollout-data-mode='train-only': builds no "
                       r"rollout engine, which --debug-rollout-only needs\. Fix: "):
        plan.built_engine_layout("--debug-rollout-only")


# -- the step is mode-free --------------------------------------------------------------------
_SOURCE_NAMES = {"ColocatedSource", "ReplayedRollouts", "RemoteRollouts", "RolloutProducer",
                 "EngineGroup", "ReplaySource"}
_MODE_WORDS = {"mode", "pooled", "lag", "train_async", "fully_async", "SyncMode"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


@pytest.mark.parametrize("module", ["train/step.py", "train/planning.py", "run/driver.py"])
def test_the_step_and_the_run_tell_no_source_apart(module):
    tree = ast.parse((SHELL / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "isinstance":
            assert not _names(node.args[1]) & _SOURCE_NAMES, ast.unparse(node)


@pytest.mark.parametrize("module", ["train/step.py", "train/planning.py"])
def test_the_step_reads_no_mode(module):
    """Its bound ``K`` arrives as a number; which mode produced a batch is the source's."""
    tree = ast.parse((SHELL / module).read_text())
    body = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    read = set().union(*(_names(n) for n in body)) & _MODE_WORDS
    constants = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert not read and not constants & {"sync", "one_step_off", "fully_async"}


def test_the_mode_is_spelled_as_a_string_nowhere_in_the_shell():
    """``Asynchrony`` / ``SyncMode`` are the one spelling; the strings appear only where
    argparse attributes are read (``getattr(args, "fully_async")``)."""
    for path in SHELL.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
                assert not constants & {"one_step_off", "fully_async"}, (path, ast.unparse(node))
