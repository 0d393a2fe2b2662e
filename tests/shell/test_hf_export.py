"""Raw HF export: reload in transformers, determinism over writer counts, atomicity, refusals."""

import hashlib
import os
import stat
import json
import threading

import pytest
import torch

from vime_shell.storage import hf_export
from vime_shell.storage.hf_export import ExportError, parse_size, plan_shards, save_hf_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("src")
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    return path, model


def _logits(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(torch.arange(12).view(1, 12)).logits


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def _export(hf_dir, target, writers=1, **kw):
    src, model = hf_dir
    tensors = dict(model.state_dict())
    if writers == 1:
        return save_hf_checkpoint(tensors, source_dir=src, target_dir=target, **kw)
    barrier = threading.Barrier(writers)
    errors = []

    def write(rank):
        try:
            save_hf_checkpoint(tensors, source_dir=src, target_dir=target, writer_rank=rank,
                               writers=writers, barrier=barrier.wait, **kw)
        except Exception as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=write, args=(r,)) for r in range(writers)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    if errors:
        raise errors[0]
    return target


def test_reload_in_transformers_gives_same_logits(hf_dir, tmp_path):
    target = _export(hf_dir, tmp_path / "out", max_shard_size="20KB")
    index = json.loads((target / hf_export.INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = sum(t.numel() * t.element_size() for t in hf_dir[1].state_dict().values())
    assert index["metadata"]["total_size"] == total
    assert (target / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    assert (target / "generation_config.json").exists()
    torch.testing.assert_close(_logits(target), _logits(hf_dir[0]), rtol=0, atol=0)


def test_deterministic_for_one_and_two_writers(hf_dir, tmp_path):
    one = _export(hf_dir, tmp_path / "w1", max_shard_size="20KB")
    two = _export(hf_dir, tmp_path / "w2", writers=2, max_shard_size="20KB")
    assert _digest(one) == _digest(two)


def test_crash_between_shard_writes_keeps_old_checkpoint(hf_dir, tmp_path, monkeypatch):
    target = _export(hf_dir, tmp_path / "out", max_shard_size="20KB")
    before = _digest(target)
    real, calls = hf_export.save_file, []

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_export, "save_file", crash_on_third)
    with pytest.raises(ExportError, match="--save-hf=.*cannot be written.*No space left"):
        _export(hf_dir, target, max_shard_size="10KB")
    assert _digest(target) == before  # the old checkpoint, whole
    assert not (target / ".vime-staging").exists()  # nothing left behind
    monkeypatch.setattr(hf_export, "save_file", real)
    _export(hf_dir, target, max_shard_size="10KB")  # a retry replaces it cleanly
    index = json.loads((target / hf_export.INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {p.name for p in target.glob("model-*")}


def test_only_its_own_files_are_replaced_or_removed(hf_dir, tmp_path):
    target = _export(hf_dir, tmp_path / "out", max_shard_size="10KB")
    many = sorted(p.name for p in target.glob("model-*"))
    (target / "NOTES.md").write_text("mine")
    (target / "eval").mkdir()
    (target / "eval" / "scores.pt").write_bytes(b"mine")
    (target / "adapter.safetensors").write_bytes(b"mine")
    _export(hf_dir, target, max_shard_size="5GB")  # 1 shard now: the old ones are stale
    assert sorted(p.name for p in target.glob("model-*")) == ["model-00001-of-00001.safetensors"]
    assert len(many) > 1
    assert (target / "NOTES.md").read_text() == "mine"
    assert (target / "eval" / "scores.pt").read_bytes() == b"mine"
    assert (target / "adapter.safetensors").read_bytes() == b"mine"


def test_foreign_directory_needs_overwrite_and_keeps_every_other_file(hf_dir, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "model-00001-of-00009.safetensors").write_bytes(b"theirs")
    (target / "pytorch_model.bin").write_bytes(b"theirs")
    (target / "sub").mkdir()
    (target / "sub" / "x.pt").write_bytes(b"theirs")
    with pytest.raises(ExportError, match="holds 3 entries no vime export wrote"):
        _export(hf_dir, target)
    assert sorted(p.name for p in target.iterdir()) == [
        "model-00001-of-00009.safetensors", "pytorch_model.bin", "sub"]
    _export(hf_dir, target, overwrite=True)
    assert (target / "model-00001-of-00001.safetensors").exists()
    for name in ("model-00001-of-00009.safetensors", "pytorch_model.bin"):
        assert (target / name).read_bytes() == b"theirs"
    assert (target / "sub" / "x.pt").read_bytes() == b"theirs"
    _export(hf_dir, target)  # vime's marker is there now: no flag needed


def test_refuses_source_directory_its_parent_and_inside(hf_dir):
    for target in (hf_dir[0], hf_dir[0].parent, hf_dir[0] / "sub"):
        before = _digest(hf_dir[0])
        with pytest.raises(ExportError, match="the source HF directory"):
            _export(hf_dir, target)
        assert _digest(hf_dir[0]) == before and not (hf_dir[0] / "sub").exists()


def test_exported_files_follow_the_umask(hf_dir, tmp_path):
    old = os.umask(0o022)
    try:
        target = _export(hf_dir, tmp_path / "out")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_a_mount_point_target_is_written_in_place(hf_dir, tmp_path, monkeypatch):
    """A mount point cannot be renamed over or away (EBUSY): the staging directory inside the
    target keeps every move a rename of a file within the target's own file system."""
    target = tmp_path / "mnt"
    target.mkdir()
    real = os.replace

    def refuse_target_rename(a, b, **kw):
        if str(target) in (os.path.abspath(a), os.path.abspath(b)):
            raise OSError(16, "Device or resource busy (simulated mount point)")
        return real(a, b, **kw)

    monkeypatch.setattr(os, "replace", refuse_target_rename)
    _export(hf_dir, target)
    assert (target / hf_export.INDEX_NAME).is_file() and not (target / ".vime-staging").exists()


def test_sizes_and_plan():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size(1000) == 1000
    with pytest.raises(ExportError, match="max_shard_size"):
        parse_size("lots")
    assert plan_shards({"c": 300, "a": 400, "b": 400}, 800) == [["a", "b"], ["c"]]
    assert plan_shards({"big": 5000, "a": 1}, 100) == [["a"], ["big"]]




def test_every_file_and_the_swap_are_fsynced(hf_dir, tmp_path, monkeypatch):
    from vime_shell.storage import export_target

    synced = []
    monkeypatch.setattr(hf_export, "fsync_path", lambda p: synced.append(str(p)))
    monkeypatch.setattr(export_target, "fsync_path", lambda p: synced.append(str(p)))
    target = _export(hf_dir, tmp_path / "out", max_shard_size="20KB")
    staging = str(target / ".vime-staging")
    parts = [f"part-{k:05d}" for k in range(len(list(target.glob("model-*.safetensors"))))]
    # Every shard before its rename, every copied file, the staging dir, then the target.
    assert {f"{staging}/{name}.tmp" for name in parts} <= set(synced)
    assert f"{staging}/tokenizer.json" in synced and f"{staging}/config.json" in synced
    assert staging in synced and synced[-1] == str(target)
    assert synced.index(staging) < synced.index(str(target))


def test_streamed_pairs_equal_the_mapping(hf_dir, tmp_path):
    tensors = dict(hf_dir[1].state_dict())
    one = _export(hf_dir, tmp_path / "a", max_shard_size="20KB")
    two = save_hf_checkpoint(((n, tensors[n]) for n in sorted(tensors)), source_dir=hf_dir[0],
                             target_dir=tmp_path / "b", max_shard_size="20KB")
    assert _digest(one) == _digest(two)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 256 KiB tmpfs mount point (root only; skipped where mounting is not allowed)."""
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
            capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs is not allowed here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_export_into_a_full_mount_point(hf_dir, tiny_tmpfs):
    """Found: --save-hf on a mount point lost the export; a full disk was a traceback."""
    assert os.path.ismount(tiny_tmpfs)
    small = {"w": torch.zeros(16)}
    save_hf_checkpoint(small, source_dir=hf_dir[0], target_dir=tiny_tmpfs)
    before = _digest(tiny_tmpfs)
    with pytest.raises(ExportError, match="--save-hf=.*cannot be written.*No space left"):
        save_hf_checkpoint({"w": torch.zeros(1 << 17)}, source_dir=hf_dir[0],  # 512 KiB
                           target_dir=tiny_tmpfs)
    assert _digest(tiny_tmpfs) == before and os.path.ismount(tiny_tmpfs)
    assert not (tiny_tmpfs / ".vime-staging").exists()


def _stream(tensors, seen):
    for name in sorted(tensors):
        seen.append(name)
        yield name, tensors[name].clone()


def test_two_writers_of_one_stream_write_the_one_writer_files(hf_dir, tmp_path):
    # --save-hf streamed: every per-node writer reads the trainer's whole export and writes
    # only its shards; the files equal a one-writer export of the stream and of a mapping.
    src, model = hf_dir
    tensors = dict(model.state_dict())
    barrier, errors, seen = threading.Barrier(2), [], {0: [], 1: []}

    def write(rank):
        try:
            save_hf_checkpoint(_stream(tensors, seen[rank]), source_dir=src,
                               target_dir=tmp_path / "two", max_shard_size="20KB",
                               writer_rank=rank, writers=2, barrier=barrier.wait)
        except Exception as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=write, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    assert seen[0] == seen[1] == sorted(tensors)  # both drained the whole stream
    one = save_hf_checkpoint(_stream(tensors, []), source_dir=src, target_dir=tmp_path / "one",
                             max_shard_size="20KB")
    mapping = save_hf_checkpoint(tensors, source_dir=src, target_dir=tmp_path / "map",
                                 max_shard_size="20KB")
    assert len(list((tmp_path / "two").glob("model-*.safetensors"))) > 2
    assert _digest(tmp_path / "two") == _digest(one) == _digest(mapping)
