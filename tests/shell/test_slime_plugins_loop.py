"""slime's plugin signatures run on the embedded model in the real loop: an ``async def
rm(args, sample)`` reward, a ``filter(args, samples)`` dynamic-sampling filter and a rollout log
function; ``--load X --save X`` starts fresh on a missing ``X`` and resumes from it next time;
``--eval-prompt-data`` without ``--eval-interval`` evaluates before the first rollout and after
the last of each run, through ``--eval-function-path`` where one is given;
``--debug-rollout-only`` generates and dumps without a trainer, and logs
a rollout the filter emptied as skipped."""

import pytest

from tests.shell.slime_plugin_workers import slime_plugins_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


def test_slime_plugins_fresh_start_resume_and_eval(tmp_path):
    out = spawn(slime_plugins_worker, 1, str(tmp_path), str(tmp_path / "cache"))[0]
    assert out["starts"] == (0, 2)  # fresh on the missing --load/--save dir, then resumed
    calls = out["calls"]
    assert calls["rm"] >= 3 * 16  # every sample of every rollout (and the eval samples)
    assert calls["filter"] and all(name == "TrainConfig" for name, _ in calls["filter"])
    assert [c[0] for c in calls["log"]] == [0, 1, 2]
    assert all(all(c[1:]) for c in calls["log"])  # samples with responses, metrics, time
    assert len(out["rewards"]) == 3
    # --debug-rollout-only: every rollout generated, rewarded, dumped and logged, no trainer
    # and a rollout whose every group the filter removed is logged as skipped, not dumped
    assert out["rollout_only"] == {"records": [16, 16], "dumps": [16, 16],
                                   "skipped": [(1, 0)], "skipped_dumps": 0}
    first, resumed = out["evals"]
    assert first == [0, 2]  # before rollout 0 and after the last one
    assert resumed[-1] == 3  # the resumed run evaluates after its last rollout
    # ... through its --eval-function-path, and only there (training keeps its own function)
    assert [rid for rid, _ in calls["eval_fn"]] == [3]
    assert calls["eval_fn"][0][1] > 0
