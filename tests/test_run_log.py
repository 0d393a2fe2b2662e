"""Per-rollout records, ``metrics.jsonl`` handling and the demo-curve summary, without a run.

Named examples for what users read: rewards are averaged per rollout group (a multi-turn
execution counts once), losses per group over steps; a resumed run's log drops the records at
or after the resume point; the demo curve reports when the trailing mean crossed the target.
"""

import json

import attrs
import pytest

from benchmarks.demo_curve import summarize
from vime_pure.data.batch import RolloutBatch, schedule_for
from vime_pure.config import BatchingPolicy, ParallelLayout
from vime_pure.data.sample import Sample
from vime_shell.megatron.config import StepResult
from vime_shell.run import plots
from vime_shell.run.run_log import (LIGHT_LINES, REQUIRED_KEYS, RunLogger, curve_panels,
                                    read_metrics)
from vime_shell.train.records import rollout_record


def _batch():
    def s(group, reward, n=2):
        return Sample(tokens=[3, 4] + [5] * n, response_length=n, group_id=group, reward=reward)

    # Group "a" has 3 siblings with reward 1, group "b" one sample with reward 0.
    return RolloutBatch.from_samples([[[s("a", 1.0), s("a", 1.0), s("a", 1.0, 1)], [s("b", 0.0)]]])


def _step(loss, groups):
    return StepResult(metrics={"loss": loss, "pg_loss": loss, "clipfrac": 0.0, "entropy": 2.0,
                               "kl": 0.0, "ratio": 1.0},
                      num_groups=groups, num_microbatches=1, lr=1e-3, grad_norm=0.5)


def test_record_averages_rewards_per_group_and_losses_per_group_over_steps():
    batch = _batch()
    schedule = schedule_for(batch, ParallelLayout(dp=1),
                            BatchingPolicy(global_batch_size=1, max_tokens_per_gpu=64))
    rec = rollout_record(0, batch, schedule, [_step(0.2, 3), _step(0.6, 1)], gap=1e-7,
                         gap_max=2e-7, times=(0.5, 0.25, 0.25))
    assert rec["reward_mean"] == 0.5  # per group, not 0.75 per sample
    assert rec["loss"] == pytest.approx((0.2 * 3 + 0.6) / 4)
    assert rec["num_groups"] == 2 and rec["num_samples"] == 4 and rec["num_steps"] == 2
    assert rec["num_microbatches"] == 2 and rec["tokens"] == int(batch.lengths.sum())
    assert rec["tokens_per_s"] == pytest.approx(rec["tokens"] / 1.0)
    assert set(REQUIRED_KEYS) <= set(rec)


def test_grad_norm_is_the_mean_over_the_rollouts_steps_and_grad_norm_max_their_max():
    """Four optimizer steps, the last of which had zero gradient (every advantage zero): the
    last step alone would report 0.0. A skipped step (non-finite norm) has no norm to
    average; with no updating step both are None, never NaN."""
    batch = _batch()
    schedule = schedule_for(batch, ParallelLayout(dp=1),
                            BatchingPolicy(global_batch_size=1, max_tokens_per_gpu=64))
    steps = [attrs.evolve(_step(0.1, 1), grad_norm=g) for g in (0.4, 1.2, 0.8, 0.0)]
    rec = rollout_record(0, batch, schedule, steps, gap=1e-7, gap_max=2e-7, times=(1, 1, 1))
    assert rec["grad_norm"] == pytest.approx(0.6) and rec["grad_norm_max"] == 1.2
    skipped = attrs.evolve(_step(0.1, 1), grad_norm=float("inf"), skipped=True)
    rec = rollout_record(0, batch, schedule, [*steps[:2], skipped], gap=None, gap_max=None,
                         times=(1, 1, 1))
    assert rec["grad_norm"] == pytest.approx(0.8) and rec["grad_norm_max"] == 1.2
    assert rec["skipped_steps"] == 1
    rec = rollout_record(0, batch, schedule, [skipped], gap=None, gap_max=None, times=(1, 1, 1))
    assert rec["grad_norm"] is None and rec["grad_norm_max"] is None


def test_curves_plot_the_grad_norm_mean_and_a_lighter_max(tmp_path, monkeypatch):
    records = [{"rollout": k, "reward_mean": 0.5, "grad_norm": 0.1 * k,
                "grad_norm_max": 0.3 * k} for k in range(3)]
    panels = curve_panels(records)
    assert panels["grad_norm"] == {"mean": ([0, 1, 2], [0.0, 0.1, 0.2]),
                                   "max": ([0, 1, 2], [0.0, 0.3, 0.6])}
    drawn = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.update(
        {ax.get_title(): ax.lines for ax in fig.axes}) or path)
    plots.plot_curves(panels, tmp_path / "curves.png", light_lines=LIGHT_LINES)
    mean, top = drawn["grad_norm"]
    assert (mean.get_label(), top.get_label()) == ("mean", "max")
    assert list(top.get_ydata()) == [0.0, 0.3, 0.6]
    assert top.get_alpha() < 1 and top.get_color() == mean.get_color() and mean.get_alpha() is None
    # An earlier run's records (no grad_norm_max) keep their single line.
    old = [{k: v for k, v in r.items() if k != "grad_norm_max"} for r in records]
    assert curve_panels(old)["grad_norm"] == {"grad_norm": ([0, 1, 2], [0.0, 0.1, 0.2])}


