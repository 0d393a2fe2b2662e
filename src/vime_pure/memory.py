"""Per-GPU memory of a Megatron training rank and its colocated engine, before anything runs.

:func:`estimate_memory` takes the model's shape (:meth:`ModelShape.from_hf_config`) and the
run's layout and memory settings (:class:`MemoryPlan`) and returns a :class:`MemoryEstimate`:

- **weights** ``param_bytes`` per parameter held by the busiest pipeline stage: decoder layers
  split over TP (experts over ``ep * etp``), the embedding on the first stage, the LM head on
  the last (one copy when tied and ``pp == 1``);
- **gradients** ``grad_bytes`` per parameter (Megatron's fp32 grad buffer, vime's setting);
- **optimizer** Adam: two fp32 moments, plus an fp32 master copy when parameters are 16-bit;
  sharded over the data-parallel ranks (experts: the expert-data-parallel ranks) with the
  distributed optimizer; 0 on the GPU with ``optimizer_cpu_offload``. Under ``optimizer=
  "muon"`` the decoder's weights (experts included) keep one fp32 momentum instead of Adam's
  two (their norms and biases, a small share, are counted with them), the embedding and the
  LM head Adam's;
- **activations**, Megatron's formula (Korthikanti et al. 2022, as Megatron-LM documents it):
  per layer and micro-batch of ``s`` tokens (``s`` divided by CP), with sequence parallelism,
  ``34*s*h/tp`` bytes plus the attention scores ``5*heads*s**2/tp`` unless flash attention;
  selective recompute drops the scores; full recompute keeps each layer's input
  input of every chunk of ``recompute_num_layers`` layers (``2*s*h/tp``) and rebuilds one
  chunk at a time (uniform), or keeps the inputs of the first ``recompute_num_layers`` layers
  of a stage and rebuilds one layer at a time (block).
  1F1B keeps ``min(pp, micro-batches)`` micro-batches in flight on the first stage; the last
  stage adds the fp32 logits of one micro-batch and their gradient (``8*s*vocab/tp``);
- **engine**: the colocated vLLM's claim, ``engine_share * gpu_bytes``.

Phases of a colocated run: training holds weights + gradients + optimizer + activations (the
engine sleeps: weights to host, KV cache dropped); generation holds the engine plus the
trainer's weights, gradients and optimizer state unless ``offload_train`` moves them to host.

Example (``tests/test_memory_estimate.py``): Qwen2.5-7B's shape, TP 2, DP 4, 16384 tokens per
micro-batch, distributed optimizer, bf16, 80 GiB GPUs, engine share 0.5, full uniform recompute
of 1 layer: weights 7.1 GiB, gradients 14.2, optimizer 10.6, activations 11.7 (35.3 without
recompute, 10 GiB of which are the logits), so training peaks at 43.6 GiB and generation at
71.9 GiB (the engine's 40 plus the resident trainer); ``offload_train`` brings generation down
to 40.0.
"""

import math
from collections.abc import Mapping
from typing import Any

import attrs

from vime_pure.config import OPTIMIZERS
from vime_pure.errors import MemoryEstimateError, field_error
from vime_pure.scheduling.flops import ConfigFields, num_experts, sparse_layers

GIB = 1 << 30


@attrs.frozen(kw_only=True)
class ModelShape:
    """The sizes of a decoder that set its memory (``num_experts=0``: dense)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    num_experts: int = 0
    moe_layers: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any) -> "ModelShape":
        """Read an HF ``config.json`` mapping or config object (``text_config`` looked into)."""
        cfg = ConfigFields(config)
        if cfg.get("text_config") is not None:
            cfg = ConfigFields(cfg.get("text_config"))
        hidden, heads = cfg.int("hidden_size"), cfg.int("num_attention_heads")
        layers = cfg.int("num_hidden_layers")
        experts = num_experts(cfg)
        moe_layers = len(sparse_layers(cfg, layers))
        # Mixtral's experts are intermediate_size wide; an all-MoE model may state no dense width
        moe_ffn = cfg.int("moe_intermediate_size" if cfg.get("moe_intermediate_size") is not None
                          else "intermediate_size") if experts else 0
        ffn = cfg.int("intermediate_size") if moe_layers < layers else \
            int(cfg.get("intermediate_size", 0) or 0)
        shared = int(cfg.get("shared_expert_intermediate_size", 0) or 0)
        shared += int(cfg.get("n_shared_experts", 0) or 0) * moe_ffn
        return cls(hidden=hidden, layers=layers, heads=heads,
                   kv_heads=cfg.int("num_key_value_heads", heads),
                   head_dim=cfg.int("head_dim", hidden // heads),
                   ffn=ffn, vocab=cfg.int("vocab_size"),
                   tied=bool(cfg.get("tie_word_embeddings", False)), num_experts=experts,
                   moe_layers=moe_layers, moe_ffn=moe_ffn,
                   shared_ffn=shared)


@attrs.frozen(kw_only=True)
class MemoryPlan:
    """Layout and memory settings of a run (flag names in parentheses)."""

    gpu_bytes: int
    tokens_per_microbatch: int  # --max-tokens-per-gpu
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int | None = None  # default tp
    microbatches: int | None = None  # per step and rank; None: at least pp
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    distributed_optimizer: bool = False
    optimizer_cpu_offload: bool = False
    offload_train: bool = False
    colocate: bool = True
    engine_share: float = 0.5  # --rollout-gpu-memory-utilization
    optimizer: str = "adam"  # --optimizer: "muon" keeps one moment for the decoder's weights
    param_bytes: int = 2  # bf16
    grad_bytes: int = 4  # fp32 grad buffer
    flash_attention: bool = True  # TransformerEngine attention: no stored scores


@attrs.frozen(kw_only=True)
class MemoryEstimate:
    """Bytes per GPU (the busiest pipeline stage); ``fits`` compares both phases' peaks."""

    weights: int
    grads: int
    optimizer: int
    activations: int  # with the plan's recompute
    activations_no_recompute: int
    engine: int
    train_peak: int
    generate_peak: int
    gpu_bytes: int

    @property
    def fits(self) -> bool:
        return max(self.train_peak, self.generate_peak) <= self.gpu_bytes

    def as_gib(self) -> dict[str, float]:
        """Every field in GiB, rounded to 0.1 (what ``vime train --dry-run`` prints)."""
        return {f.name: round(getattr(self, f.name) / GIB, 1) for f in attrs.fields(type(self))}


