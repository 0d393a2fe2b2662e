"""The tensors of a checkpoint that vime does not train, carried into ``--save-hf`` unchanged,
so an export is as complete a checkpoint as its source.

Two groups, by name, and nothing else (a weight the trainer should have exported but did not
is a mapping error, never filled in from the source):

- a multimodal checkpoint's vision tower (``model.visual.*``: Qwen3.5's); vime trains the
  language model;
- multi-token prediction layers (``mtp.*``: Qwen3.5, Qwen3-Next; ``model.mtp_layers.*``:
  MiMo; ``model.layers.{n}.*`` from ``n = num_hidden_layers`` on: DeepSeek-V3, GLM-4.5,
  GLM-4.7-Flash). Without ``--enable-mtp-training`` vime does not train them (slime's
  ``--mtp-num-layers`` alone: built, loaded and synced there, never updated), so they stay the
  checkpoint's: an engine that drafts with them (speculative decoding) loads them from the
  checkpoint, and a weight sync need not carry them. With it (``mtp_trained``: DeepSeek-V3's
  and MiMo's, the families ``vime_shell.megatron.mtp`` trains) they are the trainer's export,
  not carried.

Example: a Qwen3.5 checkpoint with ``model.visual.blocks.0.attn.qkv.weight`` and
``mtp.fc.weight`` gives both names; a Qwen2 checkpoint none.
"""

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from vime_shell.storage.hf_check import weight_files

_VISION = re.compile(r"^model\.visual\.")
_MTP = re.compile(r"^(mtp\.|model\.mtp_layers\.)")
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


def is_untrained(name: str, num_layers: int, mtp_trained: bool = False) -> bool:
    """Whether checkpoint tensor ``name`` is in a group vime does not train (module docstring);
    ``num_layers``: the decoder's (``num_hidden_layers``)."""
    return bool(_VISION.match(name)) or (is_mtp_tensor(name, num_layers) and not mtp_trained)


def is_mtp_tensor(name: str, num_layers: int) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a multi-token prediction layer (module
    docstring); what a weight sync leaves out too (no engine drafts with them)."""
    layer = _LAYER.match(name)
    return bool(_MTP.match(name)) or (layer is not None and int(layer.group(1)) >= num_layers)


def untrained_tensors(hf_dir: str | Path, num_layers: int, mtp_trained: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every untrained tensor of the checkpoint in ``hf_dir``, shard by
    shard (the ones the trainer's loader reads, ``hf_check.weight_files``), in name order
    within each, one tensor in memory at a time."""
    for file in weight_files("--hf-checkpoint", Path(hf_dir)):
        with safe_open(str(file), framework="pt") as handle:
            for name in sorted(n for n in handle.keys()
                               if is_untrained(n, num_layers, mtp_trained)):
                yield name, handle.get_tensor(name)
