"""Run directories, ``--load``, replay dumps and config files are checked before anything is
built (``launch_checks.check_run_paths``), and a run never silently loses or mixes metrics.

Named examples for each rule of ``vime_shell.run.run_dir`` and the launch checks: a new run
refuses a run directory with metrics unless ``--overwrite-run-dir`` (then the old files are
moved to ``previous-<timestamp>/``); ``vime demo`` moves its old run aside by itself; a torn
last ``metrics.jsonl`` line is dropped with a warning on resume; ``--load`` of a path without
a checkpoint is an error; missing replay dumps fail at launch.
"""

import json
import logging

import numpy as np
import pytest

from vime_pure import DumpFormatError, RolloutBatch, Sample
from vime_shell.cli.main import main
from vime_shell.run import driver as train_loop
from vime_shell.run import run_checkpoint
from vime_shell.run.checkpoint_index import CheckpointError, TRACKER, require_checkpoint
from vime_shell.run.launch_checks import check_run_paths
from vime_shell.run.run_dir import RunDirError, move_aside
from vime_shell.run.run_log import REQUIRED_KEYS, RunLogger, read_metrics
from vime_shell.settings.flags import parse_train_config
from vime_shell.settings.train_config import ConfigError, TrainConfig
from vime_shell.sources.replay import ReplayError
from vime_shell.storage.dump import save_rollout_batch


def _metrics(run_dir, n: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({**dict.fromkeys(REQUIRED_KEYS, 0.0), "rollout": k}) + "\n"
        for k in range(n)))


def test_new_run_refuses_a_run_dir_with_metrics(tmp_path):
    run = tmp_path / "r1"
    _metrics(run, 3)
    with pytest.raises(RunDirError, match="with 3 records.*--overwrite-run-dir"):
        check_run_paths(TrainConfig(run_dir=str(run)))
    with pytest.raises(RunDirError, match="holds metrics.jsonl with 3 records"):
        RunLogger(run, start=0, total=1, enabled=True, progress=False)  # never emptied
    assert len(read_metrics(run)) == 3
    check_run_paths(TrainConfig(run_dir=str(tmp_path / "fresh")))  # a new directory is fine
    with pytest.raises(RunDirError, match="is a file"):
        (tmp_path / "f").write_text("")
        check_run_paths(TrainConfig(run_dir=str(tmp_path / "f")))


def test_overwrite_moves_the_earlier_run_aside(tmp_path):
    run = tmp_path / "r1"
    _metrics(run, 3)
    (run / "curves.png").write_bytes(b"png")
    (run / "rollouts").mkdir()
    (run / "rollouts" / "rollout_0.npz").write_bytes(b"x")
    (run / "notes.txt").write_text("mine")  # not a run output: stays
    cfg = TrainConfig(run_dir=str(run), overwrite_run_dir=True,
                      save_rollout_data=f"{run}/rollouts/rollout_{{rollout_id}}.npz")
    check_run_paths(cfg)
    moved = move_aside(cfg)
    assert moved.parent == run and moved.name.startswith("previous-")
    assert sorted(p.name for p in moved.iterdir()) == ["curves.png", "metrics.jsonl", "rollouts"]
    assert len(read_metrics(moved)) == 3 and (run / "notes.txt").exists()
    assert not (run / "metrics.jsonl").exists() and move_aside(cfg) is None
    with pytest.raises(RunDirError, match="contradicts --load"):
        check_run_paths(TrainConfig(run_dir=str(run), overwrite_run_dir=True, load=str(run)))


def test_overwrite_refuses_to_move_the_dumps_it_replays(tmp_path):
    run = tmp_path / "r1"
    _metrics(run, 1)
    dumps = f"{run}/rollouts/rollout_{{rollout_id}}.npz"
    with pytest.raises(RunDirError, match="would move aside"):
        check_run_paths(TrainConfig(run_dir=str(run), overwrite_run_dir=True,
                                    save_rollout_data=dumps, load_rollout_data=dumps))


