"""``--save-hf`` streamed by several writers: each per-node writer reads the same stream of
``(name, tensor)`` (the trainer's export reaches every rank) and writes only its shards; the
files equal a one-writer export of the same stream, and of the same tensors as a mapping."""

import hashlib
import threading

import pytest
import torch

from vime_shell.storage.hf_export import save_hf_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("src")
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return path, dict(model.state_dict())


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def _stream(tensors, seen):
    for name in sorted(tensors):
        seen.append(name)
        yield name, tensors[name].clone()


def test_two_writers_of_one_stream_write_the_one_writer_files(hf_dir, tmp_path):
    src, tensors = hf_dir
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
