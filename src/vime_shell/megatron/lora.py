"""LoRA adapters on Megatron's parallel linear layers, and the merged weights the engine and
``--save-hf`` get.

:class:`LoraLinear` wraps a targeted ``ColumnParallelLinear`` / ``RowParallelLinear`` of the
decoder layers (names: :mod:`vime_shell.megatron.lora_options`), keeps it frozen, and adds
``alpha/rank x B(A(x))``. Under TP a column-parallel layer's ``B`` is split by output rows and
its ``A`` replicated (the rank-``r`` activation's gradient is all-reduced, so ``A``'s gradient is
the full one on every rank); a row-parallel layer's ``A`` is split by input columns and its
partial products are all-reduced before a replicated ``B``. Each rank's ``B @ A`` is then
exactly its shard of the full update, so merging is local.

Why vime writes this layer: the kept libraries that have one do not run here. PEFT 0.21.2's
``LoraParallelLinear`` fails three ways on megatron-core 0.16 (measured: its dispatcher reads a
``fan_in_fan_out`` key it never sets, its reset reads a ``lora_bias`` entry its
``update_layer`` never sets, and its forward multiplies the ``(output, bias)`` tuple Megatron's
linear layers return); Megatron-Bridge needs Python 3.12 and TransformerEngine
(``shared/notes/stack-facts.md``). The adapter math and names are PEFT's (``lora_A``,
``lora_B``, ``scaling = alpha / r``, ``A`` Kaiming-uniform and ``B`` zero at the start).

What matters around it, each silently wrong when missing:

- **Only the adapters train**: the chunk is frozen before wrapping, so Megatron's DDP and
  optimizer hold the adapters alone (their gradients and Adam state are the training memory).
- **A layout-independent start**: ``A`` is drawn whole from a generator seeded by the run's
  seed, the layer's global number and the module, and each rank keeps its slice, so TP1, TP2
  and PP2 start from the same adapters and train to the same model.
- **Checkpoints keep the TP sharding** of the base and of the split adapter
  (:meth:`LoraLinear.sharded_state_dict`).
- **The engine and ``--save-hf`` see the merged model under the HF names** (:func:`merged`):
  each wrapper is swapped back for its base layer holding ``W + alpha/rank x B A`` while
  mbridge exports, then the original ``W`` tensor is put back (never ``W + d - d``, which drifts
  by rounding). This costs one transient copy of the adapted weights.
- **The local layer spec**: the wrapped layers are Megatron's own, not TransformerEngine's
  fused ones, so a LoRA run builds the local spec even where TE is installed
  (``Platform.local_spec``: no fusions, block-mask packing instead of THD, no sequence or
  context parallelism, which the adapters, taking the whole sequence, could not run).

Invariants (``tests/shell/test_lora.py``): the base weights never change; a fresh adapter
exports the base model bit for bit; the merged export reloads in transformers with the
trainer's logits; TP2 and PP2 train to the DP2 weights; a checkpoint resumes to the same
weights.

Example: ``attach_lora(chunks, LoraOptions(rank=8, target_modules=("all-linear",)), config,
seed=1234)`` before the DDP wrap, then ``with merged(model): bridge.export_weights(model)``.
"""

import math
import zlib
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (make_sharded_tensors_for_checkpoint,
                                             sharded_state_dict_default)

from vime_shell.megatron.lora_options import LoraOptions