def _parameters(shape: ModelShape, plan: MemoryPlan, etp: int) -> tuple[float, float, int]:
    """(TP-sharded parameters, expert parameters, layers) on the busiest stage."""
    h = shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = h * (q + 2 * kv) + q * h + 2 * h
    stage = math.ceil(shape.layers / plan.pp)
    moe = min(stage, shape.moe_layers)
    dense_layer = attention + 3 * h * shape.ffn
    moe_layer = attention + 3 * h * shape.shared_ffn + h * shape.num_experts
    # the embedding and LM head: the stage holding both, or one of them
    sharded = ((stage - moe) * dense_layer + moe * moe_layer) / plan.tp \
        + _embedding_parameters(shape, plan)
    experts = moe * shape.num_experts * 3 * h * shape.moe_ffn / (plan.ep * etp)
    return sharded, experts, stage


def _embedding_parameters(shape: ModelShape, plan: MemoryPlan) -> float:
    """The embedding and LM-head parameters of the busiest stage (part of ``_parameters``'
    TP-sharded count)."""
    embeddings = 1 if plan.pp > 1 or shape.tied else 2
    return embeddings * shape.vocab * shape.hidden / plan.tp


def _activations(shape: ModelShape, plan: MemoryPlan, layers: int,
                 granularity: str | None) -> float:
    s, h = plan.tokens_per_microbatch / plan.cp, shape.hidden
    kept = 34 * s * h / plan.tp
    full = kept + (0 if plan.flash_attention else 5 * shape.heads * s * s / plan.tp)
    layer_input = 2 * s * h / plan.tp
    in_flight = min(plan.pp, plan.microbatches or plan.pp)
    logits = 8 * s * shape.vocab / plan.tp
    n = plan.recompute_num_layers or layers
    if granularity is None:
        stored = layers * in_flight * full
    elif granularity == "selective":
        stored = layers * in_flight * kept
    elif plan.recompute_method == "block":  # the first n layers keep only their inputs
        n = min(n, layers)
        stored = (layers - n) * in_flight * full + n * in_flight * layer_input + full \
            - layer_input  # the layer being rebuilt (its input is part of its full set)
    else:  # uniform: each n-layer chunk keeps its input; one chunk is rebuilt at a time
        n = min(n, layers)
        stored = math.ceil(layers / n) * in_flight * layer_input + n * full - layer_input
    return stored + logits


def estimate_memory(shape: ModelShape, plan: MemoryPlan) -> MemoryEstimate:
    """Per-GPU bytes of ``shape`` trained under ``plan`` (module docstring for the model)."""
    for name in ("tp", "pp", "cp", "dp", "ep", "gpu_bytes", "tokens_per_microbatch"):
        value = getattr(plan, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise field_error(MemoryEstimateError, name, value, "must be a positive integer",
                              "pass the run's sizes")
    etp = plan.etp or plan.tp
    if shape.num_experts and shape.num_experts % plan.ep:
        raise field_error(MemoryEstimateError, "ep", plan.ep,
                          f"does not divide the {shape.num_experts} experts",
                          "use an --expert-model-parallel-size that divides them")
    if not 0.0 < plan.engine_share <= 1.0:
        raise field_error(MemoryEstimateError, "engine_share", plan.engine_share,
                          "must be in (0, 1]", "use e.g. 0.5")
    if plan.optimizer not in OPTIMIZERS:
        raise field_error(MemoryEstimateError, "optimizer", plan.optimizer,
                          f"is not one of {OPTIMIZERS}", "pass the run's --optimizer")
    sharded, experts, layers = _parameters(shape, plan, etp)
    weights = (sharded + experts) * plan.param_bytes
    grads = (sharded + experts) * plan.grad_bytes
    master = 4 if plan.param_bytes < 4 else 0  # an fp32 master copy of bf16 parameters
    adam, decoder = 8 + master, (4 if plan.optimizer == "muon" else 8) + master
    embedding = _embedding_parameters(shape, plan)
    world = plan.dp * plan.tp * plan.pp * plan.cp
    dense_shards = plan.dp * plan.cp if plan.distributed_optimizer else 1
    expert_shards = world // (plan.pp * plan.ep * etp) if plan.distributed_optimizer else 1
    optimizer = 0.0 if plan.optimizer_cpu_offload else (
        (adam * embedding + decoder * (sharded - embedding)) / dense_shards
        + decoder * experts / max(expert_shards, 1))
    activations = _activations(shape, plan, layers, plan.recompute_granularity)
    engine = plan.engine_share * plan.gpu_bytes if plan.colocate else 0.0
    static = weights + grads + optimizer
    return MemoryEstimate(
        weights=int(weights), grads=int(grads), optimizer=int(optimizer),
        activations=int(activations),
        activations_no_recompute=int(_activations(shape, plan, layers, None)),
        engine=int(engine), train_peak=int(static + activations),
        generate_peak=int(engine + (0 if plan.offload_train else static)),
        gpu_bytes=plan.gpu_bytes)
