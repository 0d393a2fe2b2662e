"""Rollout dumps and replay (``--save-rollout-data`` / ``--load-rollout-data``).

One process runs the original 2-rollout training with dumps, then replays them train-only
(no engine at all), in forge mode (engine kept, weights still synced), and with the fallback
for a missing rollout. Asserts: a replay trains on exactly the dumped samples, with the same
group ids and the same schedule as the original run; the fallback replays rollout 0; a missing
file without fallback is a ``ReplayError`` naming the flag and the fix.
"""

import numpy as np
import pytest

from tests.shell.loop_workers import replay_worker
from vime_shell.megatron.spawn import spawn
from vime_shell.models.embedded import build_embedded
from vime_shell.sources.replay import ReplayError, ReplaySource, dump_path
from vime_shell.storage.dump import load_rollout_batch, read_dump_header, tokenizer_record


@pytest.fixture(scope="module")
def replay_runs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("embedded")  # the worker builds the embedded model
    root = tmp_path_factory.mktemp("replay")
    return root, spawn(replay_worker, 1, str(root), str(cache))[0], cache


def _same_rollout(a: dict, b: dict) -> None:
    for key in ("tokens", "advantages", "rollout_log_probs"):
        assert np.array_equal(a[key], b[key]), key
    assert a["group_ids"] == b["group_ids"]
    assert a["steps"] == b["steps"] and a["partition"] == b["partition"]
    assert [ix for _, ix, _ in a["trace"]] == [ix for _, ix, _ in b["trace"]]


@pytest.mark.slow
def test_replay_trains_exactly_the_dumped_batches(replay_runs):
    root, runs, _ = replay_runs
    original = runs["original"]
    assert all(r["has_engine"] for r in original)
    for rid, seen in enumerate(original):
        dumped = load_rollout_batch(root / "dumps" / f"r{rid}.npz")
        assert np.array_equal(dumped.tokens, seen["tokens"])
        assert dumped.original_group_ids() == seen["group_ids"]
    for mode in ("train_only", "forge"):
        assert [r["rollout"] for r in runs[mode]] == [0, 1]
        for orig, replayed in zip(original, runs[mode]):
            _same_rollout(orig, replayed)
    # The first step of a replay starts from the same weights, so the same loss.
    assert runs["train_only"][0]["metrics"]["loss"] == pytest.approx(
        original[0]["metrics"]["loss"], abs=1e-7)
    assert not any(r["has_engine"] for r in runs["train_only"])  # no engine at all
    assert all(r["has_engine"] for r in runs["forge"])  # engine kept up, weights synced


@pytest.mark.slow
def test_a_runs_dumps_record_its_models_tokenizer(replay_runs):
    root, _, cache = replay_runs
    record = read_dump_header(root / "dumps" / "r0.npz")["tokenizer"]
    assert record == tokenizer_record(build_embedded(cache)) and record["sha256"]


@pytest.mark.slow
def test_fallback_replays_rollout_0_for_a_missing_dump(replay_runs):
    _, runs, _ = replay_runs
    first, second, third = runs["fallback"]
    _same_rollout(first, runs["original"][0])
    _same_rollout(second, runs["original"][1])
    assert not (np.array_equal(third["tokens"], second["tokens"]))
    assert np.array_equal(third["tokens"], runs["original"][0]["tokens"])
    assert third["group_ids"] == runs["original"][0]["group_ids"]


def test_missing_dump_is_an_error_naming_the_fix(tmp_path):
    (tmp_path / "r0.npz").write_bytes(b"")
    source = ReplaySource(template=str(tmp_path / "r{rollout_id}.npz"))
    assert source.path(0) == tmp_path / "r0.npz"
    with pytest.raises(ReplayError, match="--load-rollout-data-fallback"):
        source.path(1)
    fallback = ReplaySource(template=str(tmp_path / "r{rollout_id}.npz"), fallback=True)
    assert fallback.path(5) == tmp_path / "r0.npz"
    (tmp_path / "r0.npz").unlink()
    with pytest.raises(ReplayError, match="neither"):
        fallback.path(5)
    with pytest.raises(ReplayError, match="rollout 0"):
        fallback.path(0)


def test_literal_path_replays_the_same_file_every_rollout(tmp_path):
    (tmp_path / "one.npz").write_bytes(b"")
    source = ReplaySource(template=str(tmp_path / "one.npz"))
    assert {source.path(k) for k in range(4)} == {tmp_path / "one.npz"}
    assert dump_path("d/r{rollout_id}.npz", 12) == dump_path("d/r12.npz", 0)


def test_save_template_must_name_the_rollout():
    from vime_shell.settings.train_config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="rollout_id"):
        TrainConfig(save_rollout_data="dumps/batch.npz")
    with pytest.raises(ConfigError, match="load_rollout_data_mode"):
        TrainConfig(load_rollout_data="d.npz", load_rollout_data_mode="replay")