class LoraLinear(MegatronModule):
    """A frozen Megatron parallel linear layer plus ``scaling x B(A(x))`` (module docstring)."""

    def __init__(self, base: torch.nn.Module, *, rank: int, scaling: float, config, seed: int,
                 key: str):
        super().__init__(config)
        if not isinstance(base, (tensor_parallel.ColumnParallelLinear,
                                 tensor_parallel.RowParallelLinear)):
            raise TypeError(f"LoRA wraps Megatron's parallel linear layers, not "
                            f"{type(base).__name__} (the local layer spec builds them)")
        self.base_layer, self.scaling = base, scaling
        self.column = isinstance(base, tensor_parallel.ColumnParallelLinear)
        tp = mpu.get_tensor_model_parallel_world_size()
        weight = base.weight
        out_size, in_size = weight.shape  # this rank's shard of the base weight
        full_in = in_size if self.column else in_size * tp
        a = _kaiming(rank, full_in, seed=seed, key=key)
        if not self.column:  # A is split by input columns, as the base weight is
            a = a[:, mpu.get_tensor_model_parallel_rank() * in_size:][:, :in_size]
        self.lora_A = torch.nn.Parameter(a.to(weight.device, weight.dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_size, rank, device=weight.device,
                                                     dtype=weight.dtype))
        # the factor split like the base weight, and the one every TP rank holds whole
        split, dim, whole = ((self.lora_B, 0, self.lora_A) if self.column
                             else (self.lora_A, 1, self.lora_B))
        tensor_parallel.set_tensor_model_parallel_attributes(split, True, dim, 1)
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(whole)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        output, bias = self.base_layer(x, *args, **kwargs)
        hidden = F.linear(x.to(self.lora_A.dtype), self.lora_A)
        if self.column:  # forward: as is; backward: the rank-r gradient summed over TP
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
        else:  # the partial products of this rank's input columns, summed
            hidden = tensor_parallel.reduce_from_tensor_model_parallel_region(hidden)
        update = F.linear(hidden, self.lora_B) * self.scaling
        return output + update.to(output.dtype), bias

    def delta(self) -> torch.Tensor:
        """This rank's shard of ``scaling x B A`` (the base weight's shape)."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """The base layer's own sharding, and the split adapter's TP axis."""
        out = sharded_state_dict_default(self.base_layer, f"{prefix}base_layer.",
                                         sharded_offsets, metadata)
        own = {"lora_A": self.lora_A, "lora_B": self.lora_B}
        axis = {"lora_B": 0} if self.column else {"lora_A": 1}
        out.update(make_sharded_tensors_for_checkpoint(own, prefix, axis, sharded_offsets))
        return out


def _kaiming(rank: int, fan_in: int, *, seed: int, key: str) -> torch.Tensor:
    """PEFT's start for ``A``: ``nn.Linear``'s Kaiming-uniform (a = sqrt 5) over the full
    fan-in, from a generator of (seed, layer, module)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand((rank, fan_in), generator=generator, dtype=torch.float64) * 2 - 1) \
        * bound


def attach_lora(chunks: list[torch.nn.Module], options: LoraOptions, tconfig, *,
                seed: int) -> int:
    """Freeze ``chunks`` (unwrapped ``GPTModel``s) and wrap their targeted layers; returns
    how many layers this rank adapted."""
    adapted = 0
    for chunk in chunks:
        chunk.requires_grad_(False)
        decoder = getattr(chunk, "decoder", None)
        for layer in decoder.layers if decoder is not None else ():
            for path, parent in list(layer.named_modules()):
                for name in options.megatron_modules:
                    base = getattr(parent, name, None)
                    if base is None or isinstance(parent, LoraLinear):
                        continue
                    setattr(parent, name, LoraLinear(
                        base, rank=options.rank, scaling=options.scaling, config=tconfig,
                        seed=seed, key=f"{layer.layer_number}:{path}.{name}"))
                    adapted += 1
    return adapted


def adapter_parameters(chunk: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for m in chunk.modules() if isinstance(m, LoraLinear)
            for p in (m.lora_A, m.lora_B)]


@contextmanager
def merged(model: list[torch.nn.Module], *, merge: bool = True):
    """Inside, each adapted layer is its base layer again (the names mbridge maps), holding
    ``W + alpha/rank x B A`` (``merge``) or ``W`` alone (to load base weights into). A model
    without adapters passes through."""
    wrappers = [(parent, name, child) for chunk in model for parent in chunk.modules()
                for name, child in parent.named_children() if isinstance(child, LoraLinear)]
    swapped = []
    with torch.no_grad():
        try:
            for parent, name, wrapper in wrappers:
                weight = wrapper.base_layer.weight
                original = weight.data
                if merge:
                    weight.data = original + wrapper.delta().to(original.dtype)
                setattr(parent, name, wrapper.base_layer)
                swapped.append((parent, name, wrapper, original))
            yield
        finally:
            for parent, name, wrapper, original in swapped:
                if merge:
                    wrapper.base_layer.weight.data = original
                setattr(parent, name, wrapper)
