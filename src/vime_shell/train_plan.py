"""Records the trainer consumes: optimizer settings, per-rank step plans, step results.

Purpose: the data-only half of the trainer, importable without Megatron. A ``RankPlan`` is what
one DP rank runs for one rollout batch: per step ``G_s`` (and ``N_s`` when known) and the
rank's micro-batches as local row positions, built from a ``Schedule`` or a ``RankShard``.

Example: a schedule with steps of [24, 8] groups on dp=2 gives, for rank 0,
``RankPlan(steps=(StepSpec(num_groups=24, ...), StepSpec(num_groups=8, ...)))`` whose
micro-batch counts equal ``schedule.steps[s].num_microbatches``.
"""

import attrs

from vime_pure.errors import VimeError, field_error
from vime_shell.objective import LossConfig


@attrs.frozen(kw_only=True)
class OptimConfig:
    """Adam and LR schedule. LR warmup/decay lengths count **groups** (the unit of
    ``increment=G_s``), e.g. ``lr_decay_groups=640`` decays over 20 steps of 32 groups."""

    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_groups: int = 0
    lr_decay_groups: int | None = None
    lr_decay_style: str = "constant"
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.lr > 0:
            raise field_error(VimeError, "lr", self.lr, "must be positive", "use e.g. 1e-6")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise field_error(VimeError, "overlap_param_gather", True,
                              "needs the distributed optimizer",
                              "set use_distributed_optimizer=True or drop overlap_param_gather")


@attrs.frozen(kw_only=True)
class TrainerConfig:
    """Everything the trainer needs besides the model directory and the layout."""

    optim: OptimConfig = attrs.field(factory=OptimConfig)
    loss: LossConfig = attrs.field(factory=LossConfig)
    seed: int = 1234


@attrs.frozen(kw_only=True)
class StepSpec:
    """One optimizer step on one rank: ``G_s``, the rank's micro-batches (local positions) and,
    when known, the step's sample count ``N_s`` over all DP ranks (else it is all-reduced)."""

    num_groups: int
    microbatches: tuple[tuple[int, ...], ...]
    num_samples: int | None = None


@attrs.frozen(kw_only=True)
class RankPlan:
    """The steps of one rollout batch as one DP rank runs them."""

    steps: tuple[StepSpec, ...]

    @classmethod
    def from_shard(cls, shard) -> "RankPlan":
        """The plan of a ``vime_pure.shard.RankShard``: per step ``num_groups`` and its
        ``num_microbatches`` micro-batches, as local positions into the shard's rows."""
        local = iter(shard.micro_batch_indices)
        samples = getattr(shard, "num_samples", None) or (None,) * len(shard.num_groups)
        return cls(steps=tuple(
            StepSpec(num_groups=int(g), num_samples=None if n is None else int(n),
                     microbatches=tuple(tuple(int(i) for i in next(local))
                                        for _ in range(int(k))))
            for k, g, n in zip(shard.num_microbatches, shard.num_groups, samples)))

    @classmethod
    def from_schedule(cls, schedule, dp_rank: int) -> "RankPlan":
        """Local positions (into ``schedule.partitions[dp_rank]``) of every step's micro-batches."""
        local = iter(schedule.micro_batch_indices[dp_rank])
        steps = tuple(StepSpec(num_groups=s.num_groups, num_samples=s.num_samples,
                               microbatches=tuple(next(local) for _ in range(s.num_microbatches)))
                      for s in schedule.steps)
        return cls(steps=steps)


@attrs.frozen(kw_only=True)
class StepResult:
    """Reduced metrics of one step (identical on every rank) and what this rank ran."""

    metrics: dict[str, float]
    num_groups: int
    num_microbatches: int
    lr: float
    grad_norm: float


def rank_inputs(batch, schedule, dp_rank: int, *, old_log_probs=None, ref_log_probs=None):
    """``(TrainRows, RankPlan)`` of DP rank ``dp_rank`` for a ``RolloutBatch`` under the
    ``Schedule`` planned for it, through ``vime_pure.shard`` (rows in execution order).

    Example: ``rows, plan = rank_inputs(batch, schedule, trainer.dp_rank)``, then
    ``trainer.train(rows, plan)``; log-prob columns are flat over the rank's response tokens.
    """
    from vime_pure import shard
    from vime_shell.packing import TrainRows

    mine = shard(batch, schedule)[dp_rank]
    rows = TrainRows.from_shard(mine, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs)
    return rows, RankPlan.from_shard(mine)
