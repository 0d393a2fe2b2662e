"""Markdown tables of a benchmark result, and the README update between two markers."""

from pathlib import Path


def _fmt_ms(row) -> str:
    return "-" if row is None else f"{row['wall_ms']:.0f} ({row['cpu_ms']:.0f})"


def tables(result: dict) -> str:
    rows = result["rows"]
    index = {(r["layout"], r["policy"], r["size"]): r for r in rows}
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    big = next((s for s in ("64k", "16k", "4k", "1k") if s in sizes), sizes[0])
    m = result["machine"]
    out = [f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, numpy {m['numpy']}, "
           f"{m['date']}; load average {m['load_avg_start'][0]:.1f} at start, "
           f"{m['load_avg_end'][0]:.1f} at end (other jobs shared the cores).", "",
           "Times are medians in ms, wall (CPU in brackets). Quality columns at "
           f"N={big}: micro-batches over the aligned lower bound; per-step imbalance "
           "max/mean rank load, mean / worst step, tokens and FLOPs (lower bound: mean "
           f"{_mean(rows, big, 'flops_bound_mean'):.3f}); speed-up: wall time vs the naive reference "
           "at the largest N where it ran; vs pure: the compiled kernels (vime[fast]) against the "
           "pure-Python ones, same run; +mb/rank: most extra micro-batches "
           "per rank in a step vs ffd/strided; viol: multi-sample micro-batches over the cap. "
           "Batches under 8192 samples run the pure-Python kernels (registry.COMPILED_MIN_SAMPLES), "
           "larger ones the compiled kernels when numba is installed.", ""]
    head = ["layout", "policy", *[f"t@{s}" for s in sizes], "speed-up (N)", f"vs pure@{big}",
            "mb vs bound",
            "tok imb", "FLOPs imb", "+mb/rank", "viol"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lay in layouts:
        base = index.get((lay, "ffd/strided", big))
        for pol in policies:
            r = index.get((lay, pol, big))
            if r is None:
                continue
            extra = "-" if base is None else str(max(
                a - b for a, b in zip(r["mb_per_rank"], base["mb_per_rank"])))
            speed = _speedup(rows, lay, pol)
            out.append("| " + " | ".join([
                lay, pol, *[_fmt_ms(index.get((lay, pol, s))) for s in sizes], speed,
                f"x{r['pure']['speedup']:.1f}" if r.get("pure") else "-",
                f"+{r['mb_over_aligned_pct']:.2f}%",
                f"{r['tok_imb_mean']:.3f} / {r['tok_imb_worst']:.3f}",
                f"{r['flops_imb_mean']:.3f} / {r['flops_imb_worst']:.3f}", extra,
                str(r["cap_violations"])]) + " |")
    out += ["", _reference_table(rows)]
    return "\n".join(out)


def _speedup(rows, layout: str, policy: str) -> str:
    """Wall-time speed-up over the reference at the largest size where the reference ran."""
    timed = [r for r in rows if r["layout"] == layout and r["policy"] == policy
             and "speedup" in r and not r["size"].startswith("step")]
    return f"x{timed[-1]['speedup']:.0f} ({timed[-1]['size']})" if timed else "-"


def _mean(rows, size, key) -> float:
    vals = [r[key] for r in rows if r["size"] == size]
    return sum(vals) / len(vals) if vals else float("nan")


def _reference_table(rows) -> str:
    """The naive anchor-style reference at the largest size where it ran, per layout/policy."""
    best = {}
    for r in rows:
        if "reference" in r:
            best[(r["layout"], r["policy"])] = r  # rows come in increasing size
    head = ["layout", "policy", "N", "reference ms", "vime ms", "speed-up (wall / CPU)",
            "reference FLOPs imb", "vime FLOPs imb", "reference viol"]
    out = ["Reference (naive, anchor-style) at the largest N it ran:", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (lay, pol), r in best.items():
        ref = r["reference"]
        out.append("| " + " | ".join([
            lay, pol, r["size"], f"{ref['wall_ms']:.0f}", f"{r['wall_ms']:.1f}",
            f"x{r['speedup']:.0f} / x{r['cpu_speedup']:.0f}",
            f"{ref['flops_imb_mean']:.3f} / {ref['flops_imb_worst']:.3f}",
            f"{r['flops_imb_mean']:.3f} / {r['flops_imb_worst']:.3f}",
            str(ref["cap_violations"])]) + " |")
    return "\n".join(out)


def update_readme(path: Path, result: dict, start: str, end: str) -> None:
    """Replace the text between ``start`` and ``end`` (appending both when absent)."""
    text = path.read_text() if path.exists() else ""
    block = f"{start}\n{tables(result)}\n{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
