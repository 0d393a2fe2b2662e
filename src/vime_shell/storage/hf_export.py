"""Raw Hugging Face checkpoint export (``--save-hf DIR``): sharded safetensors plus index.

Layout written: ``model-0000k-of-0000N.safetensors`` shards under ``max_shard_size`` bytes and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), next to every
non-weight file of the source HF directory (config incl. ``quantization_config``, tokenizer
files, generation config). A checkpoint small enough for one shard is still written as
``model-00001-of-00001.safetensors`` with an index, so readers see one layout.

Invariants (tested):

- **Deterministic.** The shard plan depends only on tensor names (sorted) and byte sizes, so
  the files and the index are identical whatever the number of writer ranks.
- **Atomic and durable.** Everything is written into a staging directory beside the target
  (``<target>.vime-staging``), each file fsynced; only when the index is complete is the
  staging directory fsynced and swapped into place (one ``renameat2(RENAME_EXCHANGE)`` on
  Linux, else two renames), then its parent fsynced. A crash at any point before the swap
  leaves the old checkpoint untouched; a failed export removes its staging directory; stale
  weight files of the old checkpoint disappear with it. Files in the old target that are
  neither weights nor in the source are carried over.
- **Never in place.** A target equal to the source directory is refused.
- **Several writers.** With ``writers > 1`` (one per node), writer ``r`` writes shards
  ``k`` with ``k % writers == r`` and rank 0 writes the index and swaps after ``barrier()``.

Example: 3 tensors of 400, 400 and 300 bytes with ``max_shard_size=800`` give shards
``{a, b}`` and ``{c}``: ``model-00001-of-00002.safetensors`` and ``model-00002-of-00002...``.
"""

import ctypes
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from vime_shell.storage.files import fsync_path, write_atomic
from vime_shell.storage.sizes import ExportError, parse_size  # noqa: F401

INDEX_NAME = "model.safetensors.index.json"
WEIGHT_PATTERNS = (r".*\.safetensors$", r".*\.safetensors\.index\.json$", r"pytorch_model.*\.bin$",
                   r"pytorch_model\.bin\.index\.json$", r".*\.pt$", r".*\.pth$")
_WEIGHT_RE = re.compile("|".join(WEIGHT_PATTERNS))


def plan_shards(sizes: Mapping[str, int], max_shard_size: int) -> list[list[str]]:
    """Greedy in sorted-name order; a new shard starts when the next tensor would overflow."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes):
        if shards[-1] and used + sizes[name] > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def shard_name(k: int, total: int) -> str:
    return f"model-{k + 1:05d}-of-{total:05d}.safetensors"


def is_weight_file(name: str) -> bool:
    return bool(_WEIGHT_RE.fullmatch(name))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_hf_checkpoint(
    tensors: Mapping[str, torch.Tensor], *, source_dir: str | Path, target_dir: str | Path,
    max_shard_size: int | str = "5GB", writer_rank: int = 0, writers: int = 1,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Write ``tensors`` (HF names) as a sharded checkpoint; returns the target directory."""
    source, target = Path(source_dir).resolve(), Path(target_dir).resolve()
    if source == target:
        raise ExportError(f"target_dir={str(target_dir)!r} is the source HF directory. Fix: "
                          "pass a different --save-hf directory; vime never overwrites the "
                          "checkpoint it loaded from.")
    if not (source / "config.json").is_file():
        raise ExportError(f"source_dir={str(source_dir)!r} has no config.json. Fix: pass the HF "
                          "model directory the run was loaded from.")
    if not 0 <= writer_rank < writers:
        raise ExportError(f"writer_rank={writer_rank} is outside 0..{writers - 1}.")
    if not tensors:
        raise ExportError("tensors is empty. Fix: export the model's named parameters.")
    limit = parse_size(max_shard_size)
    shards = plan_shards({n: _nbytes(t) for n, t in tensors.items()}, limit)
    staging = target.with_name(target.name + ".vime-staging")
    try:
        if writer_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        barrier()
        for k in range(writer_rank, len(shards), writers):
            part = {n: tensors[n].detach().to("cpu").contiguous() for n in shards[k]}
            tmp = staging / (shard_name(k, len(shards)) + ".tmp")
            save_file(part, str(tmp), metadata={"format": "pt"})
            fsync_path(tmp)  # durable before the rename publishes it
            os.replace(tmp, staging / shard_name(k, len(shards)))
        barrier()
        if writer_rank == 0:
            _finalise(tensors, shards, source, target, staging)
        barrier()
    except BaseException:
        # A failed export leaves the old checkpoint as it was and no staging directory
        # (another writer may still be writing into it: it then fails too, and cleans up).
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _finalise(tensors: Mapping[str, torch.Tensor], shards: list[list[str]], source: Path,
              target: Path, staging: Path) -> None:
    for k in range(len(shards)):
        if not (staging / shard_name(k, len(shards))).is_file():
            raise ExportError(f"shard {shard_name(k, len(shards))} is missing from {staging}: a "
                              "writer rank failed. The old checkpoint is untouched.")
    for src in sorted(source.iterdir()):
        if src.is_file() and not is_weight_file(src.name):
            shutil.copy2(src, staging / src.name)
            fsync_path(staging / src.name)
    if target.is_dir():  # keep the user's own non-weight files that the source does not have
        for old in sorted(target.iterdir()):
            if old.is_file() and not is_weight_file(old.name) and not (staging / old.name).exists():
                shutil.copy2(old, staging / old.name)
                fsync_path(staging / old.name)
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
             "weight_map": {n: shard_name(k, len(shards))
                            for k, names in enumerate(shards) for n in names}}
    write_atomic(staging / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
    fsync_path(staging)  # every file and rename inside is durable before the swap
    _swap_into_place(staging, target)
    fsync_path(target.parent)  # and so is the swap


def _swap_into_place(staging: Path, target: Path) -> None:
    """Make ``staging`` the ``target``; the old target (if any) is removed afterwards."""
    if not target.exists():
        os.replace(staging, target)
        return
    if _rename_exchange(staging, target):
        shutil.rmtree(staging)  # now holds the old checkpoint
        return
    old = target.with_name(target.name + ".vime-old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old)


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
