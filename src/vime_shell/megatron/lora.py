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

- **MoE experts** (Megatron's ``SequentialMLP``, what the local spec builds): each routed
  expert's ``linear_fc1`` / ``linear_fc2`` is wrapped like a dense layer, seeded by its global
  expert number (so EP1 and EP2 start alike), and its own factors carry the base weight's
  ``allreduce`` mark (False under EP: Megatron's DDP reduces them over the expert-data-parallel
  ranks, as the expert weights). Under ``--experts-shared-outer-loras`` the hidden-side factors
  (``linear_fc1``'s ``A``, ``linear_fc2``'s ``B``) live once per layer in a
  :class:`SharedExpertFactors` on the MoE layer, replicated on every rank like a dense weight:
  under EP each rank's gradient of them covers the tokens its own experts saw, and DDP's sum over
  the data-parallel ranks (which contain the EP ranks at TP 1) is the whole gradient, so no
  extra collective is needed. Adapters on experts need TP 1: Megatron's experts leave their
  TP reductions to the token dispatcher, which a replicated ``A`` would double
  (``vime_shell.run.model_checks`` refuses the layout at launch).

Invariants (``tests/shell/test_lora.py``, ``tests/shell/test_lora_experts.py``): the base weights never change; a fresh adapter
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
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.utils import (make_sharded_tensors_for_checkpoint,
                                             sharded_state_dict_default)

from vime_shell.megatron.lora_options import LoraOptions, LoraOptionsError


class LoraLinear(MegatronModule):
    """A frozen Megatron parallel linear layer plus ``scaling x B(A(x))`` (module docstring).

    ``shared`` names factors owned elsewhere (``{"lora_A": parameter}``: a routed expert's
    shared-outer factor, :class:`SharedExpertFactors`); the others are this layer's own."""

    def __init__(self, base: torch.nn.Module, *, rank: int, scaling: float, config, seed: int,
                 key: str, shared: dict[str, torch.nn.Parameter] | None = None):
        super().__init__(config)
        if not isinstance(base, (tensor_parallel.ColumnParallelLinear,
                                 tensor_parallel.RowParallelLinear)):
            raise TypeError(f"LoRA wraps Megatron's parallel linear layers, not "
                            f"{type(base).__name__} (the local layer spec builds them)")
        self.base_layer, self.scaling = base, scaling
        self.column = isinstance(base, tensor_parallel.ColumnParallelLinear)
        # a plain dict: a shared factor is registered once, on its owner, never here
        self._shared: dict[str, torch.nn.Parameter] = dict(shared or {})
        tp = mpu.get_tensor_model_parallel_world_size()
        weight = base.weight
        out_size, in_size = weight.shape  # this rank's shard of the base weight
        full_in = in_size if self.column else in_size * tp
        # Megatron's mark on an expert weight under EP (False: reduced over the expert-data-
        # parallel ranks); a layer's own factors are reduced where its weight would be
        allreduce = getattr(weight, "allreduce", True)
        if "lora_A" not in self._shared:
            a = _kaiming(rank, full_in, seed=seed, key=key)
            if not self.column:  # A is split by input columns, as the base weight is
                a = a[:, mpu.get_tensor_model_parallel_rank() * in_size:][:, :in_size]
            self.lora_A = _factor(a.to(weight.device, weight.dtype), allreduce)
        if "lora_B" not in self._shared:
            self.lora_B = _factor(torch.zeros(out_size, rank, device=weight.device,
                                              dtype=weight.dtype), allreduce)
        # the factor split like the base weight, and the one every TP rank holds whole
        split, dim, whole = (("lora_B", 0, "lora_A") if self.column
                             else ("lora_A", 1, "lora_B"))
        if split in self._parameters:
            tensor_parallel.set_tensor_model_parallel_attributes(self._parameters[split], True,
                                                                 dim, 1)
        if whole in self._parameters:
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(
                self._parameters[whole])

    @property
    def factor_a(self) -> torch.nn.Parameter:
        """``A`` (rank x input), this layer's own or the shared one."""
        return self._shared.get("lora_A", self._parameters.get("lora_A"))

    @property
    def factor_b(self) -> torch.nn.Parameter:
        """``B`` (output x rank), this layer's own or the shared one."""
        return self._shared.get("lora_B", self._parameters.get("lora_B"))

    def forward(self, x: torch.Tensor, *args, **kwargs):
        output, bias = self.base_layer(x, *args, **kwargs)
        a, b = self.factor_a, self.factor_b
        hidden = F.linear(x.to(a.dtype), a)
        if self.column:  # forward: as is; backward: the rank-r gradient summed over TP
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
        else:  # the partial products of this rank's input columns, summed
            hidden = tensor_parallel.reduce_from_tensor_model_parallel_region(hidden)
        update = F.linear(hidden, b) * self.scaling
        return output + update.to(output.dtype), bias

    def delta(self) -> torch.Tensor:
        """This rank's shard of ``scaling x B A`` (the base weight's shape)."""
        return (self.factor_b.float() @ self.factor_a.float()) * self.scaling

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """The base layer's own sharding, and the split adapter's TP axis (a shared factor is
        its owner's)."""
        out = sharded_state_dict_default(self.base_layer, f"{prefix}base_layer.",
                                         sharded_offsets, metadata)
        own = dict(self._parameters)
        axis = {k: v for k, v in ({"lora_B": 0} if self.column else {"lora_A": 1}).items()
                if k in own}
        out.update(make_sharded_tensors_for_checkpoint(own, prefix, axis, sharded_offsets))
        return out


def _kaiming(rank: int, fan_in: int, *, seed: int, key: str) -> torch.Tensor:
    """PEFT's start for ``A``: ``nn.Linear``'s Kaiming-uniform (a = sqrt 5) over the full
    fan-in, from a generator of (seed, layer, module)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand((rank, fan_in), generator=generator, dtype=torch.float64) * 2 - 1) \
        * bound


def _factor(tensor: torch.Tensor, allreduce: bool) -> torch.nn.Parameter:
    param = torch.nn.Parameter(tensor)
    if not allreduce:
        setattr(param, "allreduce", False)  # an expert's own factor under EP (DDP reads it)
    return param


class SharedExpertFactors(MegatronModule):
    """One MoE layer's shared-outer factors (``--experts-shared-outer-loras``):
    ``linear_fc1_lora_A`` (rank x hidden) and ``linear_fc2_lora_B`` (hidden x rank), whichever
    layers are adapted; every routed expert's :class:`LoraLinear` uses them. Replicated on
    every rank, as a dense weight (module docstring)."""

    def __init__(self, config, *, rank: int, hidden: int, modules: tuple[str, ...],
                 like: torch.Tensor, seed: int, key: str):
        super().__init__(config)
        if "linear_fc1" in modules:
            a = _kaiming(rank, hidden, seed=seed, key=f"{key}.linear_fc1")
            self.linear_fc1_lora_A = torch.nn.Parameter(a.to(like.device, like.dtype))
        if "linear_fc2" in modules:
            self.linear_fc2_lora_B = torch.nn.Parameter(
                torch.zeros(hidden, rank, device=like.device, dtype=like.dtype))
        for param in self.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)

    def shared(self, module: str) -> dict[str, torch.nn.Parameter]:
        """The factor ``module``'s experts take from here (``LoraLinear(shared=...)``)."""
        return ({"lora_A": self.linear_fc1_lora_A} if module == "linear_fc1"
                else {"lora_B": self.linear_fc2_lora_B})

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Replicated tensors (no TP axis)."""
        return make_sharded_tensors_for_checkpoint(dict(self._parameters), prefix, {},
                                                   sharded_offsets)


def _adapt_experts(layer: torch.nn.Module, options: LoraOptions, tconfig, *, seed: int) -> int:
    """Wrap the routed experts' targeted layers of ``layer``'s MoE module(s); returns how many
    layers were adapted."""
    adapted = 0
    for path, moe in list(layer.named_modules()):
        experts = getattr(moe, "experts", None)
        if experts is None or not options.expert_modules:
            continue
        if not isinstance(experts, SequentialMLP):
            raise LoraOptionsError(
                f"LoRA on MoE experts wraps Megatron's SequentialMLP (the local spec's "
                f"experts), not {type(experts).__name__}. Fix: drop --moe-grouped-gemm.")
        if mpu.get_expert_tensor_parallel_world_size() > 1:
            raise LoraOptionsError(
                f"--target-modules={','.join(options.target_modules)}: adapts MoE experts, "
                "which need expert tensor parallelism 1 (the experts' TP reductions are the "
                "token dispatcher's). Fix: use --tensor-model-parallel-size 1 (with EP), or "
                "target attention layers only.")
        key = f"{layer.layer_number}:{path}.experts"
        holder = None
        if options.experts_shared_outer:
            fc1 = experts.local_experts[0].linear_fc1.weight
            holder = SharedExpertFactors(tconfig, rank=options.rank, hidden=fc1.shape[1],
                                         modules=options.expert_modules, like=fc1, seed=seed,
                                         key=f"{key}.shared")
            moe.lora_shared_experts = holder
        first = mpu.get_expert_model_parallel_rank() * experts.num_local_experts
        for local, expert in enumerate(experts.local_experts):
            for name in options.expert_modules:
                setattr(expert, name, LoraLinear(
                    getattr(expert, name), rank=options.rank, scaling=options.scaling,
                    config=tconfig, seed=seed, key=f"{key}.{first + local}.{name}",
                    shared=holder.shared(name) if holder is not None else None))
                adapted += 1
    return adapted


def attach_lora(chunks: list[torch.nn.Module], options: LoraOptions, tconfig, *,
                seed: int) -> int:
    """Freeze ``chunks`` (unwrapped ``GPTModel``s) and wrap their targeted layers; returns
    how many layers this rank adapted."""
    adapted = 0
    for chunk in chunks:
        chunk.requires_grad_(False)
        decoder = getattr(chunk, "decoder", None)
        for layer in decoder.layers if decoder is not None else ():
            adapted += _adapt_experts(layer, options, tconfig, seed=seed)
            for path, parent in list(layer.named_modules()):
                for name in options.megatron_modules:
                    base = getattr(parent, name, None)
                    if base is None or isinstance(parent, LoraLinear) \
                            or isinstance(base, LoraLinear):  # an expert's, wrapped above
                        continue
                    setattr(parent, name, LoraLinear(
                        base, rank=options.rank, scaling=options.scaling, config=tconfig,
                        seed=seed, key=f"{layer.layer_number}:{path}.{name}"))
                    adapted += 1
    return adapted


def adapter_parameters(chunk: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Every adapter factor of ``chunk``, each once (a shared factor on its owner)."""
    return [p for m in chunk.modules() if isinstance(m, (LoraLinear, SharedExpertFactors))
            for p in m.parameters(recurse=False)]


@contextmanager
def merged(model: list[torch.nn.Module], *, merge: bool = True):
    """Inside, each adapted layer is its base layer again (the names mbridge maps), holding
    ``W + alpha/rank x B A`` (``merge``) or ``W`` alone (to load base weights into). A model
    without adapters passes through."""
    wrappers = [(parent, name, child) for chunk in model for parent in chunk.modules()
                for name, child in parent.named_children() if isinstance(child, LoraLinear)]
    owners = [(parent, name, child) for chunk in model for parent in chunk.modules()
              for name, child in parent.named_children()
              if isinstance(child, SharedExpertFactors)]
    swapped, hidden = [], []
    with torch.no_grad():
        try:
            for parent, name, owner in owners:  # out of sight of mbridge's names
                parent._modules[name] = None
                hidden.append((parent, name, owner))
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
            for parent, name, owner in hidden:
                parent._modules[name] = owner
