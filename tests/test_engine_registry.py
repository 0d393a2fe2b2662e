"""The engine registry keeps its promise: a new engine is one class plus one ``ENGINES`` record.

``EchoEngine`` is a trial third engine that lives only here: registered at run time (as a new
module's record in ``vime_shell.engines.ENGINES`` would be), ``vime train --dry-run
--rollout-engine echo`` resolves, checks and reports it, and the engine group builds it from a
run's settings, with no other file touched. Every decision that used to compare engine names
reads the engine's traits instead (a test walks ``src/`` for comparisons with a name), so a
trait set on a trial engine changes the decision and its message names the flag.
"""

import ast
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest

from vime_shell.cli.main import main
from vime_shell.engines import ENGINE_NAMES, ENGINES, engine_traits, resolve_engine_name
from vime_shell.engines.base import Generation, RolloutEngine, SamplingParams
from vime_shell.engines.group import EngineGroup, build_local_engine
from vime_shell.engines.layout import EngineLayoutError, resolve_engine_layout
from vime_shell.engines.traits import EngineTraits
from vime_shell.megatron.layout import resolve_layout
from vime_shell.models.embedded import build_embedded
from vime_shell.models.hf_config import read_config_summary
from vime_shell.run.components import engine_options
from vime_shell.run.launch_checks import check_engine_sampling
from vime_shell.run.model_checks import check_model_settings
from vime_shell.settings.train_config import ConfigError, TrainConfig

SRC = Path(__file__).resolve().parents[1] / "src"


class EchoEngine:
    """Answers every prompt with its last token repeated (log-prob 0): no model at all."""

    name = "echo"

    def __init__(self, model_path: str | Path, *, seed: int = 0):
        self.model_path, self.seed, self.weight_version = Path(model_path), seed, 0

    @classmethod
    def from_options(cls, hf_dir, options, layout, *, seed: int) -> "EchoEngine":
        return cls(hf_dir, seed=seed)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Generation]:
        n = params.max_new_tokens
        return [Generation(token_ids=(p[-1],) * n, log_probs=(0.0,) * n, finish_reason="length")
                for p in prompts]

    def update_weights_from_tensors(self, named_tensors) -> None:
        for _ in named_tensors:
            pass

    def update_weights_from_path(self, path) -> None:
        self.weight_version += 1

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass

    def close(self) -> None:
        pass


ECHO = EngineTraits(name="echo", label="the echo engine", target=f"{__name__}:EchoEngine")


@pytest.fixture
def echo(monkeypatch):
    """The trial engine's one registry record, for this test only."""
    monkeypatch.setitem(ENGINES, "echo", ECHO)
    return ECHO


