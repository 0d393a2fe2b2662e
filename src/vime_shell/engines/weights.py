"""Reading and writing HF weight directories (``*.safetensors``) for weight sync.

Invariant: ``load_safetensors_dir(save_safetensors_dir(d, tensors)) == tensors`` exactly.
"""

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vime_pure.errors import field_error
from vime_shell.engines.base import EngineError


def load_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in ``path``, by HF name.

    Example: a ``save_pretrained`` directory of a 2-layer Qwen2 gives ~25 names such as
    ``model.layers.0.self_attn.q_proj.weight``.
    """
    directory = Path(path).expanduser()
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise field_error(EngineError, "path", str(directory),
                          "holds no *.safetensors files",
                          "pass a directory written by save_pretrained or save_safetensors_dir")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name in tensors:
                raise field_error(EngineError, "tensor", name,
                                  f"appears in more than one file of {directory}",
                                  "remove stale shards from the directory")
            tensors[name] = tensor
    return tensors


def save_safetensors_dir(path: str | Path,
                         named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Path:
    """Write ``named_tensors`` to ``path/model.safetensors`` (atomically); returns ``path``."""
    directory = Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in named_tensors}
    tmp = directory / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(directory / "model.safetensors")
    return directory
