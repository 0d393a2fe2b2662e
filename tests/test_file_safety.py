"""vime writes only what it names and reads only regular files (issue 19, the file-system half).

Named examples, each reproducing a finding first: ``--save-hf`` on a model, checkpoint or run
directory (or ``/``, home, cwd) refused at launch with every file intact; ``--json`` on a FIFO
or a symlink (the link still points where it did); ``--input`` on a FIFO (refused, no hang); a
zip-bomb ``.npz`` refused before inflating; metrics files with the umask's mode; a failed plot
that no longer costs the export; flipped bytes in a checkpoint shard failing ``--load`` naming
the file; a dataset changed under a checkpoint.
"""

import json
import logging
import os
import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest

from vime_pure import DumpFormatError, RolloutBatch, Sample
from vime_shell.cli.main import main
from vime_shell.run import run_log
from vime_shell.run.checkpoint_index import LOOP_STATE, TRACKER, CheckpointError
from vime_shell.run.launch_checks import check_run_paths, launch_checks
from vime_shell.run.run_log import RunLogger
from vime_shell.settings.train_config import TrainConfig
from vime_shell.storage.dump import load_rollout_batch, save_rollout_batch
from vime_shell.storage.files import FileKindError, write_atomic
from vime_shell.storage.manifest import fingerprint, write_manifest
from vime_shell.storage.sizes import ExportError


def _snapshot(*roots: Path) -> dict:
    return {str(p): (p.read_bytes() if p.is_file() else os.readlink(p) if p.is_symlink()
                     else "dir")
            for root in roots for p in sorted(root.rglob("*"))}


@pytest.fixture
def scratch(tmp_path):
    """Scratch copies of what a careless --save-hf would destroy: a model directory with a
    sibling model, a checkpoint directory and a run directory."""
    models = tmp_path / "models"
    for name in ("base", "sibling"):
        (models / name).mkdir(parents=True)
        (models / name / "config.json").write_text('{"model_type": "qwen2"}')
        (models / name / "model.safetensors").write_bytes(b"weights of " + name.encode())
        (models / name / "extra").mkdir()
        (models / name / "extra" / "adapter.bin").write_bytes(b"adapter")
    ck = tmp_path / "ck"
    (ck / "rollout_000002").mkdir(parents=True)
    (ck / "rollout_000002" / "__0_0.distcp").write_bytes(b"shard")
    (ck / TRACKER).write_text("2\n")
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "rollouts" / "rollout_0.npz").write_bytes(b"dump")
    (run / "tb").mkdir()
    (run / "previous-1").mkdir()
    (run / "metrics.jsonl").write_text("")
    return tmp_path, models / "base", ck, run


def test_save_hf_on_a_model_checkpoint_or_run_directory_is_refused_at_launch(
        scratch, monkeypatch, tmp_path_factory):
    """Found: --save-hf on these deleted checkpoints, dumps, tb/ and the source model."""
    root, model, ck, run = scratch
    before = _snapshot(root)
    cwd = tmp_path_factory.mktemp("cwd") / "inner"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    targets = {model: "is the source model", model.parent: "contains the source model",
               model / "hf": "is inside the source model", ck: "is the checkpoint directory",
               ck / "rollout_000002": "is inside the checkpoint", run: "is the run directory",
               run / "rollouts": "is inside the run directory", root: "contains the source",
               Path("/"): "is the root directory", Path.home(): "is your home directory",
               cwd: "is the working directory", Path(".."): "contains the working"}
    for target, problem in targets.items():
        cfg = TrainConfig(hf_checkpoint=str(model), run_dir=str(run), save=str(ck),
                          save_hf=str(target))
        with pytest.raises(ExportError, match=f"--save-hf=.*{problem}"):
            launch_checks(cfg, model)
    assert _snapshot(root) == before


