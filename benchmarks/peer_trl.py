"""vime against TRL's ``GRPOTrainer`` on the same job, side by side (issue 16).

The job: the embedded demo model (same weights, same 19-token tokenizer), reverse2 with an
exact-match reward, 16 prompts x 8 samples per step, lr 3e-4 constant, clip 0.2, no KL, one
optimizer step per batch, CPU, ``OMP_NUM_THREADS=1``. Both frameworks see **the same prompt
strings in the same order**: the harness draws step ``k``'s prompts with vime's task
(``get_task("reverse2").examples(16, seed=S, rollout_id=k)``, what ``vime train --seed S``
draws itself) and feeds TRL that list as an unshuffled dataset; after the runs it checks TRL's
per-step prompts and vime's rollout dumps against it. Sampled completions differ (each framework
has its own RNG stream), so reward curves are compared over seeds, not step by step.

Rows, each run as a user would, in its own subprocess (startup included):

- ``vime-demo``: ``vime demo`` (96-token micro-batch budget: 7 micro-batches per step);
- ``vime-1024``: ``vime demo --max-tokens-per-gpu 1024`` (one micro-batch per step);
- ``trl``: ``benchmarks/peer_trl_runner.py`` in the TRL venv (``make .venv-trl``; settings
  there: fp32, no gradient checkpointing, constant lr, 128 completions per step).

Measured per run (definitions shared by both frameworks):

- **s/step**: median wall time between the ends of consecutive steps (everything the loop
  does, logging included). vime: when each ``metrics.jsonl`` line was written (the file's
  mtime, polled every 10 ms); TRL: ``time.time()`` at ``on_step_end``. Step 0 counts from its
  own start (vime: end minus ``rollout_s + train_s + sync_s``; TRL: ``on_step_begin``);
- **tokens/s**: median over steps of (prompt + completion tokens trained in the step) / s/step;
- **CPU s/step**: median CPU time of the process (all threads) between step ends: less noisy
  than wall time when other jobs share the cores (vime: ``/proc/<pid>/stat`` read when each
  line is seen, 10 ms ticks; TRL: ``time.process_time()``); **CPU s**: the whole run's, from
  the kernel's accounting of the finished child;
- **startup**: launch of the subprocess to the start of step 0 (imports, model load, engine);
- **wall**: launch to exit; **train wall**: start of step 0 to end of the last step;
- **learned at**: first step whose trailing 10-step mean reward reaches ``--target`` (0.8);
- **breakdown** (median s per step): rollout (generation, reward, batch building; vime's
  ``rollout_s``, TRL's ``_generate_and_score_completions``), old log-probs (vime's
  ``old_logprob_s`` when the metrics have it, taken as part of ``train_s``; TRL computes none
  on-policy), train, weight sync (TRL generates with the training model: none), other (the
  step's wall time outside those: logging, the loop itself). Each part is its own median over
  steps, so the parts need not add up to the median step.

Ratios are vime/TRL from the same invocation (run one after another; the machine is shared, so
compare only within one invocation). JSON with every run's per-step data: ``--out``.

Run: ``make bench-peer`` (300 steps, seed 0), ``make bench-peer PEER_ARGS=--quick`` (10 steps),
``OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.peer_trl --seeds 0 1 2``.
"""

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.demo_curve import learned_at
from benchmarks.peer_trl_report import aggregate, report

ROOT = Path(__file__).resolve().parent.parent
ROWS = {"vime-demo": [], "vime-1024": ["--max-tokens-per-gpu", "1024"], "trl": None}
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, TASK = 16, 8, "reverse2"
POLL_S = 0.01


def draw_prompts(seed: int, steps: int) -> list[list[tuple[str, str]]]:
    """Per step, the ``(prompt, label)`` pairs vime draws. Example: ``[[("47>", "74"), ...]]``."""
    from vime_shell.rollout.tasks import get_task

    task = get_task(TASK)
    return [[(e.prompt, e.label) for e in task.examples(PROMPTS_PER_STEP, seed=seed,
                                                         rollout_id=k)] for k in range(steps)]


def _env(vime: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               HF_HUB_OFFLINE="1")
    if vime:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                           env.get("PYTHONPATH")]))
    else:
        env.pop("PYTHONPATH", None)  # the TRL venv must not see vime
    return env


