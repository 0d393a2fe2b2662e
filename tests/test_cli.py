"""The ``vime`` command line: ``vime schedule`` (table output, JSONL input, JSON stats and clear
errors), what ``vime demo`` launches, and how ``vime train``'s process ends (even when a plugin
left a thread running)."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vime_shell.cli import train as train_cmd
from vime_shell.cli.launch_verdict import Verdict, agree, settle, where
from vime_shell.cli.main import main
from vime_shell.engines.reaper_mark import ENDS_PROCESS, REAPER_NAME
from vime_shell.storage.locks import lock_holder, read_owner

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_schedule_synthetic_prints_table(capsys):
    rc = main(["schedule", "--synthetic", "--num-groups", "70", "--fanout", "agentic8",
               "--global-batch-size", "32", "--dp", "4", "--max-tokens-per-gpu", "16384",
               "--balance-data"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "mb/rank" in out and "tok imb" in out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2  # 70 groups -> 2 full steps of 32
    assert "dropped: 6 groups" in out


def test_schedule_jsonl_and_json_stats(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    rows = [{"length": 100 * (i % 5 + 1), "group_id": f"g{i // 2}"} for i in range(16)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out_json = tmp_path / "stats.json"
    rc = main(["schedule", "--input", str(path), "--global-batch-size", "8", "--dp", "2",
               "--max-tokens-per-gpu", "600", "--json", str(out_json)])
    assert rc == 0
    stats = json.loads(out_json.read_text())
    assert stats[0]["num_groups"] == 8 and stats[0]["num_samples"] == 16
    assert stats[0]["over_cap_multi"] == 0
    assert "trained: 8 groups in 1 steps" in capsys.readouterr().out


def test_schedule_errors_are_one_line_with_fix(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"length": 10}\n')
    assert main(["schedule", "--input", str(path), "--global-batch-size", "1", "--dp", "1",
                 "--micro-batch-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1" in err and "Fix:" in err
    assert main(["schedule", "--synthetic", "--global-batch-size", "8", "--dp", "2",
                 "--vpp", "2", "--max-tokens-per-gpu", "100"]) == 2
    assert "microbatch_group" in capsys.readouterr().err


def test_demo_is_train_with_the_default_config(monkeypatch):
    # The loop itself runs in tests/shell/test_train_loop.py; here: what `vime demo` launches.
    from vime_shell.run import driver as train_loop
    from vime_shell.settings.train_config import TrainConfig

    seen = []
    monkeypatch.setattr(train_loop, "run_training", lambda cfg, plan=None: seen.append(cfg) or
                        train_loop.TrainResult(records=[], plots=[], hf_checkpoint=None,
                                               start_rollout=0))
    assert main(["demo"]) == 0
    assert main(["demo", "--num-rollout", "5"]) == 0
    dumps = "runs/demo/rollouts/rollout_{rollout_id}.npz"
    assert main(["demo", "--max-tokens-per-gpu", "512"]) == 0
    # reruns move the old one aside; vime train's own default run dir is another one
    demo = dict(save_rollout_data=dumps, overwrite_run_dir=True, run_dir="runs/demo")
    assert TrainConfig().run_dir != "runs/demo"
    assert seen == [TrainConfig(**demo, max_tokens_per_gpu=96),
                    TrainConfig(num_rollout=5, **demo, max_tokens_per_gpu=96),
                    TrainConfig(**demo, max_tokens_per_gpu=512)]


@pytest.mark.parametrize("argv", [["schedule", "--synthetic", "--dp", "2"]])
def test_missing_global_batch_size(argv, capsys):
    assert main(argv) == 2
    assert "--global-batch-size" in capsys.readouterr().err


def test_schedule_reads_rollout_dump(tmp_path, capsys):
    from vime_pure import RolloutBatch, Sample
    from vime_shell.storage.dump import save_rollout_batch

    output = [[Sample(tokens=[1] * (3 + p + k), response_length=2, reward=float(k % 2),
                      group_id=f"p{p}-{k}", prompt_group=p) for k in range(4)] for p in range(4)]
    path = save_rollout_batch(tmp_path / "rollout_0.npz", RolloutBatch.from_samples(output))
    rc = main(["schedule", "--input", str(path), "--global-batch-size", "8", "--dp", "2",
               "--max-tokens-per-gpu", "16", "--json", str(tmp_path / "s.json")])
    assert rc == 0
    stats = json.loads((tmp_path / "s.json").read_text())
    assert [s["num_groups"] for s in stats] == [8, 8]
    assert sum(s["num_samples"] for s in stats) == 16
    assert "16 samples in 16 groups" in capsys.readouterr().out


def test_schedule_balance_flag_selects_straggler(tmp_path):
    out = tmp_path / "s.json"
    assert main(["schedule", "--synthetic", "--num-groups", "256", "--global-batch-size", "128",
                 "--dp", "8", "--max-tokens-per-gpu", "32768", "--balance", "straggler",
                 "--json", str(out)]) == 0
    stats = json.loads(out.read_text())
    assert len(stats) == 2 and all(s["over_cap_multi"] == 0 for s in stats)
    assert all(s["flops_imbalance"] >= s["flops_imbalance_bound"] - 1e-9 for s in stats)


def test_without_torchrun_each_failing_rank_reports_its_own_error(monkeypatch):
    """No agent store to agree through (``spawn``, a plain launcher): a failing rank speaks for
    itself, unprefixed, since it cannot know whether rank 0 failed too."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    verdict = agree(failed=True)
    assert verdict.speaker == 1 and where(verdict) == ""
    with pytest.raises(ValueError, match="bad"):
        settle(ValueError("bad"))
    settle(None)  # a rank that passed goes on


