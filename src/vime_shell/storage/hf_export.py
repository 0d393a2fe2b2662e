"""Raw Hugging Face checkpoint export (``--save-hf DIR``): sharded safetensors plus index.

Layout written: ``model-0000k-of-0000N.safetensors`` shards under ``max_shard_size`` bytes and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), next to every
non-weight file of the source HF directory (config incl. ``quantization_config``, tokenizer
files, generation config). A checkpoint small enough for one shard is still written as
``model-00001-of-00001.safetensors`` with an index, so readers see one layout.

Invariants (tested):

- **Deterministic.** Shards are filled in sorted-name order up to the size limit, so the files
  and the index are identical whatever the number of writer ranks.
- **Only its own files.** Where the export may go and how it lands there is
  :mod:`vime_shell.storage.export_target`: everything is written into a fresh
  ``<target>/.vime-staging/`` (each file fsynced), then only the files it produced are renamed
  into the target, the index last; nothing else in the directory is replaced, moved or
  deleted. A failure before that leaves the old export intact and removes the staging
  directory; an I/O error (full disk, permissions) is an ``ExportError`` naming the target.
- **Never in place.** A target that is, contains or lies inside the source directory is refused.
- **Streaming.** ``tensors`` may be any iterable of ``(name, tensor)`` (the trainer's export,
  ``MegatronTrainer.hf_buckets``): shards fill in arrival order and each writer holds one
  shard in memory at a time. With ``writers > 1`` every writer reads the same stream.
- **Several writers.** With ``writers > 1`` (one per node), writer ``r`` writes shards ``k``
  with ``k % writers == r`` (a mapping is planned in sorted-name order first) and rank 0
  writes the index and publishes after ``barrier()``.
- **Modes.** Files get ``0o666`` less the umask, like any file the user creates.

Example: 3 tensors of 400, 400 and 300 bytes with ``max_shard_size=800`` give shards
``{a, b}`` and ``{c}``: ``model-00001-of-00002.safetensors`` and ``model-00002-of-00002...``.
"""

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from vime_pure.errors import field_error
from vime_shell.storage.export_target import (INDEX_NAME, check_export_target, fresh_staging,
                                              publish)
from vime_shell.storage.files import fsync_path, umask_mode, write_atomic
from vime_shell.storage.sizes import ExportError, parse_size  # noqa: F401

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


Tensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def save_hf_checkpoint(
    tensors: Tensors, *, source_dir: str | Path, target_dir: str | Path,
    max_shard_size: int | str = "5GB", writer_rank: int = 0, writers: int = 1,
    barrier: Callable[[], None] = lambda: None, overwrite: bool = False,
) -> Path:
    """Write ``tensors`` (HF names) as a sharded checkpoint; returns the target directory.

    ``overwrite``: write into a non-empty directory no vime export wrote (``--save-hf-
    overwrite``); only the produced files are replaced there."""
    source = Path(source_dir).resolve()
    if not (source / "config.json").is_file():
        raise ExportError(f"source_dir={str(source_dir)!r} has no config.json. Fix: pass the HF "
                          "model directory the run was loaded from.")
    # Writer 0 checks (and then creates) the target; the others would see it half-created.
    target = (check_export_target(target_dir, protected={"the source HF directory": source},
                                  overwrite=overwrite)
              if writer_rank == 0 else Path(target_dir).expanduser().resolve())
    if not 0 <= writer_rank < writers:
        raise ExportError(f"writer_rank={writer_rank} is outside 0..{writers - 1}.")
    limit = parse_size(max_shard_size)
    staging = target / ".vime-staging"
    try:
        if writer_rank == 0:
            staging = fresh_staging(target)
        barrier()
        if writers == 1 or not isinstance(tensors, Mapping):
            weight_map, total = _write_stream(_pairs(tensors), staging, limit, writer_rank,
                                              writers)
        else:
            weight_map, total = _write_planned(tensors, staging, limit, writer_rank, writers)
        barrier()
        if writer_rank == 0:
            _finalise(weight_map, total, source, target, staging)
        barrier()
    except BaseException as exc:
        # A failed export leaves the old files as they were and no staging directory
        # (another writer may still be writing into it: it then fails too, and cleans up).
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, (OSError, SafetensorError)):  # safetensors' own I/O error type
            raise field_error(ExportError, "--save-hf", str(target_dir),
                              f"cannot be written ({type(exc).__name__}: {exc})",
                              "free space or fix permissions there and export again; the "
                              "files already there are untouched") from exc
        raise
    return target


