"""``--optimizer muon``: Muon on the hidden 2-D weights, Megatron's Adam(W) on the rest.

Why vime builds it: megatron-core 0.16.1's ``get_megatron_muon_optimizer`` needs NVIDIA's
``emerging_optimizers`` (Python >= 3.12), which does not install next to vime's Python 3.11.
:func:`build_muon_optimizer` follows that function's structure with vime's :class:`Muon`:

- Muon takes every trainable 2-D parameter that is not the embedding or the output layer
  (Megatron's ``is_embedding_or_output_parameter``); the embedding, the output layer, norms,
  biases and every other parameter go to Megatron's own Adam(W) (``get_megatron_optimizer``
  with the Muon parameters frozen while it is built);
- both sit in one ``ChainedOptimizer``: one gradient norm, one clip, one LR schedule (Muon's
  param groups are Megatron's, with ``wd_mult`` / ``lr_mult``); MoE expert weights get their
  own Muon, as in Megatron;
- Muon's update per parameter (emerging_optimizers' ``OrthogonalizedOptimizer`` with
  decoupled weight decay): ``W -= lr * wd * W``; ``M = momentum * M + (1 - momentum) * G``;
  ``U = G + momentum * (M - G)`` under Nesterov, else ``M``; ``W -= lr * O(U)``, where ``O``
  is :func:`vime_pure.torch_ops.muon.newton_schulz` times ``muon_scale`` of the matrix's
  shape times ``extra_scale_factor``;
- ``split_qkv``: the fused ``linear_qkv`` weight ``[groups x (q + k + v), hidden]`` is cut into
  its Q, K and V rows (all head groups of each), and each is orthogonalised on its own;
- tensor parallelism (``tp_mode``): ``duplicated`` all-gathers a TP-split matrix (or each QKV
  part) along its partition dimension, orthogonalises the whole matrix on every TP rank and
  keeps the rank's rows or columns: the update equals TP1's. ``blockwise`` orthogonalises each
  rank's shard alone, scaled by the shard's shape: the update depends on the TP size, as
  Megatron defines it. Megatron's third mode, ``distributed`` (the iteration's Gram matrices
  all-reduced), computes duplicated's update and is not built.

The optimizer state is one ``momentum_buffer`` per Muon parameter (Adam's moments for the
rest): ``vime_shell.megatron.checkpoint`` saves and reshards it like Adam's.

Measured (``tests/shell/test_muon.py``, the tiny GQA Qwen2): one step equals an independent
float64 computation of this rule to 4.5e-6 of the update's norm with ``fp32_matmul_prec=
"high"``, and to 0.084 with ``"medium"`` (bf16 iterations: rounding grows along the
gradient's small singular directions); the Adam parameters equal plain AdamW; TP2 duplicated
ends four steps 1.8e-6 from TP1 (at an Adam weight); a save / load resume is bit-identical.

Example: ``build_muon_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4), model,
MuonSettings(momentum=0.9))`` returns a ``ChainedOptimizer`` of Muon then Adam.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.optimizer import (OptimizerConfig, _get_param_groups,
                                     get_megatron_optimizer)
from megatron.core.optimizer.optimizer import (ChainedOptimizer, FP32Optimizer,
                                               Float16OptimizerWithFloat16Params)

from vime_pure.errors import VimeError, field_error
from vime_pure.torch_ops.muon import muon_scale, newton_schulz
from vime_shell.megatron.config import MuonSettings



class MuonError(VimeError):
    """A model Muon cannot split as asked (the fused QKV layout); the message says the fix."""


@attrs.frozen
class _Layout:
    """How one Muon parameter is orthogonalised: its QKV parts' rows per head group (None:
    whole), its TP partition dimension (None: not TP-split, or ``blockwise``) and TP group."""

    qkv: tuple[int, int, int] | None
    partition_dim: int | None
    group: Any


LAYOUT_ATTR = "vime_muon_layout"


class Muon(torch.optim.Optimizer):
    """The Muon update over tagged parameters (module docstring); each parameter carries its
    ``_Layout`` as ``LAYOUT_ATTR``. Param groups hold ``lr`` and ``weight_decay`` (Megatron's
    scheduler sets both every step)."""

    def __init__(self, param_groups: list[dict], settings: MuonSettings, lr: float,
                 weight_decay: float):
        super().__init__(param_groups, {"lr": lr, "weight_decay": weight_decay})
        self.settings = settings

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One Muon update of every parameter with a gradient."""
        s = self.settings
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                if group["weight_decay"]:
                    p.mul_(1.0 - group["lr"] * group["weight_decay"])  # decoupled
                buf.lerp_(grad, 1.0 - s.momentum)
                update = grad.lerp(buf, s.momentum) if s.nesterov else buf
                p.add_(self._orthogonalize(getattr(p, LAYOUT_ATTR), update),
                       alpha=-group["lr"])
        return None

    def _orthogonalize(self, layout: _Layout, update: torch.Tensor) -> torch.Tensor:
        if layout.qkv is None:
            return self._scaled(update, layout)
        rows, hidden = update.shape
        groups = rows // sum(layout.qkv)
        parts = update.view(groups, sum(layout.qkv), hidden).split(layout.qkv, dim=1)
        done = [self._scaled(part.reshape(-1, hidden), layout).view(groups, -1, hidden)
                for part in parts]
        return torch.cat(done, dim=1).view(rows, hidden)

    def _scaled(self, x: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """``x`` orthogonalised (whole, under ``duplicated``) and scaled by its full shape."""
        s = self.settings
        dim = layout.partition_dim
        size = 1 if dim is None else dist.get_world_size(layout.group)
        full = x
        if dim is not None and size > 1:
            shards = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(shards, x.contiguous(), group=layout.group)
            full = torch.cat(shards, dim=dim)
        out = newton_schulz(full, s.num_ns_steps, bf16=s.fp32_matmul_prec == "medium")
        if dim is not None and size > 1:
            out = out.chunk(size, dim=dim)[dist.get_rank(layout.group)]
        return out * (muon_scale(full.shape[0], full.shape[1], s.scale_mode)
                      * s.extra_scale_factor)


def _init_momentum(opt: torch.optim.Optimizer, config=None) -> None:
    """Zero momentum buffers (what a checkpoint load is requested into)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not opt.state[p]:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p)


def _qkv_split(chunk, settings: MuonSettings) -> tuple[int, int, int] | None:
    """The Q, K and V rows of one head group of ``chunk``'s ``linear_qkv``, or None."""
    if not settings.split_qkv:
        return None
    config = chunk.config
    groups = config.num_query_groups or config.num_attention_heads
    return (config.num_attention_heads // groups * config.kv_channels, config.kv_channels,
            config.kv_channels)


def _check_qkv(name: str, param: torch.Tensor, chunk, split: tuple[int, int, int]) -> None:
    """The local QKV weight must be whole head groups of ``split`` (not so under an attention
    output gate, or with more TP ranks than KV heads)."""
    config = chunk.config
    groups = config.num_query_groups or config.num_attention_heads
    tp = config.tensor_model_parallel_size
    if groups % tp or param.shape[0] != groups // tp * sum(split):
        raise field_error(MuonError, "muon_split_qkv", True,
                          f"cannot cut {name} ({tuple(param.shape)}) into {groups // max(tp, 1)} "
                          f"head groups of {split} Q/K/V rows at TP {tp}",
                          "pass --muon-no-split-qkv (the fused weight orthogonalised whole), "
                          "or a TP size that divides the KV heads")


def _tag(model_chunks, settings: MuonSettings) -> tuple[list, list]:
    """Tag the Muon parameters with their ``_Layout``; returns ``(muon, other)``."""
    muon, other = [], []
    for chunk in model_chunks:
        split = _qkv_split(chunk, settings)
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if param.ndim != 2 or getattr(param, "is_embedding_or_output_parameter", False):
                other.append(param)
                continue
            expert = "experts" in name and "shared" not in name
            qkv = split if "linear_qkv.weight" in name else None
            if qkv is not None:
                _check_qkv(name, param, chunk, qkv)
            dim = getattr(param, "partition_dim", -1)
            duplicated = settings.tp_mode == "duplicated" and \
                getattr(param, "tensor_model_parallel", False) and dim in (0, 1)
            group = (mpu.get_expert_tensor_parallel_group() if expert
                     else mpu.get_tensor_model_parallel_group())
            setattr(param, LAYOUT_ATTR, _Layout(qkv, dim if duplicated else None, group))
            muon.append(param)
    return muon, other


@contextlib.contextmanager
def _frozen(params: list) -> Iterator[None]:
    """``params`` without ``requires_grad`` for the block (Megatron's param-group builders
    skip frozen parameters)."""
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _wrapped(muon: Muon, config: OptimizerConfig, stats_group) -> Any:
    """Megatron's fp32 (or bf16 main-param) wrapper around ``muon``, as Adam gets it."""
    if config.bf16:
        opt: Any = Float16OptimizerWithFloat16Params(muon, config, None, _init_momentum)
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                setattr(main_param, LAYOUT_ATTR, getattr(model_param, LAYOUT_ATTR))
    else:
        opt = FP32Optimizer(muon, config, _init_momentum)
    opt.grad_stats_parallel_group = stats_group
    opt.tp_group = mpu.get_tensor_model_parallel_group()
    return opt


def build_muon_optimizer(config: OptimizerConfig, model_chunks: list,
                         settings: MuonSettings) -> ChainedOptimizer:
    """Muon (dense, then experts when there are any) chained before Megatron's Adam(W) for
    the other parameters (module docstring). ``config.optimizer`` must be ``"adam"``."""
    muon_params, other = _tag(model_chunks, settings)
    with _frozen(other):
        groups = _get_param_groups(model_chunks, config, None)
    optimizers = []
    for expert, stats_group in ((False, mpu.get_model_parallel_group()),
                                (True, mpu.get_expert_tensor_model_pipeline_parallel_group())):
        mine = [g for g in groups if g["is_expert_parallel"] == expert]
        if mine:
            optimizers.append(_wrapped(Muon(mine, settings, config.lr, config.weight_decay),
                                       config, stats_group))
    with _frozen(muon_params):
        adam = get_megatron_optimizer(config, model_chunks)
    return ChainedOptimizer(optimizers + list(adam.chained_optimizers))
