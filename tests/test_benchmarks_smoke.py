"""Every benchmark runs end to end in its ``--quick`` mode (timings are never asserted)."""

import json
import shutil
from pathlib import Path

from benchmarks import batch_convert, sample_access, slime_flag_coverage, work_queue
from benchmarks.schedule import POLICIES, QUICK, main


def test_quick_benchmark_writes_json_and_table(tmp_path):
    out, readme = tmp_path / "bench.json", tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nintro\n")
    main(["--quick", "--out", str(out), "--readme", str(readme)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["layout"], r["policy"]) for r in rows} == {
        (lay, pol) for lay in QUICK["layouts"] for pol in POLICIES}
    for r in rows:
        assert r["wall_ms"] > 0 and r["cap_violations"] == 0 and r["below_bound_steps"] == 0
        assert r["microbatches"] >= r["mb_lower_bound"]
        assert r["flops_imb_worst"] >= r["flops_imb_mean"] >= 1.0
        assert "reference" in r and r["speedup"] > 0
    text = readme.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n") and "<!-- bench:start -->" in text
    assert "| A | straggler |" in text and "Machine:" in text


def test_sample_access_quick(capsys):
    medians = sample_access.main(["--quick"])
    assert set(medians) == {"no alias (baseline)", "Sample (property alias)",
                            "__getattribute__ alias"}
    assert all(m["read"] > 0 and m["write"] > 0 for m in medians.values())
    assert "alias overhead ratio" in capsys.readouterr().out


def test_batch_convert_quick(capsys):
    batch_convert.main(["--quick"])
    out = capsys.readouterr().out
    assert "[short] 2048 samples" in out and "convert+records of 2048 samples:" in out


def test_scale_quick(tmp_path, capsys):
    from benchmarks import scale

    result = scale.main(["--quick", "--out", str(tmp_path / "scale.json")])
    assert [r["dp"] for r in result["rows"]] == [8, 64]
    assert all(r["schedule_cpu_s"] > 0 and r["rank_records_bytes"] > 0 for r in result["rows"])
    # the analytic column size the doc uses for 1M samples equals a real batch's nbytes
    assert result["columns_bytes_unscaled"] == result["columns_bytes_total"]
    params = {r["model"]: r["params"] for r in result["sync"]}
    assert abs(params["Qwen3-8B"] / 8.19e9 - 1) < 0.01
    assert abs(params["Llama-3.1-70B"] / 70.55e9 - 1) < 0.01
    assert "gather: columns" in capsys.readouterr().out
    # the sharded path: the exact packing count the doc uses for 1M samples equals what
    # pack_piece really produced; a rank receives its share (and the plan), not the batch
    for row in result["rows"]:
        for rank in row["shares"]["ranks"]:
            assert rank["share_bytes_received"] == rank["share_bytes_received_unscaled"]
            assert rank["share_bytes_received"] <= rank["share_nbytes"]
        assert row["shares"]["plan_bytes_every_rank"] < result["columns_bytes_total"] / 100
    assert result["funnel"]["rank0_bytes_received_unscaled"] > result["columns_bytes_total"]


