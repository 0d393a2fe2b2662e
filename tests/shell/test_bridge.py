"""The bridge between trainer rank 0 and an engine rank, on gloo (CPU): a command, then
weights of mixed dtypes and odd sizes in several layer-aligned buckets, arrive bit-exact and
in order, and a reply comes back. The same body runs on NCCL in ``tests/gpu/
test_bridge_gpu.py``."""

import pytest
import torch

from tests.shell.bridge_workers import bridge_worker, sent_weights
from vime_shell.engines.remote import _layout
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


def check_roundtrip(trainer: dict, engine: dict, device: str) -> None:
    """The engine saw rank 0's command, every tensor bit-exact on ``device``, in order."""
    sent = sent_weights()
    assert engine["command"] == ("weights", 7)
    assert [n for n, _, _ in engine["received"]] == [n for n, _ in sent]
    for (_, where, got), (_, want) in zip(engine["received"], sent):
        assert where == device and got.dtype == want.dtype and torch.equal(got, want)
    assert trainer["tensors"] == len(sent) and trainer["buckets"] >= 3
    assert trainer["reply"] == ("loaded", len(sent))


def test_layout_aligns_every_tensor():
    offsets, size = _layout([("a", "torch.bfloat16", (3,)), ("b", "torch.float32", (2,))])
    assert (offsets, size) == ([0, 16], 24)


def test_weights_cross_the_gloo_bridge_bit_exact():
    trainer, engine = spawn(bridge_worker, 2, "gloo", timeout=300)  # a hang's bound
    check_roundtrip(trainer, engine, "cpu")
    check_byte_counts(trainer, engine)


def check_byte_counts(trainer: dict, engine: dict) -> None:
    """Both sides count the same bytes per kind: commands and the reply as control, the
    buckets (their names and bytes, padded) as weights, a batch reply as batch."""
    sent, received = trainer["bytes"], engine["bytes"]
    assert sent["sent"] == received["received"] and sent["received"] == received["sent"]
    assert sent["sent"]["weights"] >= trainer["weight_bytes"] > 0
    assert sent["received"]["batch"] > len(trainer["batch"]) == 1000
    assert sent["sent"]["control"] > 0 and sent["received"]["control"] > 0
    assert sent["sent"]["probe"] == sent["received"]["probe"] == 0