def _pairs(tensors: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tensors, Mapping):
        return ((name, tensors[name]) for name in sorted(tensors))
    return iter(tensors)


def _write_shard(staging: Path, name: str, part: dict[str, torch.Tensor]) -> None:
    tmp = staging / (name + ".tmp")
    save_file(part, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, umask_mode())  # safetensors creates 0o600; an export is shared like any file
    fsync_path(tmp)  # durable before the rename publishes it
    os.replace(tmp, staging / name)


def _write_stream(pairs: Iterator[tuple[str, torch.Tensor]], staging: Path, limit: int,
                  writer_rank: int = 0, writers: int = 1) -> tuple[dict[str, str], int]:
    """Fill shards in arrival order (``plan_shards``' rule: a shard closes when the next
    tensor would overflow it), each written as ``part-k`` and renamed to ``model-k-of-N`` once
    ``N`` is known. With several writers every writer reads the same stream (the trainer's
    export reaches every rank) and keeps and writes only its shards ``k % writers ==
    writer_rank``: one shard in memory per writer. Returns ``(weight_map, total bytes)``."""
    shards: list[list[str]] = []
    names: list[str] = []
    part: dict[str, torch.Tensor] = {}
    used = total = 0

    def close() -> None:
        if len(shards) % writers == writer_rank:
            _write_shard(staging, f"part-{len(shards):05d}", part)
        shards.append(list(names))

    for name, tensor in pairs:
        size = _nbytes(tensor)
        if names and used + size > limit:
            close()
            part, names, used = {}, [], 0
        names.append(name)
        if len(shards) % writers == writer_rank:  # another writer's shard: not kept
            part[name] = tensor.detach().to("cpu").contiguous()
        used += size
        total += size
    if names:
        close()
    part = {}
    if not shards:
        raise ExportError("tensors is empty. Fix: export the model's named parameters.")
    for k in range(writer_rank, len(shards), writers):
        os.replace(staging / f"part-{k:05d}", staging / shard_name(k, len(shards)))
    return {n: shard_name(k, len(shards)) for k, names in enumerate(shards) for n in names}, total


def _write_planned(tensors: Tensors, staging: Path, limit: int, writer_rank: int,
                   writers: int) -> tuple[dict[str, str], int]:
    """Several writers: the plan from every tensor's size; this writer's shards only."""
    if not isinstance(tensors, Mapping):
        raise ExportError("several writers need tensors as a mapping (the shard plan needs "
                          "every size). Fix: pass a dict, or writers=1 to stream.")
    if not tensors:
        raise ExportError("tensors is empty. Fix: export the model's named parameters.")
    shards = plan_shards({n: _nbytes(t) for n, t in tensors.items()}, limit)
    for k in range(writer_rank, len(shards), writers):
        _write_shard(staging, shard_name(k, len(shards)),
                     {n: tensors[n].detach().to("cpu").contiguous() for n in shards[k]})
    return ({n: shard_name(k, len(shards)) for k, names in enumerate(shards) for n in names},
            sum(_nbytes(t) for t in tensors.values()))


def _finalise(weight_map: dict[str, str], total: int, source: Path, target: Path,
              staging: Path) -> None:
    for name in sorted(set(weight_map.values())):
        if not (staging / name).is_file():
            raise ExportError(f"shard {name} is missing from {staging}: a writer rank failed. "
                              "The old checkpoint is untouched.")
    for src in sorted(source.iterdir()):
        if src.is_file() and not is_weight_file(src.name) and not src.name.startswith("."):
            shutil.copyfile(src, staging / src.name)  # a copy (any file system), the umask's mode
            fsync_path(staging / src.name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_atomic(staging / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
    publish(staging, target)