def test_save_hf_refusal_is_one_line_exit_2(scratch, capsys):
    root, model, ck, run = scratch
    before = _snapshot(root)
    assert main(["train", "--hf-checkpoint", str(model), "--run-dir", str(root / "new"),
                 "--save-hf", str(model.parent)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "contains the source model" in err
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("mine")
    before = _snapshot(root)
    assert main(["train", "--hf-checkpoint", str(model), "--run-dir", str(root / "new"),
                 "--save-hf", str(foreign)]) == 2
    assert "--save-hf-overwrite" in capsys.readouterr().err
    assert _snapshot(root) == before and not (root / "new").exists()


def test_json_output_refuses_a_fifo_and_writes_through_a_symlink(tmp_path, capsys):
    """Found: the atomic writer replaced the target itself (as root: /dev/full)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    synthetic = ["schedule", "--synthetic", "--num-groups", "8", "--global-batch-size", "8",
                 "--dp", "2", "--max-tokens-per-gpu", "4096"]
    assert main(synthetic + ["--json", str(fifo)]) == 2
    assert "is a FIFO" in capsys.readouterr().err and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert main(synthetic + ["--json", str(link)]) == 0
    assert os.readlink(link) == str(real) and json.loads(real.read_text())[0]["step"] == 0
    with pytest.raises(FileKindError, match="character device"):
        write_atomic("/dev/null", "x")  # refused before anything is written
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_input_on_a_fifo_is_refused_without_reading(tmp_path, capsys):
    """Found: `vime schedule --input FIFO` waited forever for a writer."""
    fifo = tmp_path / "in.npz"
    os.mkfifo(fifo)
    assert main(["schedule", "--input", str(fifo), "--global-batch-size", "1"]) == 2
    assert "--input=" in capsys.readouterr().err
    with pytest.raises(DumpFormatError, match="FIFO"):
        load_rollout_batch(fifo)
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")  # the run log would block on it: refused at launch
    with pytest.raises(FileKindError, match="--run-dir=.*metrics.jsonl.*FIFO"):
        check_run_paths(TrainConfig(run_dir=str(run)))


def test_a_zip_bomb_dump_is_refused_before_inflating(tmp_path):
    """Found: a 1.46 MB .npz took `vime schedule` to 3.0 GB before it was rejected."""
    good = tmp_path / "good.npz"
    batch = RolloutBatch.from_samples([[Sample(tokens=[1, 2], response_length=1, reward=0.0)]])
    save_rollout_batch(good, batch)
    deflated = tmp_path / "deflated.npz"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(deflated, "w") as out:
        for info in src.infolist():
            data = src.read(info) + (b"\0" * (64 << 20) if info.filename == "tokens.npy" else b"")
            out.writestr(info.filename, data, zipfile.ZIP_DEFLATED)
    assert deflated.stat().st_size < 1 << 20
    with pytest.raises(DumpFormatError, match="is compressed"):
        load_rollout_batch(deflated)
    padded = tmp_path / "padded.npz"  # stored, but larger than its header allows
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(padded, "w") as out:
        for info in src.infolist():
            data = src.read(info) + (b"\0" * (1 << 17) if info.filename == "tokens.npy" else b"")
            out.writestr(info.filename, data)
    with pytest.raises(DumpFormatError, match=r"tokens\.npy declares \d+ bytes, more than"):
        load_rollout_batch(padded)


def test_metrics_follow_the_umask_and_a_failed_plot_is_a_warning(tmp_path, monkeypatch,
                                                                  caplog):
    """Found: metrics files were 0600; a failed plot skipped the HF export after it."""
    old = os.umask(0o022)
    try:
        logger = RunLogger(tmp_path, start=0, total=1, enabled=True, progress=False)
        logger.log({"rollout": 0, "reward_mean": 0.5, "loss": 0.0, "num_groups": 1,
                    "num_microbatches": 1, "logprob_gap": 0.0})

        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(run_log, "plot_curves", broken)
        with caplog.at_level(logging.WARNING):
            assert logger.finish() == []
    finally:
        os.umask(old)
    assert "could not draw a plot" in caplog.text
    assert stat.S_IMODE((tmp_path / "metrics.jsonl").stat().st_mode) == 0o644


def _checkpoint(root: Path, prompt_data: Path | None = None) -> Path:
    ck = root / "rollout_000002"
    ck.mkdir(parents=True)
    dataset = None if prompt_data is None else fingerprint(prompt_data)
    (ck / LOOP_STATE).write_text(json.dumps({"rollouts_done": 2, "config": {}, "run_id": "r1",
                                             "manifest": True, "dataset": dataset}))
    (ck / "__0_0.distcp").write_bytes(np.arange(4096, dtype=np.float32).tobytes())
    write_manifest(ck)
    (root / TRACKER).write_text("2\n")
    return ck


def test_flipped_bytes_in_a_shard_fail_load_naming_the_file(tmp_path, capsys):
    """Found: after 984 weight floats were flipped in a shard, --load resumed with exit 0."""
    ck = _checkpoint(tmp_path / "ck")
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), load=str(tmp_path / "ck"))
    check_run_paths(cfg)
    raw = bytearray((ck / "__0_0.distcp").read_bytes())
    raw[1000:1004] = bytes(4)
    (ck / "__0_0.distcp").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: its BLAKE2b checksum differs"):
        check_run_paths(cfg)
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--load", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "__0_0.distcp" in err


def test_resume_on_a_changed_dataset_is_refused(tmp_path):
    """Found: a dataset edited in place resumed silently."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n' * 10)
    _checkpoint(tmp_path / "ck", data)
    cfg = dict(run_dir=str(tmp_path / "run"), load=str(tmp_path / "ck"), prompt_data=str(data),
               rollout_max_response_len=4)
    check_run_paths(TrainConfig(**cfg))
    os.utime(data)  # touched, same bytes: a small file is hashed whole, so not a change
    check_run_paths(TrainConfig(**cfg))
    data.write_text('{"prompt": "1+2", "label": "3"}\n' * 10)
    with pytest.raises(CheckpointError, match=r"--prompt-data=.*changed since.*"
                                              r"--allow-dataset-change"):
        check_run_paths(TrainConfig(**cfg))
    check_run_paths(TrainConfig(**cfg, allow_dataset_change=True))
