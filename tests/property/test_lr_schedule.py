"""LR lengths: optimizer steps in the flags, groups in the scheduler, exact at rollout ends."""

from hypothesis import given
from hypothesis import strategies as st

from vime_pure.lr_schedule import lr_groups, steps_per_rollout


@st.composite
def runs(draw):
    """(groups per rollout, global batch size, partial steps, rollouts): batch sizes that
    divide the rollout, leave a remainder, or exceed it."""
    groups = draw(st.integers(1, 300))
    batch = draw(st.integers(1, 2 * groups))
    partial = draw(st.booleans()) or groups % batch == 0 or batch > groups
    return groups, batch, partial, draw(st.integers(1, 50))


@given(runs(), st.integers(0, 5))
def test_whole_run_decay_ends_at_the_last_group(run, warmup):
    """Without --lr-decay-iters the decay spans every group the run trains, so the LR
    reaches --min-lr at the last step; a step count k*S (whole rollouts) is exactly k
    rollouts' groups, whatever the partial step's size."""
    groups, batch, partial, rollouts = run
    lr = lr_groups(groups_per_rollout=groups, global_batch_size=batch, allow_partial=partial,
                   num_rollout=rollouts, warmup_iters=warmup, decay_iters=None)
    spr = steps_per_rollout(groups, batch, partial)
    assert lr.decay_groups == rollouts * groups and lr.decay_steps == rollouts * spr
    k = rollouts // 2
    at_k = lr_groups(groups_per_rollout=groups, global_batch_size=batch, allow_partial=partial,
                     num_rollout=rollouts, warmup_iters=0, decay_iters=k * spr)
    assert at_k.decay_groups == k * groups
