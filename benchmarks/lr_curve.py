"""The LR a run trains with, before and after the issue-20 fix, on Megatron's own scheduler.

Before: without ``--lr-decay-iters`` the decay length was 2**40 groups (the LR never moved),
and ``--lr-decay-iters N`` meant ``N x --global-batch-size`` groups, which overshoots N
optimizer steps when partial steps are smaller. After: the decay spans the whole run
(``vime_pure.lr_groups``) and N iterations are N optimizer steps.

Prints the LR at 0, 25, 50, 75 and 100% of the run's optimizer steps, per case.
Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.lr_curve`` (``--quick``: fewer
rollouts).
"""

import argparse

import attrs
import torch

from vime_shell.megatron.trainer import lr_scheduler
from vime_shell.run.components import trainer_config
from vime_shell.settings.train_config import TrainConfig

CASES = {
    "cosine, no --lr-decay-iters": dict(lr_decay_style="cosine"),
    "linear, no --lr-decay-iters": dict(lr_decay_style="linear"),
    "cosine, partial steps (32 groups @ 12), --lr-decay-iters = run": dict(
        lr_decay_style="cosine", global_batch_size=12, allow_partial_train_step=True),
}


def curve(cfg: TrainConfig, num_rollout: int, *, before: bool) -> list[float]:
    optim = trainer_config(cfg, num_rollout).optim
    if before:  # the old mapping: no decay length, or iterations x the full step's groups
        old = (None if cfg.lr_decay_iters is None
               else cfg.lr_decay_iters * cfg.effective_global_batch_size)
        optim = attrs.evolve(optim, lr_decay_groups=old)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    sched = lr_scheduler(sgd, optim)
    full, rest = divmod(cfg.groups_per_rollout, cfg.effective_global_batch_size)
    steps = [cfg.effective_global_batch_size] * full + ([rest] if rest else [])
    lrs = [sgd.param_groups[0]["lr"]]
    for _ in range(num_rollout):
        for g in steps:
            sched.step(increment=g)
            lrs.append(sgd.param_groups[0]["lr"])
    return lrs


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    num_rollout = 4 if args.quick else 100
    out = {}
    print(f"lr 1e-3, min-lr 1e-5, {num_rollout} rollouts of 8 prompts x 4 samples; LR at "
          "0/25/50/75/100% of the optimizer steps")
    for name, extra in CASES.items():
        cfg = TrainConfig(rollout_batch_size=8, n_samples_per_prompt=4, lr=1e-3, min_lr=1e-5,
                          **{"global_batch_size": 32, **extra})
        if "partial" in name:
            cfg = attrs.evolve(cfg, lr_decay_iters=num_rollout * 3)  # 3 steps per rollout
        out[name] = {}
        for label, before in (("before", True), ("after", False)):
            lrs = curve(cfg, num_rollout, before=before)
            picks = [lrs[round(f * (len(lrs) - 1))] for f in (0, 0.25, 0.5, 0.75, 1.0)]
            out[name][label] = picks
            print(f"  {name:62s} {label:6s} " + " ".join(f"{v:.2e}" for v in picks))
    return out


if __name__ == "__main__":
    main()