def test_demo_moves_its_earlier_run_aside(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(train_loop, "run_training", lambda cfg, plan=None: seen.append(cfg) or
                        train_loop.TrainResult(records=[], plots=[], hf_checkpoint=None,
                                               start_rollout=0))
    _metrics(tmp_path / "demo", 2)
    assert main(["demo", "--run-dir", str(tmp_path / "demo")]) == 0  # no refusal
    assert seen[-1].overwrite_run_dir  # run_training moves the old run aside and says where
    assert main(["train", "--run-dir", str(tmp_path / "demo")]) == 2  # vime train refuses


def test_resume_drops_a_torn_last_line_with_a_warning(tmp_path, caplog):
    _metrics(tmp_path, 3)
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"rollout": 3, "reward_me')  # killed while writing rollout 3
    with caplog.at_level(logging.WARNING):
        assert [r["rollout"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert "torn last line" in caplog.text
    logger = RunLogger(tmp_path, start=2, total=4, enabled=True, progress=False)
    logger.finish()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2  # rollouts 0 and 1
    (tmp_path / "metrics.jsonl").write_text('{"rollout": 0}\nnot json\n{"rollout": 2}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl:2"):
        read_metrics(tmp_path)  # a bad line before the last is corruption, not a torn write


def test_output_paths_are_checked_at_launch(tmp_path):
    (tmp_path / "file").write_text("")
    for field in ("run_dir", "save", "save_hf"):
        with pytest.raises(ConfigError, match=f"{field}=.*runs through the file"):
            check_run_paths(TrainConfig(**{"run_dir": str(tmp_path / "r"),
                                           field: str(tmp_path / "file" / "sub")}))
    with pytest.raises(ConfigError, match="save_rollout_data=.*runs through the file"):
        check_run_paths(TrainConfig(run_dir=str(tmp_path / "r"),
                                    save_rollout_data=f"{tmp_path}/file/r{{rollout_id}}.npz"))


def test_load_must_name_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist.*--save only"):
        check_run_paths(TrainConfig(run_dir=str(tmp_path / "r"), load=str(tmp_path / "typo")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        require_checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / TRACKER).write_text("x\n")
    with pytest.raises(CheckpointError, match="is not a rollout count"):
        require_checkpoint(tmp_path / "empty")


def test_replay_dumps_are_checked_at_launch(tmp_path):
    batch = RolloutBatch.from_samples([[Sample(tokens=[1, 2], response_length=1, reward=0.0)]])
    save_rollout_batch(tmp_path / "r0.npz", batch)
    template = f"{tmp_path}/r{{rollout_id}}.npz"
    cfg = dict(run_dir=str(tmp_path / "run"), num_rollout=3, load_rollout_data=template)
    with pytest.raises(ReplayError, match=r"no file for rollout 1"):
        check_run_paths(TrainConfig(**cfg))
    check_run_paths(TrainConfig(**cfg, load_rollout_data_fallback=True))
    (tmp_path / "r0.npz").write_bytes(b"torn")
    with pytest.raises(DumpFormatError, match="cannot read the rollout dump"):
        check_run_paths(TrainConfig(**cfg, load_rollout_data_fallback=True))


@pytest.mark.parametrize("text, expected", [("lr: 3e-4\n", 3e-4), ("lr: 1E-3\n", 1e-3),
                                            ("lr: 0.0002\n", 2e-4)])
def test_yaml_floats_as_users_write_them(tmp_path, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert parse_train_config(["--config", str(path)]).lr == expected


@pytest.mark.parametrize("text, match", [
    ("1: 2\n", "key=1: is not a setting name"),
    ("null: 2\n", "key=None: is not a setting name"),
    ("lr: fast\n", "lr='fast': must be a float"),
    ("\udcff", "cannot be read"),
])
def test_config_file_errors(tmp_path, text, match):
    path = tmp_path / "run.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError, match=match):
        parse_train_config(["--config", str(path)])


@pytest.mark.parametrize("argv, message", [
    (["train", "--lrr", "1"], "vime train: error: unrecognized arguments: --lrr 1 (did you mean "
                              "--lr?)"),
    (["train", "--global-batch", "8"], "(did you mean --global-batch-size?)"),
    (["schedule", "--global-batch", "8"], "(did you mean --global-batch-size?)"),
    (["schedule", "--synth"], "vime schedule: error: unrecognized arguments: --synth"),
    (["demo", "--num-rollouts", "3"], "(did you mean --num-rollout?)"),
    (["schedule", "--dp", "x"], "vime schedule: error: argument --dp: invalid int value: 'x'"),
])
def test_flags_one_line_no_abbreviations(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err


def test_a_checkpoint_names_a_replaced_numpy_generator_whose_state_it_cannot_save():
    original = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(0))  # e.g. a plugin replaced it
    try:
        with pytest.raises(CheckpointError, match=r"^numpy.random='PCG64': is not MT19937, "
                           r"whose state a checkpoint saves\. Fix: "):
            run_checkpoint._loop_state(3, {})
    finally:
        np.random.set_bit_generator(original)
    assert run_checkpoint._loop_state(3, {})["numpy_random"][0] == "MT19937"
