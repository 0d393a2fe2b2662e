"""A Hugging Face model directory checked at launch, reading only headers (torch-free).

``check_hf_dir`` refuses, with ``ModelLoadError`` naming the file, a directory a loader would
fail on minutes later (or, worse, load partly): a malformed ``config.json``
(``hf_config.check_config``); no
safetensors weights (the trainer's loader reads no ``.bin``); a weight index that is not JSON or names a shard that is missing; a weight
file that is a directory, FIFO or device; a ``.safetensors`` file whose header is not
safetensors, or that is shorter than its header says (truncated); a tokenizer JSON file that
is not JSON. Cost: one header read per shard (8 bytes plus its JSON), however large the shard.

Example: a shard cut to half its size fails with ``--hf-checkpoint=.../model-00002-of-00002.
safetensors: is truncated: its header describes 1048576 bytes of tensors, the file holds
524288 ...``.
"""

import json
import os
import stat
import struct
from pathlib import Path

from vime_pure.errors import field_error
from vime_shell.models.hf_config import ModelLoadError, check_config, read_config_json

INDEX = "model.safetensors.index.json"
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                  "special_tokens_map.json")
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header's JSON


def _damaged(flag: str, path: Path, problem: str) -> ModelLoadError:
    return field_error(ModelLoadError, flag, str(path), problem,
                       "restore the model directory from its source (save_pretrained, "
                       f"huggingface-cli download) or point {flag} at an intact copy")


def _json(flag: str, path: Path) -> object:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _damaged(flag, path, f"is not readable JSON ({type(exc).__name__}: "
                    f"{str(exc)[:80]})") from None


def _regular(flag: str, path: Path, what: str) -> int:
    """``path``'s size when it is a regular file; else the error a loader would meet later."""
    try:
        st = os.stat(path)
    except OSError:
        raise _damaged(flag, path, f"is missing ({what})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _damaged(flag, path, f"is not a regular file ({what})")
    return st.st_size


def check_safetensors(flag: str, path: Path) -> None:
    """The header parses and the file is as long as the tensors it describes."""
    size = _regular(flag, path, "a weight file")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (None,)
            if length is None or not 2 <= length <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} does not fit a {size}-byte file")
            header = json.loads(fh.read(length).decode("utf-8"))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, UnicodeDecodeError, TypeError, KeyError, IndexError,
            AttributeError, RecursionError) as exc:
        raise _damaged(flag, path, f"is not a safetensors file ({type(exc).__name__}: "
                    f"{str(exc)[:80]})") from None
    data = size - 8 - length
    if max(ends, default=0) > data:
        raise _damaged(flag, path, f"is truncated: its header describes {max(ends)} bytes of "
                    f"tensors, the file holds {data}")


def weight_files(flag: str, root: Path) -> list[Path]:
    """The safetensors files the trainer's loader (mbridge) reads: the index's shards, else
    every ``*.safetensors`` (it reads no ``pytorch_model*.bin``)."""
    index = root / INDEX
    if index.exists():
        data = _json(flag, index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(v, str) and v and "/" not in v for v in weight_map.values()):
            raise _damaged(flag, index, "has no weight_map of tensor names to shard files")
        return [root / shard for shard in sorted(set(weight_map.values()))]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        bins = (" (pytorch_model*.bin is not read: load the model in transformers and "
                "save_pretrained it, which writes safetensors)")
        raise _damaged(flag, root, "holds no *.safetensors weights" + (
            bins if any(root.glob("pytorch_model*.bin")) else ""))
    return found


def check_hf_dir(hf_dir: str | Path, flag: str = "--hf-checkpoint") -> None:
    """Refuse a damaged model directory (module docstring); reads headers only."""
    root = Path(hf_dir).expanduser()
    check_config(read_config_json(root, flag), root / "config.json", flag)
    for path in weight_files(flag, root):
        check_safetensors(flag, path)
    for name in TOKENIZER_JSON:
        if (root / name).exists():
            _json(flag, root / name)
