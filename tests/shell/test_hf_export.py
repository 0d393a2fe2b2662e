"""Raw HF export: reload in transformers, determinism over writer counts, atomicity, refusals."""

import hashlib
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
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_export, "save_file", crash_on_third)
    with pytest.raises(OSError, match="simulated"):
        _export(hf_dir, target, max_shard_size="10KB")
    assert _digest(target) == before  # the old checkpoint, whole
    assert not target.with_name(target.name + ".vime-staging").exists()  # nothing left behind
    monkeypatch.setattr(hf_export, "save_file", real)
    _export(hf_dir, target, max_shard_size="10KB")  # a retry replaces it cleanly
    index = json.loads((target / hf_export.INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {p.name for p in target.glob("model-*")}


def test_stale_weights_removed_and_user_files_kept(hf_dir, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "model-00001-of-00009.safetensors").write_bytes(b"stale")
    (target / "pytorch_model.bin").write_bytes(b"stale")
    (target / "NOTES.md").write_text("mine")
    _export(hf_dir, target)
    assert not (target / "model-00001-of-00009.safetensors").exists()
    assert not (target / "pytorch_model.bin").exists()
    assert (target / "NOTES.md").read_text() == "mine"
    assert (target / "model-00001-of-00001.safetensors").exists()


def test_refuses_source_directory(hf_dir):
    with pytest.raises(ExportError, match="is the source HF directory"):
        _export(hf_dir, hf_dir[0])


def test_sizes_and_plan():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size(1000) == 1000
    with pytest.raises(ExportError, match="max_shard_size"):
        parse_size("lots")
    assert plan_shards({"c": 300, "a": 400, "b": 400}, 800) == [["a", "b"], ["c"]]
    assert plan_shards({"big": 5000, "a": 1}, 100) == [["a"], ["big"]]


def test_every_file_and_the_swap_are_fsynced(hf_dir, tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(hf_export, "fsync_path", lambda p: synced.append(str(p)))
    target = _export(hf_dir, tmp_path / "out", max_shard_size="20KB")
    staging = str(tmp_path / "out.vime-staging")
    shards = sorted(p.name for p in target.glob("model-*.safetensors"))
    # Every shard before its rename, every copied file, the staging dir, then the swap's parent.
    assert {f"{staging}/{name}.tmp" for name in shards} <= set(synced)
    assert f"{staging}/tokenizer.json" in synced and f"{staging}/config.json" in synced
    assert synced[-2:] == [staging, str(tmp_path)]
