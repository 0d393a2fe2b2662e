"""From the data model's per-rank shards to the trainer's rows and plan.

``rank_inputs(batch, schedule, rank)`` goes through ``vime_pure.shard`` and the adapters
``TrainRows.from_shard`` / ``RankPlan.from_shard``. The result must equal the rows and plan
built straight from the schedule: the same samples in execution order, the same micro-batches,
``G_s`` and ``N_s`` per step, and identical packed rows.
"""

import numpy as np
import pytest

from vime_shell.packing import pack
from vime_shell.platform import TrainLayout
from vime_shell.synthetic import synthetic_batch, synthetic_rows, synthetic_schedule
from vime_shell.train_plan import RankPlan, rank_inputs

FIELDS = ("tokens", "position_ids", "labels", "logit_index", "loss_mask", "advantages",
          "denominators", "sample")


@pytest.mark.parametrize("dp", [1, 2])
def test_shard_path_equals_the_schedule_path(dp):
    batch = synthetic_batch(64, num_groups=10, seed=4)
    everything = synthetic_rows(64, num_groups=10, seed=4)
    schedule = synthetic_schedule(batch, TrainLayout(world_size=dp, dp=dp), global_batch_size=6,
                                  max_tokens_per_gpu=40)
    for rank in range(dp):
        rows, plan = rank_inputs(batch, schedule, rank)
        direct = everything.select(schedule.partitions[rank])
        assert plan == RankPlan.from_schedule(schedule, rank)
        assert [(s.num_groups, s.num_samples) for s in plan.steps] == [
            (s.num_groups, s.num_samples) for s in schedule.steps]
        assert [s.num_groups for s in plan.steps] == [6, 4]
        for step in plan.steps:
            for mb in step.microbatches:
                a, b = pack(rows, mb), pack(direct, mb)
                for field in FIELDS:
                    assert np.array_equal(getattr(a, field).numpy(),
                                          getattr(b, field).numpy()), field

