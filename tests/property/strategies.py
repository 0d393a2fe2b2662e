"""Hypothesis strategies for scheduler inputs: layouts, policies and grouped workloads."""

from hypothesis import strategies as st

from vime_pure import BatchingPolicy, ParallelLayout


@st.composite
def layouts(draw, max_dp: int = 4) -> ParallelLayout:
    dp = draw(st.integers(1, max_dp))
    cp = draw(st.sampled_from([1, 2]))
    vpp = draw(st.sampled_from([1, 1, 2]))
    group = draw(st.integers(1, 3)) if vpp > 1 else None
    return ParallelLayout(dp=dp, cp=cp, pp=2 if vpp > 1 else 1, vpp=vpp, microbatch_group=group)


@st.composite
def workloads(draw, cap_hint: int = 1000, max_groups: int = 40):
    """(lengths, group_ids): 1-4 siblings per group, some oversize, siblings interleaved."""
    num_groups = draw(st.integers(1, max_groups))
    sizes = draw(st.lists(st.integers(1, 4), min_size=num_groups, max_size=num_groups))
    ids = [(g, k) for g, n in enumerate(sizes) for k in range(n)]
    # Interleave siblings: a permutation that keeps each group's first occurrence order.
    shuffled = draw(st.permutations(ids))
    first_seen: dict[int, int] = {}
    for pos, (g, _) in enumerate(shuffled):
        first_seen.setdefault(g, pos)
    label = draw(st.sampled_from(["int", "str"]))
    group_ids = [g * 7 + 3 if label == "int" else f"rollout-{g}" for g, _ in shuffled]
    lengths = draw(st.lists(
        st.one_of(st.integers(1, cap_hint), st.integers(cap_hint, 3 * cap_hint)),
        min_size=len(ids), max_size=len(ids)))
    return lengths, group_ids


@st.composite
def dynamic_policies(draw, layout: ParallelLayout, cap_hint: int = 1000) -> BatchingPolicy:
    multiple = layout.align_multiple
    gbs = draw(st.integers(multiple, multiple + 12))
    return BatchingPolicy(
        global_batch_size=gbs, max_tokens_per_gpu=max(1, cap_hint // layout.cp),
        packing=draw(st.sampled_from(["ffd", "first_fit", "flops"])),
        balance=draw(st.sampled_from(["strided", "tokens", "flops"])),
        allow_partial_step=draw(st.booleans()))


@st.composite
def scenarios(draw):
    """A feasible dynamic-packing scenario: (lengths, group_ids, layout, policy)."""
    layout = draw(layouts())
    policy = draw(dynamic_policies(layout))
    lengths, group_ids = draw(workloads(max_groups=3 * policy.global_batch_size + 5))
    return lengths, group_ids, layout, policy
