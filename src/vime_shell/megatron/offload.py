"""``--offload-train``: the trainer's weights, gradients and optimizer state leave the
accelerator while the colocated engines generate, and come back, bit-exact, before training.

How: every distinct storage behind the model chunks' parameters and ``main_grad`` views, the
DDP parameter / gradient buffers, the optimizer's parameter groups (fp32 main copies) and
state (Adam moments), and the frozen reference model is copied into a host buffer (pinned on
CUDA) and then resized to 0 bytes, which frees it in place: every view of it (a parameter is a
view into a DDP buffer) keeps its shape and comes back when the storage is resized and the
bytes copied back. Nothing is re-created, so the optimizer, DDP hooks and the bridge keep
pointing at the same tensors.

On CPU the host copy lives in the same memory, so nothing is saved; the round trip is still
real (storages really are emptied and refilled) and is tested to be exact. The GPU suite
measures the bytes ``torch.cuda.memory_allocated`` gives back.

Example: ``with offloaded(trainer, enabled=True): engines.generate(...)`` frees
``trainer.offload_report.bytes`` bytes during the block.
"""

import contextlib
from collections.abc import Iterable, Iterator

import attrs
import torch

from vime_shell.megatron.cuda_compat import native_torch


@attrs.frozen(kw_only=True)
class OffloadReport:
    storages: int
    bytes: int


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))


def trainer_tensors(model: list[torch.nn.Module], optimizer,
                    reference: list[torch.nn.Module] | None = None) -> Iterator[torch.Tensor]:
    """Every tensor whose storage ``--offload-train`` frees (module docstring)."""
    for chunk in [*model, *(reference or [])]:
        for param in chunk.parameters():
            yield param
            grad = getattr(param, "main_grad", None)
            if grad is not None:
                yield grad
        for buffer in [*getattr(chunk, "buffers", []),
                       *getattr(chunk, "expert_parallel_buffers", [])]:
            for name in ("param_data", "grad_data"):
                data = getattr(buffer, name, None)
                if data is not None:
                    yield data
    if optimizer is not None:
        yield from _optimizer_tensors(optimizer)


class StorageOffload:
    """Host copies of distinct storages, emptied on the device and refilled on reload."""

    def __init__(self) -> None:
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def active(self) -> bool:
        return bool(self._held)

    def offload(self, tensors: Iterable[torch.Tensor]) -> OffloadReport:
        """Copy each distinct non-empty storage to host and free it; returns what was freed."""
        if self._held:
            raise RuntimeError("offload() twice without reload(): the trainer is already off")
        seen: set[int] = set()
        pin = torch.cuda.is_available()
        with native_torch(), torch.no_grad():
            for tensor in tensors:
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() == 0 or key in seen:
                    continue
                seen.add(key)
                device = _bytes_of(storage)
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(device, non_blocking=pin)
                self._held.append((storage, host))
            if pin:
                torch.cuda.synchronize()
            for storage, _ in self._held:
                storage.resize_(0)
        return OffloadReport(storages=len(self._held),
                             bytes=sum(int(h.numel()) for _, h in self._held))

    def reload(self) -> None:
        """Refill every storage offloaded, byte for byte."""
        with native_torch(), torch.no_grad():
            for storage, host in self._held:
                storage.resize_(int(host.numel()))
                _bytes_of(storage).copy_(host, non_blocking=host.is_pinned())
            if self._held and torch.cuda.is_available():
                torch.cuda.synchronize()
        self._held = []


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


@contextlib.contextmanager
def offloaded(trainer, enabled: bool):
    """Inside the block the trainer's state is off the accelerator (no-op unless ``enabled``)."""
    if not enabled:
        yield
        return
    trainer.offload()
    try:
        yield
    finally:
        trainer.reload()
