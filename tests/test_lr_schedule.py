"""The LR users expect: without ``--lr-decay-iters`` cosine and linear decay over the whole
run and end at ``--min-lr``, also with partial steps; iteration counts are optimizer steps;
a decay style that decays nothing is warned about at launch."""

import pytest
import torch

from vime_pure.lr_schedule import lr_groups
from vime_shell.megatron.trainer import lr_scheduler
from vime_shell.run.components import trainer_config
from vime_shell.run.report import launch_warnings
from vime_shell.settings.train_config import TrainConfig


def _run_lrs(cfg: TrainConfig, num_rollout: int) -> list[float]:
    """The LR after every optimizer step of the run, stepping Megatron's scheduler by each
    step's group count as the trainer does."""
    optim = trainer_config(cfg, num_rollout).optim
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    sched = lr_scheduler(sgd, optim)
    full, rest = divmod(cfg.groups_per_rollout, cfg.effective_global_batch_size)
    steps = [cfg.effective_global_batch_size] * full + ([rest] if rest else [])
    lrs = []
    for _ in range(num_rollout):
        for g in steps:
            sched.step(increment=g)
            lrs.append(sgd.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("style", ["cosine", "linear"])
@pytest.mark.parametrize("batch, partial", [(32, False), (12, True)])  # 32 groups: 1 / 3 steps
def test_lr_ends_at_min_lr_without_decay_iters(style, batch, partial):
    cfg = TrainConfig(rollout_batch_size=8, n_samples_per_prompt=4, global_batch_size=batch,
                      allow_partial_train_step=partial, lr=1e-3, min_lr=1e-5,
                      lr_decay_style=style, lr_warmup_iters=2)
    lrs = _run_lrs(cfg, num_rollout=6)
    assert lrs[-1] == pytest.approx(1e-5, rel=1e-9)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # decays after the warmup
    assert lrs[-2] > 1e-5  # ... and only at the very end reaches the floor


def test_decay_iters_count_optimizer_steps_with_partial_steps():
    # 32 groups per rollout at 12 per step: steps of 12, 12, 8 (3 per rollout).
    cfg = TrainConfig(rollout_batch_size=8, n_samples_per_prompt=4, global_batch_size=12,
                      allow_partial_train_step=True, lr=1e-3, min_lr=0.0,
                      lr_decay_style="linear", lr_decay_iters=9)
    lrs = _run_lrs(cfg, num_rollout=5)
    first_floor = next(i for i, lr in enumerate(lrs) if lr == 0.0)
    assert first_floor + 1 == 9  # the 9th optimizer step ends the decay
    assert lr_groups(groups_per_rollout=32, global_batch_size=12, allow_partial=True,
                     num_rollout=5, warmup_iters=1, decay_iters=9).decay_groups == 96


def test_lr_budgets_follow_each_steps_real_group_count():
    """The seed's example: 5 groups per rollout at --global-batch-size 4 with partial steps
    train steps of 4, 1, 4, 1, ...: --lr-warmup-iters 1 warms up over the first step's 4
    groups and --lr-decay-iters 3 ends the decay exactly at the third step (9 groups)."""
    cfg = TrainConfig(rollout_batch_size=5, n_samples_per_prompt=1, global_batch_size=4,
                      allow_partial_train_step=True, lr=1e-3, min_lr=0.0,
                      lr_decay_style="linear", lr_warmup_iters=1, lr_decay_iters=3)
    optim = trainer_config(cfg, 4).optim
    assert (optim.lr_warmup_groups, optim.lr_decay_groups) == (4, 9)
    lrs = _run_lrs(cfg, num_rollout=2)
    assert lrs[0] == pytest.approx(1e-3)  # warmed up after the first step
    assert lrs[1] == pytest.approx(1e-3 * 4 / 5)  # 5 groups: 1 of the 5 decay groups
    assert lrs[1] > 0.0 and lrs[2] == 0.0  # the third step ends the decay


def test_lr_warmup_fraction_counts_partial_steps():
    """slime's --lr-warmup-fraction is a share of the run's optimizer steps, a partial step
    counted as one: 2 rollouts of steps 4, 1 are 4 steps, so 0.5 warms up over 2 steps (the
    first rollout's 4 + 1 groups); counting full steps only gave 1 step (4 groups)."""
    cfg = TrainConfig(rollout_batch_size=5, n_samples_per_prompt=1, global_batch_size=4,
                      allow_partial_train_step=True, num_rollout=2, lr_warmup_fraction=0.5)
    assert cfg.warmup_iters() == 2
    assert trainer_config(cfg).optim.lr_warmup_groups == 5


def test_launch_warns_when_nothing_decays():
    quiet = TrainConfig(lr_decay_style="cosine")
    assert launch_warnings(quiet, 300) == []
    floor = TrainConfig(lr_decay_style="cosine", lr=1e-4, min_lr=1e-4)
    assert "nothing to decay" in launch_warnings(floor, 300)[0]
    empty = TrainConfig(lr_decay_style="linear", lr_decay_iters=2, lr_warmup_iters=2)
    assert "never decays: --lr-decay-iters 2 is not past" in launch_warnings(empty, 300)[0]
    short = TrainConfig(lr_decay_style="cosine", lr_warmup_iters=10)  # the README's, 2 rollouts
    assert launch_warnings(short, 2) == [
        "--lr-decay-style cosine never decays: the run's 2 optimizer steps (no --lr-decay-iters: "
        "--num-rollout 2 x 1 per rollout) are not past --lr-warmup-iters 10"]
    long = TrainConfig(lr_decay_style="linear", lr_decay_iters=1000)
    assert "longer than the run" in launch_warnings(long, 300)[0]
    assert launch_warnings(TrainConfig(), 300) == []
