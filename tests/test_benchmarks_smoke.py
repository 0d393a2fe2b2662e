"""The benchmarks run end to end in their ``--quick`` mode (no timing assertions)."""

from benchmarks import batch_convert, sample_access


def test_sample_access_quick(capsys):
    medians = sample_access.main(["--quick"])
    assert set(medians) == {"no alias (baseline)", "Sample (property alias)",
                            "__getattribute__ alias"}
    assert all(m["read"] > 0 and m["write"] > 0 for m in medians.values())
    assert "alias overhead ratio" in capsys.readouterr().out


def test_batch_convert_quick(capsys):
    batch_convert.main(["--quick"])
    out = capsys.readouterr().out
    assert "[short] 2048 samples" in out and "convert+shard of 2048 samples:" in out