def test_resumed_log_drops_records_at_or_after_the_resume_point(tmp_path):
    first = RunLogger(tmp_path, start=0, total=3, enabled=True, progress=False)
    for k in range(3):
        first.log({**dict.fromkeys(REQUIRED_KEYS, 0.0), "rollout": k, "entropy": 1.0,
                   "grad_norm": float("nan")})
    assert [p.name for p in first.finish()] == ["curves.png"]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["grad_norm"] is None
    resumed = RunLogger(tmp_path, start=1, total=3, enabled=True, progress=False)
    assert [r["rollout"] for r in read_metrics(tmp_path)] == [0]
    with pytest.raises(KeyError, match="logprob_gap"):
        resumed.log({"rollout": 1, "reward_mean": 0.0, "loss": 0.0, "num_groups": 1,
                     "num_microbatches": 1})
    resumed.finish()
    assert not RunLogger(tmp_path / "other", start=0, total=1, enabled=False).finish()
    assert not (tmp_path / "other").exists()  # only rank 0 writes


def test_eval_lines_plot_beside_the_train_reward_and_go_to_wandb_offline(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"wandb_project": "vime-test", "wandb_group": None, "wandb_mode": "offline"}
    logger = RunLogger(tmp_path, start=0, total=2, enabled=True, progress=False, wandb=config)
    for k in range(2):
        logger.log({**dict.fromkeys(REQUIRED_KEYS, 0.5), "rollout": k,
                    **({"eval/gsm/reward_mean": 0.25} if k == 0 else {})})
    logger.log_eval(2, {"eval/gsm/reward_mean": 0.75})
    panels = curve_panels(read_metrics(tmp_path))
    assert panels["reward_mean"]["eval/gsm"] == ([0, 2], [0.25, 0.75])
    assert panels["reward_mean"]["reward_mean"] == ([0, 1], [0.5, 0.5])
    assert "loss" not in panels and panels["logprob_gap"] == {"logprob_gap": ([0, 1], [0.5, 0.5])}
    assert [p.name for p in logger.finish()] == ["curves.png"]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "an offline W&B run, no network"


def test_demo_curve_summary_finds_the_crossing():
    records = [{"reward_mean": 0.0 if k < 20 else 0.9, "rollout_s": 0.2, "train_s": 0.1,
                "sync_s": 0.1, "tokens_per_s": 1000.0} for k in range(40)]
    out = summarize(records, wall_s=40 * 0.4 + 20.0, target=0.8)
    assert out["reward_start"] == 0.0 and out["reward_end"] == pytest.approx(0.9)
    # Trailing 10-rollout means: 9 of 10 at 0.9 is 0.81 at rollout 28.
    assert out["learned_at_rollout"] == 28
    assert out["learned_at_minutes"] == pytest.approx((20.0 + 29 * 0.4) / 60)
    assert out["startup_s"] == pytest.approx(20.0)


def test_warnings_and_log_lines_print_above_the_progress_bar(tmp_path, monkeypatch):
    import io
    import logging
    import warnings

    from vime_shell.run.logs import configure_logging

    before, last_resort = warnings.showwarning, logging.lastResort
    terminal = io.StringIO()
    monkeypatch.setattr("sys.stderr", terminal)
    configure_logging("info", rank=0)  # vime's handler on this "terminal"
    monkeypatch.setattr(logging.root, "handlers", [])  # as outside pytest: the last resort
    record = {"rollout": 0, "reward_mean": 0.5, "loss": 0.0, "num_groups": 4,
              "num_microbatches": 1, "logprob_gap": 1e-7}
    logger = RunLogger(tmp_path, start=0, total=3, enabled=True, progress=True)
    logger.log(record)
    logging.getLogger("vime.train").warning("dynamic sampling kept 3/8 prompts")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library warning", UserWarning)
    logging.getLogger("some.library").warning("no handler: the last-resort one")
    logger.line("eval after rollout 0: gsm 0.250")
    logger.log({**record, "rollout": 1})
    logger.finish()
    # Each line starts at column 0 on its own (the bar is cleared first), none is glued to
    # the bar's text, and the bar is redrawn after them (1/3, then 2/3 at the bottom).
    segments = [seg for line in terminal.getvalue().split("\n") for seg in line.split("\r")]
    for text in ("vime train: dynamic sampling kept 3/8 prompts", "no handler: the last-resort "
                 "one", "vime train: eval after rollout 0: gsm 0.250"):
        assert text in segments, terminal.getvalue()
    assert any(seg.endswith("UserWarning: a library warning") for seg in segments)
    out = terminal.getvalue()
    assert out.index("last-resort") < out.rindex("2/3")
    # Afterwards nothing is routed any more: handlers and warnings are as before.
    assert warnings.showwarning is before and logging.lastResort is last_resort