def test_slime_flag_coverage_on_our_corpus(tmp_path):
    """The coverage tool on our own slime-style scripts laid out as a slime checkout: every
    script is found, its MODEL_ARGS read from the sourced models file, and all accepted; a
    script passing a table flag, a literal value outside a flag's choices, a layer spec vime
    does not build, a module of slime's own vime has no counterpart of, or slime's int4 QAT
    switch in its job's environment, is refused (slime's own filter path is vime's)."""
    corpus = Path(__file__).parent / "slime_scripts"
    shutil.copytree(corpus, tmp_path / "scripts")
    ours = len(list(corpus.glob("run-*.sh")))
    (tmp_path / "scripts" / "run-fp8.sh").write_text(  # a table flag (a GPU-only format)
        "ARGS=(--fp8-format e4m3)\npython3 train.py ${ARGS[@]} --lr 1e-6\n")
    (tmp_path / "scripts" / "run-fsdp.sh").write_text(  # a value outside vime's choices
        "python3 train.py --advantage-estimator ppo --optimizer $OPT --lr 1e-6\n")
    (tmp_path / "scripts" / "run-custom.sh").write_text(  # a layer spec vime does not build
        'ARGS=(--spec "slime_plugins.models.custom" "get_custom_spec")\n'
        "python3 train.py ${ARGS[@]}\n")
    (tmp_path / "scripts" / "run-plugin.sh").write_text(  # slime's module vime has not
        "python3 train.py --rollout-function-path slime.rollout.new_rollout.generate\n")
    (tmp_path / "scripts" / "run-filter.sh").write_text(  # slime's own filter: vime's spelling
        "python3 train.py --dynamic-sampling-filter-path "
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std\n")
    (tmp_path / "scripts" / "run-int4.sh").write_text(  # slime's int4 QAT, in the Ray env
        'RUNTIME_ENV_JSON="{ \\"env_vars\\": { \\"OPEN_TRAINING_INT4_FAKE_QAT_FLAG\\": '
        '\\"1\\" } }"\npython3 train.py --lr 1e-6\n')
    result = slime_flag_coverage.coverage(slime_flag_coverage.Repo(tmp_path),
                                          slime_flag_coverage.accepted_flags())
    # (our run-glm4-9B.sh passes GLM-4's spec, from its model file: accepted)
    assert (result["scripts"], result["accepted"]) == (ours + 6, ours + 1)
    assert result["refused"] == {"--fp8-format": 1, "--advantage-estimator ppo": 1,
                                 "--spec slime_plugins.models.custom": 1,
                                 "env OPEN_TRAINING_INT4_FAKE_QAT_FLAG": 1,
                                 "--rollout-function-path slime.rollout.new_rollout.generate": 1}


def test_async_tail_summary_of_a_synthetic_run():
    """``benchmarks.async_tail`` (its runs take minutes): the latencies are the same in every
    mode for a prompt, busy time is the union of intervals, and the summary's idle fractions
    and staleness distribution follow the records."""
    from benchmarks.async_tail import (busy_seconds, distribution, engine_span,
                                       first_reaching, latency, median_rows, summarize)

    assert latency(0, 3, 5) == latency(0, 3, 5) != latency(0, 3, 6)
    assert busy_seconds([[0, 2], [1, 3], [5, 6]]) == 4
    assert engine_span([[1, 2], [4, 6]]) == 5
    assert distribution([{"staleness/0": 0.5, "staleness/1": 0.5, "num_groups": 2},
                         {"staleness/0": 1.0, "num_groups": 2}], "staleness/",
                        "num_groups") == {0: 0.75, 1: 0.25}
    records = [{"rollout_s": 1.0, "train_s": 1.0, "sync_s": 0.0, "reward_mean": 0.5,
                "num_groups": 4, "staleness/0": 0.25, "staleness/1": 0.75, "probe_gap": None,
                "tokens": 100, "token_staleness/0": 0.5, "token_staleness/1": 0.5,
                "pool_recycled": 2}
               for _ in range(3)]
    records[2]["rollout_s"] = 4.0  # a slow rollout moves the mean, not the median
    out = summarize(records, [[0.0, 1.0], [2.0, 3.0]])  # busy 2 s of its 3 s span
    assert out["wall_per_rollout_s_median"] == 2.0 and out["wall_per_rollout_s_mean"] == 3.0
    assert out["rollouts_per_s"] == 1 / 3
    assert abs(out["trainer_idle_frac"] - 2 / 3) < 1e-12
    assert abs(out["engine_idle_frac"] - 1 / 3) < 1e-12
    assert out["staleness_frac"] == {0: 0.25, 1: 0.75} and out["staleness_median"] == 1
    assert abs(out["tokens_per_s"] - 300 / 9) < 1e-12 and out["train_to_generation"] == 1.5
    assert out["token_staleness_frac"] == {0: 0.5, 1: 0.5} and out["recycled_groups"] == 2
    assert out["reward_half10"] == 0.5 and out["reaches_0.8_at"] is None
    assert first_reaching([0.0] * 5 + [1.0] * 10, 0.8) == 12  # rollouts 5-12 of 3-12 at 1
    row = {"rollouts_per_s": 5.0, "wall_per_rollout_s_mean": 0.2,
           "wall_per_rollout_s_median": 0.2, "reaches_0.8_at": 150, "load": 1.0}
    rounds = [{"sync": row, "fast": dict(row, rollouts_per_s=x, **{"reaches_0.8_at": at})}
              for x, at in ((10.0, 150), (12.5, 160), (20.0, None))]
    medians = median_rows(rounds)
    assert medians["fast"]["throughput_x_sync"] == 2.5 and medians["fast"]["loads"] == [1.0] * 3
    assert medians["fast"]["throughput_x_sync_rounds"] == [2.0, 2.5, 4.0]
    assert medians["fast"]["reaches_0.8_at"] is None  # a round never reached it
    assert medians["sync"]["throughput_x_sync"] == 1.0


def test_lr_curve_quick(capsys):
    from benchmarks import lr_curve

    out = lr_curve.main(["--quick"])
    for case in out.values():
        assert case["after"][-1] == 1e-5 and case["before"][-1] > 1e-5


def test_flops_model_balance_quick(capsys):
    from benchmarks import flops_model_balance

    out = flops_model_balance.main(["--quick", "--dp", "4"])
    assert out["the run's model"] <= out["fixed 8B proxy ratio"]


def test_stop_lengths_quick(capsys):
    from benchmarks import stop_lengths

    before, after = stop_lengths.main(["--quick"]).values()
    assert after["truncated_frac"] <= before["truncated_frac"]


def test_work_queue_model_says_when_claims_pay(capsys):
    """The model behind ``chunks_per_engine``: one claim per engine is the blocks' makespan;
    on tail-bound calls four claims cost tails, on token-bound calls they balance a straggler."""
    out = work_queue.main(["--seeds", "3", "--prompts", "256", "--n", "8"])
    assert all(r["ratio"][1] == 1.0 for r in out.values())
    assert out["tail/equal"]["ratio"][4] > 1.2
    assert out["tokens/straggler"]["ratio"][4] < 0.8
    assert out["tokens/straggler"]["engine0_share_of_even_k4"] < 0.8
    assert "[model]" in capsys.readouterr().out


def test_agent_sessions_quick(capsys):
    """The session server benchmark: every concurrent session answered, the example agent's
    executions served (timings printed, never asserted)."""
    from benchmarks import agent_sessions

    rows = {r["measure"]: r for r in agent_sessions.main(["--quick"])}
    assert rows["sessions"]["ok"] == rows["sessions"]["sessions"] == 16
    assert rows["rollout"]["executions"] == 64 and rows["rollout"]["turns"] >= 64
    assert rows["turn"]["served_ms"] > 0 and rows["turn"]["direct_ms"] > 0
