"""``assert_schedule_invariants``: an independent re-check of every Schedule invariant.

It recomputes each invariant from the public fields only (not through
``vime_pure.scheduling.invariants``), so a bug in the construction-time checker cannot hide a bug in the
planner.
"""

from collections import defaultdict

from vime_pure import Schedule


def assert_schedule_invariants(s: Schedule, group_ids) -> None:
    dp = s.layout.dp
    cap = s.policy.token_cap(s.layout)
    step_of_sample: dict[int, int] = {}
    for k, step in enumerate(s.steps):
        # 1. equal micro-batch counts per rank; 6. VPP multiple.
        assert [len(r) for r in step.microbatches] == [step.num_microbatches] * dp
        assert step.num_microbatches >= 1
        if s.layout.vpp > 1:
            assert step.num_microbatches % s.layout.microbatch_group == 0
        for rank in step.microbatches:
            for mb in rank:
                assert len(mb) >= 1
                # 4. cap, except singletons.
                if cap is not None and len(mb) > 1:
                    assert sum(s.lengths[i] for i in mb) <= cap, (mb, cap)
                if cap is None:
                    assert len(mb) <= s.policy.micro_batch_size
                for i in mb:
                    step_of_sample[i] = k
    # 2. local indices enumerate each partition in order, and agree with the steps.
    for rank in range(dp):
        flat = [i for mb in s.micro_batch_indices[rank] for i in mb]
        assert flat == list(range(len(s.partitions[rank])))
        glob = [i for step in s.steps for mb in step.microbatches[rank] for i in mb]
        assert list(s.partitions[rank]) == glob
        assert [[s.partitions[rank][j] for j in mb] for mb in s.micro_batch_indices[rank]] == [
            list(mb) for step in s.steps for mb in step.microbatches[rank]]
    # 3. disjoint partitions covering exactly the kept groups' samples.
    scheduled = [i for p in s.partitions for i in p]
    assert len(scheduled) == len(set(scheduled))
    members = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    dropped = set(s.dropped_groups)
    assert set(s.dropped_samples) == {i for g in dropped for i in members[g]}
    assert set(scheduled) == set(range(len(group_ids))) - set(s.dropped_samples)
    # 5. siblings share a step; num_groups counts the step's groups.
    for g, idx in members.items():
        steps = {step_of_sample.get(i) for i in idx}
        assert len(steps) == 1, (g, steps)
    for k, step in enumerate(s.steps):
        groups = {group_ids[i] for r in step.microbatches for mb in r for i in mb}
        assert len(groups) == step.num_groups
    # Dropped groups are trailing: every kept group first occurs before every dropped one.
    order = list(dict.fromkeys(group_ids))
    kept = [g for g in order if g not in dropped]
    assert order == kept + [g for g in order if g in dropped]
