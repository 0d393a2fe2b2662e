"""Empty and short rollouts, and the log a person reads: a rollout whose every prompt group the
dynamic-sampling filter removed is logged and skipped (no optimizer step, the LR does not move)
and the run goes on; without a terminal each rollout prints one line; startup phases, HF exports
and an end-of-run summary are logged; ``--save-hf`` ``{rollout_id}`` templates write one
directory per ``--save-hf-interval``."""

import json

import pytest
import torch

from tests.shell.loop_workers import filtered_rollout_worker
from vime_shell.megatron.spawn import spawn

pytestmark = pytest.mark.slow


def test_a_fully_filtered_rollout_is_skipped_and_the_run_goes_on(tmp_path):
    out = spawn(filtered_rollout_worker, 1, str(tmp_path), str(tmp_path / "cache"))[0]
    first, skipped, last = out["records"]
    assert skipped["skipped"] == 1 and skipped["num_steps"] == 0
    assert skipped["prompts_generated"] == 8 and skipped["prompts_kept"] == 0
    assert skipped["lr"] == first["lr"] > last["lr"]  # no step: the LR did not move
    assert first["num_steps"] == last["num_steps"] == 1
    # Linear decay over the run's 3 planned steps, of which the skipped rollout made none.
    assert last["lr"] == pytest.approx(1e-3 / 3, rel=1e-9)
    err = out["stderr"]
    assert "rollout 1: all 8 prompts of 2 generation rounds were filtered out" in err
    # a rollout that needs another generation round says so while it runs
    assert "dynamic sampling: rollout 1 has 0 of the 4 prompt groups it needs after round 0" \
        in err
    progress = [x for x in err.splitlines() if x.startswith("vime train: rollout ")]
    assert [x.split()[3] for x in progress if "filtered out by" not in x] == ["0", "1", "2"]
    assert "skipped: all 8 prompts filtered out" in err
    assert "startup: trainer built in" in err and "startup: first rollout done" in err
    assert "--allow-partial-train-step is implied" in err
    assert "done: 3 rollouts" in err and "1 skipped" in err
    from safetensors import safe_open

    for done in (2, 3):
        assert (tmp_path / "hf" / f"iter_{done}" / "config.json").is_file()
        shards = list((tmp_path / "hf" / f"iter_{done}").glob("*.safetensors"))
        assert shards
        for shard in shards:
            with safe_open(shard, "pt") as f:
                assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert f"HF checkpoint after {done} rollouts written to" in err
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["rollout"] for x in lines] == [0, 1, 2] and lines[1]["skipped"] == 1
