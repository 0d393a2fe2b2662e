"""Properties of the per-GPU memory estimator (``vime_pure.memory``)."""

import attrs
from hypothesis import given
from hypothesis import strategies as st

from vime_pure.memory import GIB, MemoryPlan, ModelShape, estimate_memory


@st.composite
def shapes(draw) -> ModelShape:
    heads = draw(st.sampled_from([8, 16, 32]))
    experts = draw(st.sampled_from([0, 0, 8, 64]))
    layers = draw(st.integers(2, 64))
    return ModelShape(hidden=heads * 128, layers=layers, heads=heads,
                      kv_heads=draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0])),
                      head_dim=128, ffn=draw(st.integers(1, 8)) * 2048,
                      vocab=draw(st.sampled_from([32000, 151936])),
                      tied=draw(st.booleans()), num_experts=experts,
                      moe_layers=layers if experts else 0, moe_ffn=768 if experts else 0)


@st.composite
def plans(draw) -> MemoryPlan:
    granularity = draw(st.sampled_from([None, "selective", "full"]))
    full = granularity == "full"
    return MemoryPlan(
        gpu_bytes=80 * GIB, tokens_per_microbatch=draw(st.sampled_from([2048, 8192, 32768])),
        tp=draw(st.sampled_from([1, 2, 4])), pp=draw(st.sampled_from([1, 2, 4])),
        dp=draw(st.sampled_from([1, 2, 8])), ep=draw(st.sampled_from([1, 2, 8])),
        recompute_granularity=granularity,
        recompute_method=draw(st.sampled_from(["uniform", "block"])) if full else None,
        recompute_num_layers=draw(st.integers(1, 4)) if full else None,
        distributed_optimizer=draw(st.booleans()), offload_train=draw(st.booleans()),
        flash_attention=draw(st.booleans()))


@given(shapes(), plans())
def test_recompute_never_costs_activation_memory(shape, plan):
    """Recompute trades compute for memory: never more activation bytes than none."""
    estimate = estimate_memory(shape, plan)
    assert 0 < estimate.activations <= estimate.activations_no_recompute


@given(shapes(), plans())
def test_more_tensor_parallelism_never_needs_more_memory_per_gpu(shape, plan):
    """TP shards weights, gradients, optimizer state and (with SP) activations."""
    small = estimate_memory(shape, plan)
    large = estimate_memory(shape, attrs.evolve(plan, tp=plan.tp * 2))
    for field in ("weights", "grads", "optimizer", "activations"):
        assert getattr(large, field) <= getattr(small, field)


@given(shapes(), plans())
def test_sharding_and_offload_only_lower_the_peaks(shape, plan):
    """The distributed optimizer, optimizer CPU offload and trainer offload each only remove
    bytes from the GPU; with trainer offload generation holds the engine alone."""
    plain = attrs.evolve(plan, distributed_optimizer=False, offload_train=False)
    base = estimate_memory(shape, plain)
    for change in ({"distributed_optimizer": True}, {"optimizer_cpu_offload": True},
                   {"offload_train": True}):
        other = estimate_memory(shape, attrs.evolve(plain, **change))
        assert other.train_peak <= base.train_peak
        assert other.generate_peak <= base.generate_peak
    offloaded = estimate_memory(shape, attrs.evolve(plan, offload_train=True))
    assert offloaded.generate_peak == offloaded.engine
    assert estimate_memory(shape, attrs.evolve(plan, optimizer_cpu_offload=True)).optimizer == 0