def run_vime(extra: list[str], seed: int, steps: int, run_dir: Path) -> dict:
    """``vime demo`` in a subprocess; per-step rows from ``metrics.jsonl`` as it is written."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a stale metrics.jsonl would be read as ours
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "vime_shell.cli.main", "demo", "--run-dir", str(run_dir),
           "--seed", str(seed), "--num-rollout", str(steps), *extra]
    with open(run_dir.with_suffix(".log"), "w") as log:
        cpu0, launch = _children_cpu(), time.time()
        proc = subprocess.Popen(cmd, env=_env(True), stdout=log, stderr=subprocess.STDOUT,
                                cwd=ROOT)
        records, stamps, cpus = _follow(proc, run_dir / "metrics.jsonl")
        end, cpu = time.time(), _children_cpu() - cpu0
    _check_exit(proc, cmd, run_dir.with_suffix(".log"))
    rows = []
    for k, (rec, stamp) in enumerate(zip(records, stamps)):
        timed = rec["rollout_s"] + rec["train_s"] + rec["sync_s"]
        start = rows[-1]["end"] if rows else stamp - timed
        cpu_s = cpus[k] - cpus[k - 1] if k and None not in (cpus[k], cpus[k - 1]) else None
        old = rec.get("old_logprob_s")  # None until the loop reports it (then inside train_s)
        rows.append(dict(step=k, start=start, end=stamp, wall_s=stamp - start,
                         tokens=rec["tokens"], reward=rec["reward_mean"],
                         rollout_s=rec["rollout_s"], old_logprob_s=old,
                         train_s=rec["train_s"] - (old or 0.0), sync_s=rec["sync_s"],
                         other_s=(stamp - start) - timed, cpu_s=cpu_s))
    return dict(cmd=cmd, launch=launch, exit=end, cpu_s=cpu, steps=rows, run_dir=str(run_dir),
                microbatches=records[0]["num_microbatches"] if records else None)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for children only
    return usage.ru_utime + usage.ru_stime


def _proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) of a running process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _follow(proc: subprocess.Popen, path: Path) -> tuple[list[dict], list[float], list]:
    """Read ``path``'s JSON lines while ``proc`` runs; stamp each when it was written.

    The stamp is the file's mtime when one new line is found (exact to the kernel's clock tick,
    whatever the poll latency); when several lines arrived in one poll, the poll time. With each
    line, the process's CPU time when it was seen (None after the process ended).
    """
    records, stamps, cpus, buf, fh = [], [], [], b"", None
    try:
        while True:
            running = proc.poll() is None
            if fh is None and path.exists():
                fh = open(path, "rb")  # noqa: SIM115 (once it exists; closed below)
            if fh is not None:
                buf += fh.read()
                *lines, buf = buf.split(b"\n")
                if lines:
                    stamp = os.fstat(fh.fileno()).st_mtime if len(lines) == 1 else time.time()
                    cpu = _proc_cpu(proc.pid) if running else None
                    for line in filter(None, lines):
                        records.append(json.loads(line))
                        stamps.append(stamp)
                        cpus.append(cpu)
            if not running:
                return records, stamps, cpus
            time.sleep(POLL_S)
    finally:
        if fh is not None:
            fh.close()


def run_trl(python: str, model_dir: Path, prompts: list, seed: int, work: Path,
            settings: list[str]) -> dict:
    """The TRL runner in its venv; per-step rows from its step log."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with open(work / "prompts.jsonl", "w") as f:
        for k, step in enumerate(prompts):
            for prompt, label in step:
                f.write(json.dumps({"step": k, "prompt": prompt, "label": label}) + "\n")
    # -P: the script's folder (benchmarks/: modules named metrics, table...) stays off sys.path.
    cmd = [python, "-P", str(ROOT / "benchmarks" / "peer_trl_runner.py"), "--model-dir",
           str(model_dir), "--prompts", str(work / "prompts.jsonl"), "--steps-out",
           str(work / "steps.jsonl"), "--output-dir", str(work / "out"), "--seed", str(seed),
           "--max-steps", str(len(prompts)), "--prompts-per-step", str(PROMPTS_PER_STEP),
           "--num-generations", str(SAMPLES_PER_PROMPT)]
    cmd += [a for s in settings for a in ("--set", s)]
    with open(work.with_suffix(".log"), "w") as log:
        cpu0, launch = _children_cpu(), time.time()
        proc = subprocess.run(cmd, env=_env(False), stdout=log, stderr=subprocess.STDOUT,
                              check=False)  # _check_exit reports the log's tail instead
        end, cpu = time.time(), _children_cpu() - cpu0
    _check_exit(proc, cmd, work.with_suffix(".log"))
    lines = [json.loads(x) for x in (work / "steps.jsonl").read_text().splitlines() if x]
    meta, steps = lines[0], lines[1:]
    rows, seen = [], []
    for s in steps:
        start = rows[-1]["end"] if rows else s["t_begin"]
        inside = s["t_end"] - s["t_begin"]
        rows.append(dict(step=s["step"], start=start, end=s["t_end"], wall_s=s["t_end"] - start,
                         tokens=s["tokens"], reward=s["reward"], rollout_s=s["rollout_s"],
                         generate_s=s["generate_s"], old_logprob_s=0.0,
                         train_s=inside - s["rollout_s"], sync_s=0.0,
                         other_s=(s["t_end"] - start) - inside,
                         cpu_s=s["cpu_end"] - (rows[-1]["cpu_end"] if rows else s["cpu_begin"]),
                         cpu_end=s["cpu_end"]))
        seen.append(s["prompts"])
    return dict(cmd=cmd, launch=launch, exit=end, cpu_s=cpu, steps=rows, meta=meta,
                prompts_seen=seen)