def test_the_speaker_is_the_lowest_failed_rank_else_the_lowest_that_posted():
    assert Verdict(rank=2, world=4, failed=(1, 3)).speaker == 1
    assert Verdict(rank=2, world=4, missing=(0, 3)).speaker == 1
    assert Verdict(rank=2, world=4).passed


LINGERING_PLUGIN = '''
import threading

def reward(sample):
    if not any(t.name == "my-plugin-poller" for t in threading.enumerate()):
        threading.Thread(target=threading.Event().wait, name="my-plugin-poller").start()
    return float(sample.metadata["response"] == sample.metadata["label"])

def failing_reward(sample):
    reward(sample)
    raise RuntimeError("grader offline")
'''


@pytest.mark.slow
@pytest.mark.parametrize("fn, status", [("reward", 0), ("failing_reward", 2)])
def test_vime_train_exits_although_a_plugin_left_a_thread_running(tmp_path, fn, status):
    """A reward that starts a non-daemon thread (never ending) used to keep `vime train` alive
    after `done`: now it exits with the run's status, naming the thread in one warning, its
    run directory unlocked (the owner record stays)."""
    (tmp_path / "lingering.py").write_text(LINGERING_PLUGIN)
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{SRC}", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "vime_shell.cli", "train", "--num-rollout", "2",
                           "--run-dir", str(run), "--custom-rm-path", f"lingering:{fn}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == status, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "still running" in line]
    assert len(warnings) == 1 and "'my-plugin-poller'" in warnings[0]
    assert f"exiting with status {status}" in warnings[0]
    assert lock_holder(run) is None and read_owner(run) is not None


def test_the_health_reaper_is_not_reported_as_a_plugins_thread():
    """After a health verdict vime's own reaper (not a daemon: it ends the rank after the main
    thread) is running; the exit's warning names plugin threads only (it named the reaper, and
    the rank exited before its reaper let every rank read the verdict)."""
    stop = threading.Event()
    reaper = threading.Thread(target=stop.wait, name=REAPER_NAME)
    setattr(reaper, ENDS_PROCESS, True)
    plugin = threading.Thread(target=stop.wait, name="my-plugin-poller")
    reaper.start()
    plugin.start()
    try:
        names = [t.name for t in train_cmd._lingering()]
        assert "my-plugin-poller" in names and REAPER_NAME not in names
    finally:
        stop.set()
        reaper.join()
        plugin.join()
