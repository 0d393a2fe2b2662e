"""LR warmup and decay lengths: optimizer steps in the flags, groups in the scheduler.

The trainer's LR scheduler advances by each step's real group count ``G_s`` (a partial step
of 4 groups moves it by 4), so its lengths are in groups. The flags count optimizer steps, as
in slime and Megatron. One rollout of ``R`` groups at ``--global-batch-size B`` makes steps of
``B`` groups and, with ``--allow-partial-train-step``, a last one of ``R mod B``
(:func:`step_groups`); without it those groups are dropped. ``N`` steps are the groups of the
run's first ``N`` steps, each counted at its real size, as the seed system (slime, group data
model) consumes its budgets: exact at every step, not only at rollout ends. Without
``--lr-decay-iters`` the decay spans the whole run, ``--num-rollout x S`` steps (Megatron's
``--lr-decay-iters`` defaults to its ``--train-iters``; slime's train iterations are rollouts
x steps per rollout), so the LR reaches ``--min-lr`` at the last step.

Example: 5 groups per rollout at ``B = 4`` with partial steps: steps of 4, 1, 4, 1, ...;
``--lr-decay-iters 3`` decays over 4 + 1 + 4 = 9 groups and ``--lr-warmup-iters 1`` warms up
over 4 (an average of 2.5 groups per step would give 8 and 2). With dynamic sampling a
rollout may train fewer groups; the lengths follow the full rollout's steps.
"""

import attrs

from vime_pure.errors import ScheduleError, field_error

CONSTANT = "constant"


def steps_per_rollout(groups_per_rollout: int, global_batch_size: int,
                      allow_partial: bool) -> int:
    """Optimizer steps one rollout makes. Example: ``(100, 32, True) == 4``, ``(100, 32,
    False) == 3`` (the 4 left-over groups are dropped)."""
    for name, value in (("groups_per_rollout", groups_per_rollout),
                        ("global_batch_size", global_batch_size)):
        if value < 1:
            raise field_error(ScheduleError, name, value, "must be >= 1", "pass a positive count")
    full, rest = divmod(groups_per_rollout, global_batch_size)
    return full + (1 if rest and allow_partial else 0)


def step_groups(groups_per_rollout: int, global_batch_size: int,
                allow_partial: bool) -> tuple[int, ...]:
    """Each optimizer step's group count in one rollout. Example: ``(5, 4, True) == (4, 1)``,
    ``(5, 4, False) == (4,)`` (the left-over group is dropped)."""
    full, rest = divmod(groups_per_rollout, global_batch_size)
    spr = steps_per_rollout(groups_per_rollout, global_batch_size, allow_partial)
    return (global_batch_size,) * full + (rest,) * (spr - full)


def groups_of_steps(steps: int, per_rollout: tuple[int, ...]) -> int:
    """The groups of the run's first ``steps`` optimizer steps, each at its real size, every
    rollout stepping ``per_rollout``. Example: ``groups_of_steps(3, (4, 1)) == 9``."""
    if steps < 0:
        raise field_error(ScheduleError, "steps", steps, "must be >= 0",
                          "pass --lr-warmup-iters / --lr-decay-iters of 0 or more")
    rollouts, rest = divmod(steps, len(per_rollout))
    return rollouts * sum(per_rollout) + sum(per_rollout[:rest])


@attrs.frozen(kw_only=True)
class LrGroups:
    """The scheduler's lengths in groups, and the steps they came from."""

    warmup_groups: int
    decay_groups: int
    warmup_steps: int
    decay_steps: int
    steps_per_rollout: int
    decay_spans_run: bool = False  # no --lr-decay-iters: the decay is the whole run


def lr_groups(*, groups_per_rollout: int, global_batch_size: int, allow_partial: bool,
              num_rollout: int, warmup_iters: int, decay_iters: int | None) -> LrGroups:
    """Warmup and decay lengths in groups (module docstring). ``decay_iters=None``: the
    whole run. Example: ``lr_groups(groups_per_rollout=128, global_batch_size=64,
    allow_partial=False, num_rollout=5, warmup_iters=2, decay_iters=None)`` decays over 10
    steps = 640 groups and warms up over 128."""
    per_rollout = step_groups(groups_per_rollout, global_batch_size, allow_partial)
    if not per_rollout:  # fewer groups than one step and no partial steps: nothing trains
        per_rollout = (groups_per_rollout,)
    spr = len(per_rollout)
    decay = num_rollout * spr if decay_iters is None else decay_iters
    return LrGroups(warmup_groups=groups_of_steps(warmup_iters, per_rollout),
                    decay_groups=groups_of_steps(decay, per_rollout),
                    warmup_steps=warmup_iters, decay_steps=decay, steps_per_rollout=spr,
                    decay_spans_run=decay_iters is None)


def lr_schedule_warnings(*, style: str, lr: float, min_lr: float, schedule: LrGroups,
                         num_rollout: int) -> list[str]:
    """What a user asking for a decay would not expect: nothing decays, or it stops short.

    Example: ``--lr-decay-style cosine --lr-decay-iters 2 --lr-warmup-iters 2`` warns that
    the decay is empty; so does ``--num-rollout 2 --lr-warmup-iters 10`` without
    ``--lr-decay-iters``, naming the run's 2 steps (never a flag the user did not pass)."""
    if style == CONSTANT:
        return []
    out = []
    run_steps = num_rollout * schedule.steps_per_rollout
    if min_lr >= lr:
        out.append(f"--lr-decay-style {style} has nothing to decay: --min-lr {min_lr:g} is "
                   f"not below --lr {lr:g}")
    if schedule.decay_steps <= schedule.warmup_steps:
        length = (f"the run's {schedule.decay_steps} optimizer steps (no --lr-decay-iters: "
                  f"--num-rollout {num_rollout} x {schedule.steps_per_rollout} per rollout) are"
                  if schedule.decay_spans_run else
                  f"--lr-decay-iters {schedule.decay_steps} is")
        out.append(f"--lr-decay-style {style} never decays: {length} not past "
                   f"--lr-warmup-iters {schedule.warmup_steps}")
    elif schedule.decay_steps > run_steps:
        out.append(f"--lr-decay-iters {schedule.decay_steps} is longer than the run "
                   f"({run_steps} optimizer steps): the LR ends above --min-lr")
    return out