def _check_exit(proc, cmd: list[str], log: Path) -> None:
    if proc.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{' '.join(cmd)}\nexited with {proc.returncode}; log {log}:\n{tail}")


def vime_prompts(run_dir: Path, model_dir: Path, steps: int) -> list[list[str]]:
    """The prompt strings vime trained on, per step, decoded from its rollout dumps."""
    from vime_shell.models.tokenizer import load_tokenizer
    from vime_shell.storage.dump import load_rollout_batch

    tok = load_tokenizer(model_dir)
    out = []
    for k in range(steps):
        b = load_rollout_batch(run_dir / "rollouts" / f"rollout_{k}.npz")
        firsts = [list(b.prompt_groups).index(g) for g in sorted(set(b.prompt_groups.tolist()))]
        out.append([tok.decode(b.sample_tokens(i)[:b.prompt_lengths[i]]) for i in firsts])
    return out


def summarize(run: dict, target: float) -> dict:
    """One run's numbers (see the module docstring). Example: steps ending 0.1 s apart give
    ``seconds_per_step == 0.1``; 640 tokens each give ``tokens_per_s == 6400``."""
    steps = run["steps"]
    cpu = [s["cpu_s"] for s in steps if s["cpu_s"] is not None]
    rewards = [s["reward"] for s in steps]

    def med(key: str) -> float:
        return statistics.median(s[key] for s in steps)

    return {
        "steps": len(steps), "seconds_per_step": med("wall_s"),
        "tokens_per_step": med("tokens"),
        "tokens_per_s": statistics.median(s["tokens"] / s["wall_s"] for s in steps),
        "cpu_seconds_per_step": statistics.median(cpu) if cpu else None, "cpu_s": run["cpu_s"],
        "startup_s": steps[0]["start"] - run["launch"], "wall_s": run["exit"] - run["launch"],
        "train_wall_s": steps[-1]["end"] - steps[0]["start"],
        "teardown_s": run["exit"] - steps[-1]["end"],
        "learned_at": learned_at(rewards, target),
        "reward_start": statistics.fmean(rewards[:10]),
        "reward_end": statistics.fmean(rewards[-10:]),
        "breakdown": {k: None if steps[0][k + "_s"] is None else med(k + "_s")
                      for k in ("rollout", "old_logprob", "train", "sync", "other")},
        "reward_curve": rewards, "step_wall_s": [round(s["wall_s"], 5) for s in steps],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_trl",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--quick", action="store_true", help="smoke size: 10 steps, one seed")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a GRPOConfig field, e.g. bf16=True (TRL's default)")
    parser.add_argument("--work-dir", default="runs/peer_trl")
    parser.add_argument("--out", default="benchmarks/results/peer_trl.json")
    args = parser.parse_args(argv)
    steps, seeds = (10, args.seeds[:1]) if args.quick else (args.steps, args.seeds)
    if "trl" in args.rows and not Path(args.trl_python).exists():
        raise SystemExit(f"no TRL venv at {args.trl_python}: run `make .venv-trl` first")
    from vime_shell.models.embedded import build_embedded

    model_dir = build_embedded()  # built before any run, so no startup pays for it
    work, runs = Path(args.work_dir).resolve(), {row: [] for row in args.rows}
    load_before = os.getloadavg()
    for seed in seeds:
        prompts = draw_prompts(seed, steps)
        for row in args.rows:
            print(f"peer_trl: seed {seed}, {row}, {steps} steps ...", file=sys.stderr, flush=True)
            load = os.getloadavg()[0]
            if row == "trl":
                run = run_trl(args.trl_python, model_dir, prompts, seed, work / f"trl-s{seed}",
                              args.trl_set)
                ok = run.pop("prompts_seen") == [[p for p, _ in st] for st in prompts]
            else:
                run = run_vime(ROWS[row], seed, steps, work / f"{row}-s{seed}")
                ok = vime_prompts(Path(run["run_dir"]), model_dir, steps) == [
                    [p for p, _ in st] for st in prompts]
            if not ok:
                raise SystemExit(f"{row} seed {seed} trained on other prompts than drawn")
            summary = summarize(run, args.target)
            summary.update(seed=seed, load_at_start=load, cmd=run["cmd"],
                           **({"trl": run["meta"]} if row == "trl" else
                              {"microbatches_per_step": run["microbatches"]}))
            runs[row].append(summary)
            print(f"peer_trl:   {summary['seconds_per_step']:.3f} s/step, "
                  f"{summary['tokens_per_s']:.0f} tokens/s, startup {summary['startup_s']:.1f} s, "
                  f"wall {summary['wall_s']:.1f} s, learned at {summary['learned_at']}",
                  file=sys.stderr, flush=True)
    result = {"steps": steps, "seeds": seeds, "target": args.target, "prompts_identical": True,
              "rows": {row: aggregate(rs) for row, rs in runs.items()}, "runs": runs,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_before": load_before, "load_after": os.getloadavg(),
                          "omp_num_threads": _env(True)["OMP_NUM_THREADS"],
                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}}
    print(report(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"peer_trl: wrote {out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
