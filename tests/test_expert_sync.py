"""MoE weight sync: each engine rank is sent only the experts it serves, and a bucket is cut only
between decoder layers, never inside an MoE layer (vLLM's FusedMoE module holds all of a layer's
experts, and its in-place reload rebuilds a module from one call), whatever order the export
gives a layer's experts in."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_shell.engines.base import EngineError
from vime_shell.engines.group import EngineGroup, EngineOptions
from vime_shell.engines.layout import resolve_engine_layout
from vime_shell.engines.sync import (buckets, expert_of, layer_key, only_served_experts,
                                     served_experts)


def _moe_layer(layer: int, num_experts: int, expert_bytes: int = 3) -> list:
    """The HF names of one Qwen2-MoE layer in mbridge's export order, each 1 byte per
    element (an expert's three projections share ``expert_bytes``)."""
    pre = f"model.layers.{layer}"
    names = [f"{pre}.input_layernorm.weight", f"{pre}.self_attn.q_proj.weight",
             f"{pre}.post_attention_layernorm.weight", f"{pre}.mlp.gate.weight"]
    out = [(n, np.zeros(1, np.uint8)) for n in names]
    for e in range(num_experts):
        out += [(f"{pre}.mlp.experts.{e}.{p}_proj.weight", np.zeros(expert_bytes, np.uint8))
                for p in ("gate", "up", "down")]
    out += [(f"{pre}.mlp.shared_expert_gate.weight", np.zeros(1, np.uint8)),
            (f"{pre}.mlp.shared_expert.up_proj.weight", np.zeros(1, np.uint8))]
    return out


def test_expert_names():
    assert expert_of("model.layers.0.block_sparse_moe.experts.12.w1.weight") == 12
    assert expert_of("model.layers.3.mlp.experts.7.up_proj.weight") == 7
    assert expert_of("model.layers.0.mlp.shared_expert.up_proj.weight") is None
    assert layer_key("model.layers.3.mlp.experts.7.up_proj.weight") == "model.layers.3"


@given(st.integers(1, 64), st.integers(1, 16))
def test_served_experts_partition_the_experts(num_experts, ep_size):
    """Every expert is served by exactly one rank of the engine, in rank order, and loads
    differ by at most one expert (vLLM's linear placement)."""
    ranges = [served_experts(num_experts, ep_size, r) for r in range(ep_size)]
    assert [e for r in ranges for e in r] == list(range(num_experts))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@given(st.integers(1, 6), st.integers(9, 40), st.booleans())
def test_an_moe_layer_is_never_cut(num_experts, cap, by_projection):
    """A bucket boundary never falls inside a decoder layer (its experts included), in
    per-expert order or in the per-projection order mbridge exports under EP (every expert's
    gate/up, then every expert's down), and the buckets concatenate back to the export."""
    named = _moe_layer(0, num_experts) + _moe_layer(1, num_experts)
    if by_projection:
        named.sort(key=lambda item: (layer_key(item[0]), "down_proj" in item[0]))
    out = list(buckets(named, cap))
    assert [n for b in out for n, _ in b] == [n for n, _ in named]
    for left, right in zip(out, out[1:]):
        assert layer_key(left[-1][0]) != layer_key(right[0][0])
    assert len(out) == (1 if 2 * (6 + 9 * num_experts) <= cap else 2)


class _Recorder:
    def __init__(self):
        self.names: list[str] = []

    def update_weights_from_tensors(self, bucket):
        self.names += [n for n, _ in bucket]


def test_each_engine_rank_is_sent_only_its_experts():
    layout = resolve_engine_layout(world_size=2, rollout_num_gpus_per_engine=2, engine="vllm")
    named = _moe_layer(0, 4)
    sent = {}
    for rank in (0, 1):
        engine = _Recorder()
        options = EngineOptions(engine="vllm", expert_parallel=True, num_experts=4)
        group = EngineGroup(layout, rank, engine, options)
        report = group.sync_weights(iter(named))
        sent[rank] = engine.names
        assert report.tensors == len(engine.names)
    experts = {r: sorted({expert_of(n) for n in names} - {None}) for r, names in sent.items()}
    assert experts == {0: [0, 1], 1: [2, 3]}
    shared = [n for n, _ in named if expert_of(n) is None]
    assert all(set(shared) <= set(names) for names in sent.values())  # the rest goes to all
    everything = EngineGroup(layout, 1, _Recorder(), EngineOptions(engine="vllm", num_experts=4))
    assert everything.served_experts() is None  # without expert parallelism: every expert
    assert list(only_served_experts(iter(named), range(0, 4))) == named


def test_round_robin_placement_follows_vllms_expert_placement_strategy():
    assert list(served_experts(10, 4, 1, "round_robin")) == [1, 5, 9]
    layout = resolve_engine_layout(world_size=2, rollout_num_gpus_per_engine=2, engine="vllm")
    options = EngineOptions(engine="vllm", expert_parallel=True, num_experts=4,
                            vllm_args=(("expert_placement_strategy", "round_robin"),))
    assert list(EngineGroup(layout, 1, _Recorder(), options).served_experts()) == [1, 3]
    with pytest.raises(EngineError, match="expert_placement_strategy='random'"):
        served_experts(4, 2, 0, "random")
