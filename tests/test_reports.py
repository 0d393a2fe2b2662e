"""``vime schedule --compare`` / ``--plot`` and the report records, on hand-checked workloads."""

import pytest

from vime_pure import BatchingPolicy, ParallelLayout, build_schedule
from vime_pure.scheduling.flops import proxy_flops
from vime_pure.scheduling.report import step_stats, summarize
from vime_shell.cli.main import main

LENGTHS = [600, 500, 400, 300, 200, 100]  # 2100 tokens, cap 1000 -> bound 3, aligned (dp=2) 4


def _direct(schedule, weights):
    """Per-step (max/mean) rank loads computed straight from the micro-batches."""
    out = []
    for step in schedule.steps:
        loads = [sum(weights[i] for mb in r for i in mb) for r in step.microbatches]
        out.append(max(loads) / (sum(loads) / len(loads)))
    return out


@pytest.mark.parametrize("packing", ["ffd", "first_fit", "flops"])
@pytest.mark.parametrize("balance", ["strided", "tokens", "flops"])
def test_summary_matches_direct_computation(packing, balance):
    policy = BatchingPolicy(global_batch_size=6, max_tokens_per_gpu=1000, packing=packing,
                            balance=balance)
    s = build_schedule(LENGTHS, list(range(6)), ParallelLayout(dp=2), policy)
    summary = summarize(s)
    assert summary.microbatch_bound == 3 and summary.microbatch_bound_aligned == 4
    assert summary.microbatches == 2 * s.steps[0].num_microbatches >= 4
    assert summary.token_imbalance_bound == pytest.approx(1.0)  # max item 600 < mean 1050
    assert summary.token_imbalance_mean == pytest.approx(_direct(s, LENGTHS)[0])
    work = proxy_flops(__import__("numpy").array(LENGTHS))
    assert summary.flops_imbalance_mean == pytest.approx(_direct(s, work)[0])
    mbs = [list(mb) for r in s.steps[0].microbatches for mb in r]
    padded = sum(len(mb) * max(LENGTHS[i] for i in mb) for mb in mbs)
    assert summary.pad_waste == pytest.approx(padded / 2100 - 1)
    assert summary.over_cap_multi == 0 and summary.dropped_groups == 0


def test_ffd_hand_checked_packing():
    # FFD: 600 | 500+300+200 | 400 joins 600 | 100 alone -> 3 bins, aligned to 4 by one split.
    s = build_schedule(LENGTHS, list(range(6)), ParallelLayout(dp=1),
                       BatchingPolicy(global_batch_size=6, max_tokens_per_gpu=1000))
    assert sorted(sorted(mb) for mb in s.steps[0].microbatches[0]) == [[0, 2], [1, 3, 4], [5]]
    stats = step_stats(s)[0]
    assert stats.cap_use == pytest.approx(2100 / 3000)
    assert stats.max_microbatch_tokens == 1000


def test_imbalance_bound_with_a_dominant_item():
    # One 5000-token sample on dp=2 with 1000 more tokens: mean 3000, bound 5000/3000.
    s = build_schedule([5000, 500, 500], [0, 1, 2], ParallelLayout(dp=2),
                       BatchingPolicy(global_batch_size=3, max_tokens_per_gpu=1000))
    assert summarize(s).token_imbalance_bound == pytest.approx(5000 / 3000)
    assert summarize(s).token_imbalance_mean >= summarize(s).token_imbalance_bound - 1e-12


def test_compare_and_plot_cli(tmp_path, capsys):
    common = ["schedule", "--synthetic", "--num-groups", "64", "--global-batch-size", "32",
              "--dp", "4", "--max-tokens-per-gpu", "16384"]
    assert main(common + ["--compare"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") >= 11 and "first_fit" in out and "pad waste" in out
    png = tmp_path / "step.png"
    assert main(common + ["--plot", str(png), "--plot-step", "1"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert main(common + ["--plot", str(png), "--plot-step", "9"]) == 2
    assert "--plot-step 9 is out of range" in capsys.readouterr().err


def test_bound_counts_oversize_samples_alone():
    # cap 1000: samples 1500, 1500, 100 use 3 micro-batches (each oversize one alone). The
    # plain ceil(3100 / 1000) = 4 would show a schedule below its "lower bound"; the
    # oversize-aware bound is 2 + ceil(100 / 1000) = 3.
    s = build_schedule([1500, 1500, 100], [0, 1, 2], ParallelLayout(dp=1),
                       BatchingPolicy(global_batch_size=3, max_tokens_per_gpu=1000))
    stats = step_stats(s)[0]
    assert (stats.microbatch_bound, stats.oversize_samples) == (3, 2)
    assert stats.num_microbatches == 3 >= stats.microbatch_bound_aligned
    # 1500 alone + ceil(1500 / 1000) = 3, aligned to dp=2: 4, i.e. 2 per rank.
    s = build_schedule([1500, 600, 500, 400], [0, 1, 2, 3], ParallelLayout(dp=2),
                       BatchingPolicy(global_batch_size=4, max_tokens_per_gpu=1000))
    stats = step_stats(s)[0]
    assert (stats.microbatch_bound, stats.microbatch_bound_aligned) == (3, 4)
    assert stats.microbatch_lower_bound == 2 <= stats.microbatches_per_rank
