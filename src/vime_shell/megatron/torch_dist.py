"""Megatron's ``torch_dist`` checkpoint format, written synchronously and read without pickle.

A ``torch_dist`` directory (``megatron.core.dist_checkpointing``) holds ``__<rank>_0.distcp``
(tensor bytes), ``.metadata`` (the global index), ``common.pt`` (values every rank shares) and
``metadata.json`` (the format name). Two parts of the stock path do not fit vime:

- **writing**: Megatron 0.16.1's ``TorchDistSaveShardedStrategy`` always goes through its async
  writer, which forks one writer process per file, spawns a ``multiprocessing`` Manager and
  needs ``psutil``. :class:`SyncTorchDistSave` writes the same files in-process with torch's
  ``FileSystemWriter(sync_files=True)`` (each file fsynced); the stock loader reads them.
- **reading**: ``.metadata`` is read by torch's ``FileSystemReader`` with plain
  ``pickle.load``, ``common.pt`` with ``torch.load`` (weights-only only by torch's default,
  which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns off), and every ``ShardedObject`` with
  ``torch.load(weights_only=False)``. So :func:`check_metadata` unpickles ``.metadata`` first
  with an allowlist of torch's checkpoint-metadata classes (anything else raises before the
  stock reader sees the file), :class:`SafeCommonLoad` passes ``weights_only=True``
  explicitly, and :func:`split_objects` takes every ``ShardedObject`` out of a load request.

Limit of the ``.metadata`` check: it and the stock reader read the file twice; a process that
rewrites the checkpoint *while* it is being loaded is outside what this guards against.

Example: ``dist_checkpointing.save(sd, d, sharded_strategy=SyncTorchDistSave())`` then
``check_metadata(d); dist_checkpointing.load(split_objects(sd)[0], d,
common_strategy=SafeCommonLoad())``.
"""

import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.common import (COMMON_STATE_FNAME,
                                                                 TorchCommonLoadStrategy)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict)

from vime_pure.errors import VimeError, field_error

METADATA_FILE = ".metadata"
EXTRA_STATE = "._extra_state"

# Every global a torch 2.13 ``.metadata`` pickle names (dataclasses of
# torch.distributed.checkpoint, torch.Size, dtypes, layouts, the checkpoint's path), and no more.
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeCheckpointError(VimeError):
    """A checkpoint file that names code to run when it is unpickled; it is never loaded."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        value = getattr(torch, name, None) if module == "torch" else None
        if name in _ALLOWED.get(module, ()) or isinstance(value, torch.dtype):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{module}.{name}")


def check_metadata(checkpoint_dir: str | Path) -> None:
    """Unpickle ``.metadata`` with the allowlist; raise ``UnsafeCheckpointError`` when it names
    anything else (e.g. ``os.system``), before torch's reader unpickles it for real."""
    path = Path(checkpoint_dir) / METADATA_FILE
    try:
        with open(path, "rb") as fh:
            _MetadataUnpickler(fh).load()
    except UnsafeCheckpointError as exc:
        raise field_error(UnsafeCheckpointError, "checkpoint", str(path),
                          f"names {exc}, which is not checkpoint metadata: loading it would run "
                          "code", "load only checkpoints written by vime or Megatron; delete "
                          "this one") from None
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError,
            AttributeError) as exc:
        raise field_error(VimeError, "checkpoint", str(path),
                          f"has no readable torch_dist index ({type(exc).__name__}: {exc})",
                          "pass a directory written by save_checkpoint") from None


class SafeCommonLoad(TorchCommonLoadStrategy):
    """``common.pt`` with ``weights_only=True`` (tensors and plain containers only)."""

    def load_common(self, checkpoint_dir: str | Path):
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's message is a page of advice; its "WeightsUnpickler error: ..." line
            # names what the file asked for (e.g. "Unsupported global: GLOBAL io.open").
            detail = next((line.split("error:", 1)[1].split(" was ")[0].strip()
                           for line in str(exc).splitlines() if "Unpickler error:" in line),
                          "not weights-only data")
            raise field_error(UnsafeCheckpointError, "checkpoint", str(path),
                              f"is not plain tensors and containers ({detail}): loading it "
                              "would run code", "load only checkpoints written by vime or "
                              "Megatron; delete this one") from None
        except (OSError, EOFError, RuntimeError, ValueError) as exc:  # truncated or not a zip
            raise field_error(VimeError, "checkpoint", str(path),
                              f"is unreadable ({type(exc).__name__}: {str(exc)[:120]})",
                              "restore the checkpoint from a copy, or resume from an earlier "
                              "one") from None


def split_objects(sharded_state_dict: dict) -> tuple[dict, list[str]]:
    """``(request without ShardedObjects, their keys)``: torch's load planner reads a
    ``ShardedObject`` with ``torch.load(weights_only=False)``. Only ``_extra_state`` objects
    are expected (TransformerEngine FP8 scaling state, ``None`` on the local spec); any
    other raises, naming it."""
    objects, tensors = extract_matching_values(sharded_state_dict,
                                               lambda v: isinstance(v, ShardedObject))
    keys = [obj.key for obj in nested_values(objects)]
    other = sorted({k for k in keys if not k.endswith(EXTRA_STATE)})
    if other:
        raise field_error(VimeError, "sharded_state_dict", other,
                          "holds pickled objects, which vime does not load",
                          "use an optimizer sharding that stores tensors only "
                          "(distrib_optim_sharding_type='fully_reshardable')")
    return tensors, keys


class SyncTorchDistSave(TorchDistSaveShardedStrategy):
    """The ``torch_dist`` format, written in this process (module docstring)."""

    def __init__(self):
        super().__init__("torch_dist", 1)

    def save(self, sharded_state_dict: dict, checkpoint_dir: str | Path) -> None:
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                self.keep_only_main_replica)
        dcp.save(mcore_to_pyt_state_dict(flat, False),
                 storage_writer=dcp.FileSystemWriter(checkpoint_dir, thread_count=1,
                                                     sync_files=True),
                 planner=MCoreSavePlanner(dedup_replicated_tensors=False,
                                          flatten_state_dict=False,
                                          can_run_decentralized_global_plan=False))

