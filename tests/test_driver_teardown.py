"""A run whose rollout source (or step) fails to build still takes its trainer down (and the
source, once built), so a caller that catches the error can start another run in the same
process: Megatron's parallel state is freed, as ``run_training``'s ``finally`` frees it."""

import pytest

from vime_shell.run import driver
from vime_shell.settings.train_config import TrainConfig


class _Trainer:
    def __init__(self, calls: list):
        self.calls = calls

    def shutdown(self) -> None:
        self.calls.append("trainer.shutdown")


class _Source:
    def __init__(self, calls: list):
        self.calls = calls

    def close(self) -> None:
        self.calls.append("source.close")


class _Plan:
    engine_layout = None  # a train-only replay: no engine options to resolve
    hf_dir = "unused"


@pytest.fixture
def calls(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(driver._Loop, "_build_trainer", lambda self: _Trainer(calls))
    monkeypatch.setattr(driver.dist, "get_rank", lambda: 0)
    return calls


def test_a_source_that_fails_to_open_shuts_the_trainer_down(calls, monkeypatch):
    def failing(*args):
        raise RuntimeError("engines did not start")

    monkeypatch.setattr(driver, "open_source", failing)
    with pytest.raises(RuntimeError, match="engines did not start"):
        driver._Loop(TrainConfig(), None, _Plan())
    assert calls == ["trainer.shutdown"]


def test_a_step_that_fails_to_build_shuts_the_trainer_down_then_closes_the_source(
        calls, monkeypatch):
    def failing_step(**kwargs):
        raise ValueError("bad step")

    monkeypatch.setattr(driver, "open_source", lambda *args: _Source(calls))
    monkeypatch.setattr(driver, "Step", failing_step)
    with pytest.raises(ValueError, match="bad step"):
        driver._Loop(TrainConfig(), None, _Plan())
    assert calls == ["trainer.shutdown", "source.close"]
