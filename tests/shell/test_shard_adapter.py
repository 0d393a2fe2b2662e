"""From the data model's per-rank shard to the trainer's rows and plan.

``TrainRows.from_shard`` / ``RankPlan.from_shard`` read a ``RankShard``'s columns (rows in
execution order, ragged tokens and response masks, per-sample advantages and group mask sums,
per-step micro-batch counts, ``G_s`` and ``N_s``). The result must equal the rows and plan the
trainer builds straight from the schedule.
"""

import numpy as np
import pytest

from vime_pure import BatchingPolicy, ParallelLayout, build_schedule
from vime_shell.packing import TrainRows, pack
from vime_shell.synthetic import synthetic_rows
from vime_shell.train_plan import RankPlan


def _shard_like(rows, schedule, rank):
    """The columns a ``vime_pure.shard.RankShard`` carries, built from the same schedule."""
    from types import SimpleNamespace

    part = list(schedule.partitions[rank])
    sub = rows.select(part)
    per_sample_adv = np.array([sub.advantages[sub.response_offsets[i]] for i in range(len(part))])
    return SimpleNamespace(
        tokens=sub.tokens.astype(np.int32), lengths=sub.lengths,
        response_lengths=sub.response_lengths, loss_masks=sub.loss_mask.astype(np.uint8),
        advantages=per_sample_adv, group_mask_sums=sub.denominators, group_ids=sub.group,
        micro_batch_indices=schedule.micro_batch_indices[rank],
        num_microbatches=tuple(s.num_microbatches for s in schedule.steps),
        num_groups=tuple(s.num_groups for s in schedule.steps),
        num_samples=tuple(s.num_samples for s in schedule.steps))


@pytest.mark.parametrize("dp", [1, 2])
def test_shard_adapter_equals_the_schedule_path(dp):
    rows = synthetic_rows(64, num_groups=10, seed=4)  # 0/1 masks, per-group advantages
    schedule = build_schedule(rows.lengths.tolist(), rows.group.tolist(), ParallelLayout(dp=dp),
                              BatchingPolicy(global_batch_size=6, max_tokens_per_gpu=40,
                                             allow_partial_step=True))
    for rank in range(dp):
        shard = _shard_like(rows, schedule, rank)
        adapted, plan = TrainRows.from_shard(shard), RankPlan.from_shard(shard)
        direct = rows.select(schedule.partitions[rank])
        assert plan == RankPlan.from_schedule(schedule, rank)
        assert [s.num_groups for s in plan.steps] == [6, 4]
        for step in plan.steps:
            for mb in step.microbatches:
                a, b = pack(adapted, mb), pack(direct, mb)
                for field in ("tokens", "logit_index", "loss_mask", "advantages",
                              "denominators"):
                    assert np.array_equal(getattr(a, field).numpy(),
                                          getattr(b, field).numpy()), field
