"""Tables of ``benchmarks.peer_trl``: rows over seeds, ratios vime/TRL, per-step breakdown.

Over seeds, every timing is the median of the per-seed values (one seed: that seed's value) and
"learned at" lists every seed's step. A ratio is vime's value over TRL's from the same
invocation: ``x4.23`` seconds per step means vime takes 4.23 times as long; tokens/s ``x0.24``
means vime trains 0.24 times as many tokens per second.

Example: per-seed s/step 0.30, 0.32, 0.31 aggregate to 0.31; learned at 139, 154 and None print
as ``139, 154, -``.
"""

import statistics

TIMINGS = ("seconds_per_step", "tokens_per_s", "cpu_seconds_per_step", "startup_s", "wall_s",
           "train_wall_s", "teardown_s", "cpu_s")
PARTS = ("rollout", "old_logprob", "train", "sync", "other")
LABELS = {"vime-demo": "vime demo", "vime-1024": "vime, 1024 budget", "trl": "TRL"}


def aggregate(runs: list[dict]) -> dict:
    """One row from its per-seed summaries (see the module docstring)."""
    row = {k: _median([r[k] for r in runs]) for k in TIMINGS}
    row["breakdown"] = {p: None if runs[0]["breakdown"][p] is None else
                        statistics.median(r["breakdown"][p] for r in runs) for p in PARTS}
    row["learned_at"] = [r["learned_at"] for r in runs]
    row["tokens_per_step"] = statistics.median(r["tokens_per_step"] for r in runs)
    row["seeds"] = [r["seed"] for r in runs]
    return row


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _learned(values: list) -> str:
    return ", ".join("-" if v is None else str(v) for v in values)


def _fmt(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if key == "tokens_per_s" else (
        f"{value:.3f}" if "per_step" in key else f"{value:.1f}")


def report(result: dict) -> str:
    """The two markdown tables and a line on the machine's load."""
    rows = result["rows"]
    names = list(rows)
    vimes = [n for n in names if n != "trl"]
    ratio_cols = [n for n in vimes if "trl" in rows]
    head = ["", *(LABELS[n] for n in names), *(f"{LABELS[n]} / TRL" for n in ratio_cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    titles = {"seconds_per_step": "seconds per step (median)",
              "tokens_per_s": "tokens/s (median)",
              "cpu_seconds_per_step": "CPU seconds per step (median)",
              "startup_s": "startup, launch to step 0 (s)",
              "wall_s": "wall, launch to exit (s)",
              "train_wall_s": "train wall, step 0 to last (s)",
              "teardown_s": "teardown, last step to exit (s)",
              "cpu_s": "CPU seconds, launch to exit"}
    for key, title in titles.items():
        cells = [_fmt(key, rows[n][key]) for n in names]
        cells += [f"x{rows[n][key] / rows['trl'][key]:.2f}" if rows["trl"][key] and
                  rows[n][key] is not None else "-" for n in ratio_cols]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    learned = [_learned(rows[n]["learned_at"]) for n in names] + ["" for _ in ratio_cols]
    lines.append(f"| step where the 10-step mean reward reaches {result['target']} "
                 f"(seeds {', '.join(map(str, result['seeds']))}) | " + " | ".join(learned)
                 + " |")
    lines.append("| tokens per step (median, prompt + completion) | "
                 + " | ".join(f"{rows[n]['tokens_per_step']:.0f}" for n in names)
                 + " |" + " |" * len(ratio_cols))
    lines += ["", "Per-step breakdown, median seconds (share of the median step):", "",
              ("| | rollout (gen + reward + batch) | old log-probs | train | weight sync "
               "| other | step |"), "|---|---|---|---|---|---|---|"]
    for n in names:
        b, step = rows[n]["breakdown"], rows[n]["seconds_per_step"]
        cells = ["(in train)" if b[p] is None else f"{b[p]:.3f} ({100 * b[p] / step:.0f}%)"
                 for p in PARTS]
        lines.append(f"| {LABELS[n]} | " + " | ".join(cells) + f" | {step:.3f} |")
    m = result["machine"]
    lines += ["", (f"{result['steps']} steps per run; {m['cpus']} CPUs, OMP_NUM_THREADS="
                   f"{m['omp_num_threads']}, load average {m['load_before'][0]:.1f} before, "
                   f"{m['load_after'][0]:.1f} after ({m['date']}). Runs are sequential on a "
                   "shared machine: compare ratios within one invocation only.")]
    return "\n".join(lines)
