"""Fuzz: damaged checkpoints, damaged HF model directories and a full disk.

``vime train --load`` on 14 kinds of damaged checkpoint and ``vime train --hf-checkpoint`` on
12 kinds of damaged model directory exit 2 at launch with one line naming the file (before any
model is built), and so does every malformed value of every ``config.json`` key launch reads; random bit flips anywhere in a checkpoint file are caught by its manifest. A
full disk (``RLIMIT_FSIZE``, in a subprocess) during an HF export and a checkpoint save is one
typed error naming the flag, and the files already there survive.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from tests.fuzz.harness import REJECTIONS, check_cli_line, outcome, tried
from vime_shell.cli.main import main
from vime_shell.models.embedded import build_embedded
from vime_shell.models.hf_config import (BOOLS, NON_NEGATIVE_INTS, OBJECTS, POSITIVE_INTS,
                                         POSITIVE_NUMBERS, REQUIRED, TOKEN_IDS)
from vime_shell.run.checkpoint_index import LOOP_STATE, TRACKER, require_checkpoint
from vime_shell.run.launch_checks import launch_checks
from vime_shell.settings.train_config import TrainConfig
from vime_shell.storage.manifest import MANIFEST, write_manifest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _cli(entry: str, argv: list[str]) -> str:
    """``vime train ...`` in-process; asserts exit 2 with one line; returns that line."""
    tried(entry)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    lines = err.getvalue().strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, err.getvalue())
    assert lines[0].startswith("vime train: error:"), lines
    check_cli_line(lines[0])
    REJECTIONS[entry] += 1
    return lines[0]


def _checkpoint(root: Path) -> Path:
    ck = root / "rollout_000002"
    ck.mkdir(parents=True)
    (ck / LOOP_STATE).write_text(json.dumps({"rollouts_done": 2, "config": {}, "run_id": "r1",
                                             "manifest": True}))
    (ck / "__0_0.distcp").write_bytes(np.arange(2048, dtype=np.float32).tobytes())
    (ck / ".metadata").write_bytes(b"index" * 20)
    (ck / "trainer_state.json").write_text('{"format": "x", "steps_done": 4}')
    write_manifest(ck)
    (root / TRACKER).write_text("2\n")
    return ck


def _flip(path: Path, at: int = 100) -> None:
    raw = bytearray(path.read_bytes())
    raw[at % len(raw)] ^= 0x10
    path.write_bytes(bytes(raw))


CHECKPOINT_DAMAGE = {  # kind: (damage(root, ck), what the line names)
    "tracker_garbage": (lambda r, c: (r / TRACKER).write_text("six\n"), TRACKER),
    "tracker_not_utf8": (lambda r, c: (r / TRACKER).write_bytes(b"\xff\xfe2"), TRACKER),
    "tracker_points_nowhere": (lambda r, c: (r / TRACKER).write_text("7\n"), "rollout_000007"),
    "loop_state_missing": (lambda r, c: (c / LOOP_STATE).unlink(), LOOP_STATE),
    "loop_state_not_json": (lambda r, c: (c / LOOP_STATE).write_text("{"), LOOP_STATE),
    "loop_state_a_list": (lambda r, c: (c / LOOP_STATE).write_text("[]"), LOOP_STATE),
    "manifest_missing": (lambda r, c: (c / MANIFEST).unlink(), "no manifest.json"),
    "manifest_not_json": (lambda r, c: (c / MANIFEST).write_text("{]"), MANIFEST),
    "manifest_escapes": (lambda r, c: (c / MANIFEST).write_text(json.dumps(
        {"format": "vime.manifest", "files": {"../x": {"size": 1, "blake2b": "0"}}})), "../x"),
    "shard_flipped": (lambda r, c: _flip(c / "__0_0.distcp"), "__0_0.distcp"),
    "shard_truncated": (lambda r, c: os.truncate(c / "__0_0.distcp", 100), "__0_0.distcp"),
    "shard_deleted": (lambda r, c: (c / "__0_0.distcp").unlink(), "__0_0.distcp"),
    "index_deleted": (lambda r, c: (c / ".metadata").unlink(), ".metadata"),
    "trainer_state_edited": (lambda r, c: (c / "trainer_state.json").write_text(
        '{"format": "x", "steps_done": 5}'), "trainer_state.json"),
    "checkpoint_is_a_file": (lambda r, c: shutil.rmtree(c) or c.write_text(""), "rollout_000002"),
}


@pytest.mark.parametrize("kind", sorted(CHECKPOINT_DAMAGE))
def test_load_of_a_damaged_checkpoint_is_one_line_at_launch(tmp_path, kind):
    damage, named = CHECKPOINT_DAMAGE[kind]
    ck = _checkpoint(tmp_path / "ck")
    damage(tmp_path / "ck", ck)
    line = _cli("vime train --load (damaged)", ["train", "--run-dir", str(tmp_path / "run"),
                                                "--load", str(tmp_path / "ck")])
    assert named in line, line
    assert not (tmp_path / "run").exists()  # nothing was started


@given(st.data())
@settings(max_examples=40, deadline=None)
def test_any_flipped_bit_in_a_checkpoint_is_found(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("ck")
    ck = _checkpoint(root)
    name = data.draw(st.sampled_from(sorted(p.name for p in ck.iterdir() if p.name != MANIFEST)))
    size = (ck / name).stat().st_size
    _flip(ck / name, data.draw(st.integers(0, size - 1)))
    assert outcome("require_checkpoint (bit flip)", require_checkpoint, root) is not None
    assert REJECTIONS["require_checkpoint (bit flip)"] > 0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The embedded model, re-saved as two shards with an index (the sharded HF layout)."""
    src = build_embedded()
    out = tmp_path_factory.mktemp("model") / "m"
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(out / shard))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: s for s, part in shards.items() for n in part}}))
    return out