def _train(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        status = main(["train", *argv])
    except SystemExit as exc:  # argparse's own errors exit from the parser
        status = exc.code
    out = capsys.readouterr()
    return status, out.out, out.err


def test_a_registered_engine_is_a_choice_the_dry_run_resolves_checks_and_reports(
        tmp_path, capsys, monkeypatch):
    argv = ["--dry-run", "--rollout-engine", "echo", "--run-dir", str(tmp_path / "r")]
    status, _, err = _train(argv, capsys)
    assert status == 2 and "invalid choice: 'echo'" in err  # not registered yet
    monkeypatch.setitem(ENGINES, "echo", ECHO)
    assert "echo" in ENGINE_NAMES and repr(ENGINE_NAMES) == "('hf', 'vllm', 'echo')"
    status, out, err = _train(argv, capsys)
    assert status == 0, err
    assert "every launch check passed" in out
    assert "--rollout-engine echo" in out
    assert "engine layout: 1 echo engine(s) x 1 rank(s) on ranks 0..0 of 1" in out


def test_a_registered_engine_is_built_from_the_run_settings_and_generates(echo):
    cfg = TrainConfig(rollout_engine="echo")
    options = engine_options(cfg, cuda=True)
    assert (options.engine, options.colocate) == ("echo", False)  # no sleep mode: its traits
    layout = resolve_engine_layout(world_size=1, engine="echo")
    engine = build_local_engine(build_embedded(), layout, options, rank=0)
    assert isinstance(engine, EchoEngine) and isinstance(engine, RolloutEngine)
    group = EngineGroup(layout, 0, engine, options)
    assert group.chunks_per_engine == 4  # not tail-bound: on CPU a call grows with its tokens
    out = group.run_shares(lambda chunk: engine.generate(
        [[5, 6, i] for i in chunk], SamplingParams(max_new_tokens=2)), 3)
    assert [g.token_ids for g in out] == [(0, 0), (1, 1), (2, 2)]


def test_the_default_engine_is_resolved_once_for_the_launch_checks_and_the_loop(
        echo, monkeypatch, tmp_path, capsys):
    """A preferred engine that is installed is the default where CUDA is: the dry run's
    layout and the loop's engine options name the same engine."""
    monkeypatch.setitem(ENGINES, "echo", attrs.evolve(ECHO, preferred_with_cuda=True,
                                                      colocate_on_cuda=True))
    monkeypatch.setattr("vime_shell.engines._cuda_available", lambda: True)
    assert resolve_engine_name(None) == "echo"  # vllm, preferred too, is not installed here
    assert engine_options(TrainConfig(), cuda=True).engine == "echo"
    assert engine_options(TrainConfig(), cuda=True).colocate
    status, out, err = _train(["--dry-run", "--run-dir", str(tmp_path / "r")], capsys)
    assert status == 0, err
    assert "engine layout: 1 echo engine(s)" in out


FRONTED = dict(front="pkg:Front")  # a per-request front (never loaded by a launch check)


@pytest.mark.parametrize("traits, runs_with, kwargs, message", [
    (dict(joins_world="it joins the job's process group"), {},
     dict(world_size=2, rollout_num_gpus=1),
     r"^rollout_num_gpus=1: is below the world size 2; it joins the job's process group\. "
     r"Fix: omit --rollout-num-gpus"),
    (dict(tensor_parallel=True), {},
     dict(world_size=2, rollout_num_gpus_per_engine=2, num_attention_heads=3),
     r"^rollout_num_gpus_per_engine=2: does not divide the model's 3 attention heads \(the "
     r"echo engine shards heads"),
    ({}, FRONTED, dict(world_size=1, per_request=True),
     r"^--rollout-engine='echo': has no per-request \(asynchronous\) API, .*Fix: use "
     r"--rollout-engine hf or vllm, or a batched --rollout-function-path\.$"),
    (dict(FRONTED, per_request_max_gpus=1, per_request_limit="one rank only"), FRONTED,
     dict(world_size=2, rollout_num_gpus_per_engine=2, per_request=True),
     r"^--rollout-num-gpus-per-engine=2: exceeds the 1 rank\(s\) per engine that the echo "
     r"engine runs per-sample generation .* on \(one rank only\)\. Fix: pass "
     r"--rollout-num-gpus-per-engine 1, use --rollout-engine hf, or a batched"),
])
def test_an_engines_layout_rules_come_from_its_traits(monkeypatch, traits, runs_with, kwargs,
                                                      message):
    """Each rule applies where the traits say so, with a message naming the flag; the same
    layout runs on an engine without the trait (``runs_with``)."""
    monkeypatch.setitem(ENGINES, "echo", attrs.evolve(ECHO, **traits))
    with pytest.raises(EngineLayoutError, match=message):
        resolve_engine_layout(engine="echo", **kwargs)
    monkeypatch.setitem(ENGINES, "echo", attrs.evolve(ECHO, **runs_with))
    assert resolve_engine_layout(engine="echo", **kwargs).engine == "echo"


def test_an_engines_flag_support_comes_from_its_traits(echo, monkeypatch):
    summary = read_config_summary(build_embedded())
    layout = resolve_layout(world_size=1, num_layers=summary.num_layers,
                            supports_context_parallel=False)
    with pytest.raises(ConfigError, match=r"^rollout_enable_expert_parallel=True: is expert "
                       r"parallelism inside each engine; the echo engine holds every expert\. "
                       r"Fix: use --rollout-engine vllm, or drop the flag"):
        check_model_settings(TrainConfig(rollout_engine="echo",
                                         rollout_enable_expert_parallel=True), summary, layout)
    check_engine_sampling(TrainConfig(rollout_engine="echo", rollout_temperature=3.0))
    monkeypatch.setitem(ENGINES, "echo", attrs.evolve(ECHO, max_temperature=1.5))
    with pytest.raises(ConfigError, match=r"^rollout_temperature=3.0: is above the echo "
                       r"engine's limit of 1.5\. Fix: use at most 1.5, or --rollout-engine hf"):
        check_engine_sampling(TrainConfig(rollout_engine="echo", rollout_temperature=3.0))
    assert engine_traits("echo").max_temperature == 1.5


def _name_comparisons(path: Path) -> list[str]:
    """``file:line`` of every comparison with an engine's name, and every engine name chosen
    by a conditional expression (``"vllm" if ... else "hf"``), in ``path``."""
    names = set(ENGINES)
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.IfExp):
            operands = [node.body, node.orelse]
        else:
            continue
        if any(isinstance(o, ast.Constant) and o.value in names for o in operands):
            hits.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return hits


def test_no_engine_name_is_compared_outside_the_engines_package():
    engines = SRC / "vime_shell" / "engines"
    hits = [hit for path in sorted(SRC.rglob("*.py")) if engines not in path.parents
            for hit in _name_comparisons(path)]
    assert hits == [], f"ask the engine's traits (vime_shell.engines.engine_traits): {hits}"
