"""Named examples of the issue-14 review's raw exceptions, now typed one-line errors.

Each case was a bare ``AttributeError`` / ``KeyError`` / numpy broadcast error / traceback
before; now it is a ``VimeError`` naming the field, the value and the fix (the fuzz harness in
``tests/fuzz/`` covers the same entry points on drawn inputs).
"""

import json

import numpy as np
import pytest

from vime_pure import (BatchingPolicy, Metric, MetricError, ParallelLayout, RolloutBatch,
                       RolloutValidationError, Sample, ScheduleError, check_feasible,
                       reduce_metrics, reduce_train_step)
from vime_shell.cli.main import main


def test_plain_dicts_and_strings_are_not_metrics():
    with pytest.raises(MetricError, match=r"per_rank\[0\]\['loss'\]=<float>: is not a Metric"):
        reduce_metrics([{"loss": 0.5}])
    with pytest.raises(MetricError, match=r"per_rank=<dict>: is not a non-empty list"):
        reduce_metrics({"loss": Metric(1.0, 1.0)})
    with pytest.raises(MetricError, match=r"sum='1.5': is not a real number"):
        Metric("1.5", 1)
    with pytest.raises(MetricError, match=r"values\[0\]\['loss'\]=nan: is NaN"):
        reduce_train_step([{"loss": float("nan")}], 1, "group_token_mean")
    assert reduce_metrics([{"r": Metric(np.float32(1.0), 2)}, {"r": Metric(1, 1)}])["r"].value \
        == pytest.approx(2 / 3)


def test_check_feasible_with_wrong_types():
    with pytest.raises(ScheduleError, match=r"layout=<int>: is not a ParallelLayout"):
        check_feasible(4, BatchingPolicy(global_batch_size=4, max_tokens_per_gpu=10))
    with pytest.raises(ScheduleError, match=r"policy=<dict>: is not a BatchingPolicy"):
        check_feasible(ParallelLayout(dp=np.int64(2)), {"global_batch_size": 4})
    assert ParallelLayout(dp=np.int64(2)).dp == 2 and type(ParallelLayout(dp=np.int64(2)).dp) is int


@pytest.mark.parametrize("loss_mask, match", [
    ("11", r"output\[0\]\[0\]: loss_mask='11' is a str, not a flat list or array"),
    (1, r"output\[0\]\[0\]: loss_mask=1 is a int, not a flat list or array"),
    (np.ones((1, 2)), r"loss_mask=array\(\[\[1., 1.\]\]\) is a ndarray"),
])
def test_sample_masks_of_the_wrong_type(loss_mask, match):
    with pytest.raises(RolloutValidationError, match=match):
        RolloutBatch.from_samples([[Sample(tokens=[1, 2, 3], response_length=2,
                                           loss_mask=loss_mask, reward=0.0)]])


@pytest.mark.parametrize("row, match", [
    ({"length": "100", "group_id": "a"}, r"w.jsonl:3: length='100' is not an integer"),
    ({"length": 100, "group_id": 1.5}, r"w.jsonl:3: group_id=1.5 is a float"),
    ({"length": True, "group_id": "a"}, r"w.jsonl:3: length=True is not an integer"),
    ({"group_id": "a"}, r"w.jsonl:3: .* lacks \"length\""),
])
def test_jsonl_errors_name_the_line(tmp_path, capsys, row, match):
    path = tmp_path / "w.jsonl"
    good = json.dumps({"length": 10, "group_id": "g"})
    path.write_text(f"{good}\n{good}\n{json.dumps(row)}\n")
    assert main(["schedule", "--input", str(path), "--global-batch-size", "1", "--dp", "1",
                 "--max-tokens-per-gpu", "100"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert __import__("re").search(match, err), err


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04trunc", b"\x00\xffnot a zip"])
def test_schedule_input_npz_damaged_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "rollout_3.npz"
    path.write_bytes(content)
    assert main(["schedule", "--input", str(path), "--global-batch-size", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vime schedule: error:") and len(err.strip().splitlines()) == 1
    assert "cannot read the rollout dump" in err and "Traceback" not in err