SHARD = "model-00002-of-00002.safetensors"
HF_DAMAGE = {  # kind: (damage(model dir), what the line names)
    "config_missing": (lambda m: (m / "config.json").unlink(), "config.json"),
    "config_not_json": (lambda m: (m / "config.json").write_text("{"), "config.json"),
    "config_a_list": (lambda m: (m / "config.json").write_text("[1]"), "config.json"),
    "no_weights": (lambda m: [p.unlink() for p in m.glob("model*")], "holds no *.safetensors"),
    "only_bin_weights": (lambda m: [p.unlink() for p in m.glob("model*")] and (
        m / "pytorch_model.bin").write_bytes(b"pickle"), "pytorch_model*.bin is not read"),
    "index_not_json": (lambda m: (m / "model.safetensors.index.json").write_text("x"),
                       "index.json"),
    "index_names_a_missing_shard": (lambda m: (m / SHARD).unlink(), SHARD),
    "shard_truncated": (lambda m: os.truncate(m / SHARD, (m / SHARD).stat().st_size // 2),
                        "is truncated"),
    "shard_header_garbage": (lambda m: _flip(m / SHARD, 3), SHARD),
    "shard_empty": (lambda m: (m / SHARD).write_bytes(b""), SHARD),
    "shard_is_a_directory": (lambda m: (m / SHARD).unlink() or (m / SHARD).mkdir(), SHARD),
    "tokenizer_not_json": (lambda m: (m / "tokenizer.json").write_bytes(b"\x00{"),
                           "tokenizer.json"),
}


def test_the_intact_model_passes(model, tmp_path):
    launch_checks(TrainConfig(hf_checkpoint=str(model), run_dir=str(tmp_path / "r")), model)


@pytest.mark.parametrize("kind", sorted(HF_DAMAGE))
def test_a_damaged_hf_directory_is_one_line_at_launch(model, tmp_path, kind):
    damage, named = HF_DAMAGE[kind]
    scratch = tmp_path / "m"
    shutil.copytree(model, scratch)
    damage(scratch)
    line = _cli("vime train --hf-checkpoint (damaged)",
                ["train", "--hf-checkpoint", str(scratch), "--run-dir", str(tmp_path / "run")])
    assert named in line and ("--hf-checkpoint" in line or "hf_checkpoint" in line), line


MISSING = object()  # the key is deleted
# Values no key launch reads accepts, by the kind the key holds (hf_config's tuples).
BAD_VALUES = {
    "a positive integer": ["20", -2, 0, 2.5, True, None, [1], {"a": 1}],
    "a non-negative integer": ["20", -1, 2.5, True, [1]],
    "a positive number": ["1e-6", -1e-6, 0, True, [1]],
    "true or false": ["true", 1, [True]],
    "a JSON object": ["x", 1, [1]],
    "a non-empty string": ["", 2, ["qwen2"], {"a": 1}],
    "a token id": ["1", -2, 20, 2.5, True, [1, "x"], {"a": 1}],
}
KINDS = {**dict.fromkeys(POSITIVE_INTS, "a positive integer"),
         **dict.fromkeys(NON_NEGATIVE_INTS, "a non-negative integer"),
         **dict.fromkeys(POSITIVE_NUMBERS, "a positive number"),
         **dict.fromkeys(BOOLS, "true or false"), **dict.fromkeys(OBJECTS, "a JSON object"),
         "model_type": "a non-empty string", "torch_dtype": "a non-empty string",
         **dict.fromkeys(TOKEN_IDS, "a token id")}
OPTIONAL_NULL = set(KINDS) - set(REQUIRED)  # null: the model family's default


def _config_cases() -> list[tuple[str, object]]:
    cases = [(key, value) for key, kind in KINDS.items() for value in BAD_VALUES[kind]
             if not (value is None and key in OPTIONAL_NULL)]
    return cases + [(key, MISSING) for key in REQUIRED]


@pytest.fixture(scope="module")
def config_scratch(model, tmp_path_factory) -> Path:
    scratch = tmp_path_factory.mktemp("cfg") / "m"
    shutil.copytree(model, scratch)
    return scratch


@pytest.mark.parametrize("key", sorted(KINDS))
def test_a_malformed_config_json_key_is_one_line_naming_the_file_and_key(config_scratch, key,
                                                                         tmp_path):
    """Every bad value of every key launch reads (a string for a count, a negative, a float,
    a boolean, a list, a missing required key) fails `vime train --dry-run` with exit 2 and one
    line naming the flag, the file and the key, never a traceback."""
    intact = json.loads((config_scratch / "config.json").read_text())
    try:
        for name, value in [c for c in _config_cases() if c[0] == key]:
            broken = {k: v for k, v in intact.items() if k != name}
            if value is not MISSING:
                broken[name] = value
            (config_scratch / "config.json").write_text(json.dumps(broken))
            line = _cli("vime train --dry-run (malformed config.json)",
                        ["train", "--dry-run", "--hf-checkpoint", str(config_scratch),
                         "--run-dir", str(tmp_path / "run")])
            assert f"--hf-checkpoint='{config_scratch / 'config.json'}'" in line, line
            assert f'"{name}"' in line and line.count("Fix:") == 1, (name, value, line)
    finally:
        (config_scratch / "config.json").write_text(json.dumps(intact))


@pytest.mark.parametrize("text", ["[1, 2]", '"qwen2"', "3", "null", '{"text_config": [1]}'])
def test_a_config_json_that_is_no_object_of_settings_is_one_line(config_scratch, text,
                                                                 tmp_path):
    intact = (config_scratch / "config.json").read_text()
    try:
        (config_scratch / "config.json").write_text(text)
        line = _cli("vime train --dry-run (config.json not an object)",
                    ["train", "--dry-run", "--hf-checkpoint", str(config_scratch),
                     "--run-dir", str(tmp_path / "run")])
        assert "config.json" in line and "not a JSON object" in line, line
    finally:
        (config_scratch / "config.json").write_text(intact)


FULL_DISK = textwrap.dedent("""
    import json, os, resource, signal, sys
    import torch, torch.distributed as dist
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    from vime_pure.errors import VimeError
    from vime_shell.run import run_checkpoint
    from vime_shell.storage.hf_export import save_hf_checkpoint
    model, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0,
                            world_size=1)
    big = {"w": torch.zeros(1 << 18)}  # 1 MiB: past the 256 KiB limit
    save_hf_checkpoint({"w": torch.zeros(4)}, source_dir=model, target_dir=out + "/hf")
    before = sorted(os.listdir(out + "/hf"))

    class Trainer:
        def save_checkpoint(self, path):
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "__0_0.distcp"), "wb") as fh:
                fh.write(bytes(1 << 20))

    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18))
    lines = []
    for call in (lambda: save_hf_checkpoint(big, source_dir=model, target_dir=out + "/hf"),
                 lambda: run_checkpoint.save(out + "/ck", 2, Trainer(), {})):
        try:
            call()
            lines.append("no error")
        except VimeError as exc:
            lines.append(type(exc).__name__ + ": " + str(exc))
    print(json.dumps({"lines": lines, "kept": sorted(os.listdir(out + "/hf")) == before,
                      "ck": sorted(os.listdir(out + "/ck"))}))
""")


def test_a_full_disk_is_one_typed_error_and_keeps_the_old_files(model, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(model), str(tmp_path),
                           str(port)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    hf, ck = result["lines"]
    assert hf.startswith("ExportError: --save-hf=") and "File too large" in hf, hf
    assert ck.startswith("CheckpointError: --save=") and "File too large" in ck, ck
    assert "\n" not in hf + ck and result["kept"]
    assert result["ck"] == []  # no half-written checkpoint, no tracker
