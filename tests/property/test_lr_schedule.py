"""LR lengths: optimizer steps in the flags, groups in the scheduler, each step counted at its
real group count (the seed's rule), so exact at every step, not only at rollout ends."""

from hypothesis import given
from hypothesis import strategies as st

from vime_pure.lr_schedule import groups_of_steps, lr_groups, step_groups, steps_per_rollout


@st.composite
def runs(draw):
    """(groups per rollout, global batch size, partial steps, rollouts): batch sizes that
    divide the rollout, leave a remainder, or exceed it."""
    groups = draw(st.integers(1, 300))
    batch = draw(st.integers(1, 2 * groups))
    partial = draw(st.booleans()) or groups % batch == 0 or batch > groups
    return groups, batch, partial, draw(st.integers(1, 50))


def run_steps(groups: int, batch: int, partial: bool, rollouts: int) -> list[int]:
    """The oracle: every optimizer step's group count over the run, cut rollout by rollout
    (a partial step takes the rest; without partial steps the rest is dropped)."""
    out = []
    for _ in range(rollouts):
        left = groups
        while left >= batch or (left and partial):
            out.append(min(batch, left))
            left -= out[-1]
    return out


def test_lr_budgets_count_each_steps_real_groups():
    """5 groups per rollout at --global-batch-size 4 with partial steps: steps of 4, 1, 4, 1,
    ...; --lr-decay-iters 3 is 4 + 1 + 4 = 9 groups, --lr-warmup-iters 1 is 4 (the seed's
    budgets; an average of 2.5 groups per step gave 8 and 2)."""
    lr = lr_groups(groups_per_rollout=5, global_batch_size=4, allow_partial=True,
                   num_rollout=10, warmup_iters=1, decay_iters=3)
    assert (lr.decay_groups, lr.warmup_groups) == (9, 4)
    assert step_groups(5, 4, True) == (4, 1) and groups_of_steps(3, (4, 1)) == 9


@given(runs(), st.integers(0, 120), st.integers(0, 120))
def test_n_steps_are_the_groups_of_the_runs_first_n_steps(run, warmup, decay):
    """Any --lr-warmup-iters / --lr-decay-iters N is the sum of the real group counts of the
    run's first N optimizer steps (steps past the run repeat its rollouts)."""
    groups, batch, partial, rollouts = run
    lr = lr_groups(groups_per_rollout=groups, global_batch_size=batch, allow_partial=partial,
                   num_rollout=rollouts, warmup_iters=warmup, decay_iters=decay)
    steps = run_steps(groups, batch, partial, 121)  # 121 rollouts have >= 121 steps
    assert lr.warmup_groups == sum(steps[:warmup])
    assert lr.decay_groups == sum(steps[:decay])


@given(runs(), st.integers(0, 5))
def test_whole_run_decay_ends_at_the_last_trained_group(run, warmup):
    """Without --lr-decay-iters the decay spans every group the run trains (dropped left-over
    groups excluded), so the LR reaches --min-lr at the last step; a step count k*S (whole
    rollouts) is exactly k rollouts' trained groups."""
    groups, batch, partial, rollouts = run
    lr = lr_groups(groups_per_rollout=groups, global_batch_size=batch, allow_partial=partial,
                   num_rollout=rollouts, warmup_iters=warmup, decay_iters=None)
    spr = steps_per_rollout(groups, batch, partial)
    steps = run_steps(groups, batch, partial, rollouts)
    assert lr.decay_groups == sum(steps) and lr.decay_steps == rollouts * spr == len(steps)
    k = rollouts // 2
    at_k = lr_groups(groups_per_rollout=groups, global_batch_size=batch, allow_partial=partial,
                     num_rollout=rollouts, warmup_iters=0, decay_iters=k * spr)
    assert at_k.decay_groups == k * sum(step_groups(groups, batch, partial))
