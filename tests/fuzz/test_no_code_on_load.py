"""Nothing executes on load: a malicious pickle planted where each loader looks runs nothing.

The payload's ``__reduce__`` asks the unpickler to call ``os.system("touch <sentinel>")``. The
control test proves it is live (a plain ``pickle.loads`` creates the sentinel); every vime
loader must refuse it with a typed error and leave no sentinel: the run checkpoint's loop state
(JSON), the trainer state (JSON; its tensor shards are covered by
``tests/shell/test_checkpoint_safety.py``), rollout dumps (``allow_pickle=False``), config files
(``yaml.safe_load``), and ``vime schedule --input``.
"""

import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

from vime_pure.errors import VimeError
from vime_shell.cli.main import main
from vime_shell.run import run_checkpoint
from vime_shell.run.checkpoint_index import LOOP_STATE, TRACKER, require_checkpoint
from vime_shell.settings.flags import load_config_file
from vime_shell.settings.train_config import ConfigError
from vime_shell.storage.dump import HEADER, load_rollout_batch


class Payload:
    """Unpickling this runs ``touch <sentinel>``."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


@pytest.fixture
def evil(tmp_path) -> tuple[bytes, Path]:
    sentinel = tmp_path / "PWNED"
    return pickle.dumps(Payload(sentinel)), sentinel


def test_control_the_payload_is_live(evil):
    payload, sentinel = evil
    pickle.loads(payload)  # what torch.load(weights_only=False) would have done
    assert sentinel.exists()


def test_run_checkpoint_loop_state(evil, tmp_path):
    payload, sentinel = evil
    ck = tmp_path / "ck"
    (ck / "rollout_000002").mkdir(parents=True)
    (ck / TRACKER).write_text("2\n")
    (ck / "rollout_000002" / "loop_state.pt").write_bytes(payload)  # the old pickled name
    with pytest.raises(VimeError, match="has no loop_state.json"):
        require_checkpoint(ck)
    (ck / "rollout_000002" / LOOP_STATE).write_bytes(payload)
    with pytest.raises(run_checkpoint.CheckpointError, match=r"loop_state\.json.*is unreadable"):
        require_checkpoint(ck)  # at launch
    with pytest.raises(run_checkpoint.CheckpointError, match="unreadable loop_state.json"):
        run_checkpoint.load(ck / "rollout_000002", trainer=None, config={})
    assert not sentinel.exists()


def test_trainer_state_file(evil, tmp_path):
    # Megatron takes seconds to import: only this test of the directory needs it.
    from vime_shell.megatron.checkpoint import TRAINER_STATE, CheckpointError, read_state

    payload, sentinel = evil
    (tmp_path / TRAINER_STATE).write_bytes(payload)  # JSON is parsed, never unpickled
    (tmp_path / "rank00000.pt").write_bytes(payload)  # the old per-rank format: never opened
    with pytest.raises(CheckpointError, match=f"has no readable {TRAINER_STATE}"):
        read_state(tmp_path)
    assert not sentinel.exists()


def _dump_with_pickled_column(path: Path, payload_obj: object) -> None:
    """A zip shaped like a dump whose ``tokens.npy`` is an object array (a pickle inside)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.array([payload_obj], dtype=object), allow_pickle=True)
    header = {"format": "vime.rollout_batch", "version": 1, "num_samples": 1,
              "columns": {"tokens": {"dtype": "|O", "shape": [1]}}}
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(HEADER, json.dumps(header))
        zf.writestr("tokens.npy", buf.getvalue())


def test_rollout_dump_and_vime_schedule(evil, tmp_path, capsys):
    payload, sentinel = evil
    inside = tmp_path / "inside.npz"
    _dump_with_pickled_column(inside, Payload(sentinel))
    whole = tmp_path / "whole.npz"
    whole.write_bytes(payload)
    for path in (inside, whole, tmp_path / "whole-no-suffix"):
        if not path.exists():
            path.write_bytes(payload)
        if path.suffix == ".npz":
            with pytest.raises(VimeError):
                load_rollout_batch(path)
        assert main(["schedule", "--input", str(path), "--global-batch-size", "1", "--dp", "1",
                     "--max-tokens-per-gpu", "10"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not sentinel.exists()


def test_config_files(evil, tmp_path):
    payload, sentinel = evil
    tagged = tmp_path / "run.yaml"
    tagged.write_text(f'lr: !!python/object/apply:os.system ["touch {sentinel}"]\n')
    pickled = tmp_path / "run.yml"
    pickled.write_bytes(payload)
    for path in (tagged, pickled):
        with pytest.raises(ConfigError):
            load_config_file(path)
    assert not sentinel.exists()
