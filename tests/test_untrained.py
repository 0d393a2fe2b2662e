"""The tensors ``--save-hf`` carries unchanged (``vime_shell.storage.untrained``): a vision
tower and multi-token prediction layers, by name, and nothing the trainer exports."""

import torch
from safetensors.torch import save_file

from vime_shell.storage.untrained import is_untrained, untrained_tensors


def test_the_untrained_groups_by_name():
    assert is_untrained("model.visual.blocks.0.attn.qkv.weight", 4)
    assert is_untrained("mtp.fc.weight", 4) and is_untrained("model.mtp_layers.0.norm.weight", 4)
    assert is_untrained("model.layers.4.eh_proj.weight", 4)  # DeepSeek-V3 / GLM: layer L
    assert is_untrained("model.language_model.layers.5.mlp.gate.weight", 4)
    for trained in ("model.layers.3.mlp.gate.weight", "lm_head.weight",
                    "model.language_model.embed_tokens.weight", "model.norm.weight"):
        assert not is_untrained(trained, 4), trained


def test_they_are_read_from_the_checkpoint_in_name_order(tmp_path):
    """(Within a shard; here the only one.)"""
    tensors = {"model.layers.0.w": torch.zeros(1), "model.layers.2.w": torch.ones(2),
               "mtp.norm.weight": torch.full((3,), 2.0), "lm_head.weight": torch.zeros(1)}
    save_file(tensors, tmp_path / "model.safetensors")
    out = dict(untrained_tensors(tmp_path, num_layers=2))
    assert list(out) == ["model.layers.2.w", "mtp.norm.weight"]
    assert all(torch.equal(out[k], tensors[k]) for k in out)
