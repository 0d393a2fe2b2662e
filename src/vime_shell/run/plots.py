"""PNG plots (matplotlib, Agg backend): per-rank micro-batch loads of a step, and metric curves."""

from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np

from vime_pure.scheduling.schedule import Schedule
from vime_shell.storage.files import atomic_file

matplotlib.use("Agg")  # files only, never a window; before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402


def plot_step_loads(schedule: Schedule, path: Path, step: int = 0) -> Path:
    """Left: one bar per DP rank, stacked by micro-batch (token loads), with the mean. Right:
    every micro-batch's tokens in execution order against the token cap, so oversize
    singletons (the out-of-memory risk) show at any DP size, DP1 included."""
    lengths = np.asarray(schedule.lengths, dtype=np.int64)
    plan = schedule.steps[step]
    dp = schedule.layout.dp
    loads = np.array([[int(lengths[list(mb)].sum()) for mb in rank] for rank in plan.microbatches])
    fig, (ax, right) = plt.subplots(1, 2, figsize=(max(6.0, 0.25 * dp + 3) + 6, 4))
    _microbatch_panel(right, loads, schedule.token_cap)
    bottom = np.zeros(dp)
    colors = plt.cm.tab20(np.linspace(0, 1, max(plan.num_microbatches, 2)))
    for j in range(plan.num_microbatches):
        ax.bar(np.arange(dp), loads[:, j], bottom=bottom, color=colors[j % len(colors)],
               edgecolor="white", linewidth=0.3)
        bottom += loads[:, j]
    ax.axhline(bottom.mean(), color="black", linestyle="--", linewidth=1,
               label=f"mean {bottom.mean():,.0f} tokens")
    ax.set_xlabel("DP rank")
    ax.set_ylabel("tokens (stacked by micro-batch)")
    ax.set_title(f"step {step}: {plan.num_microbatches} micro-batches/rank, imbalance "
                 f"{bottom.max() / bottom.mean():.3f} ({schedule.policy.packing}/"
                 f"{schedule.policy.balance})")
    ax.set_xticks(np.arange(dp) if dp <= 32 else np.linspace(0, dp - 1, 9).round())
    ax.legend(loc="lower right", framealpha=0.9)
    return _save(fig, path)


def _microbatch_panel(ax, loads: np.ndarray, cap: int | None) -> None:
    """Micro-batch token counts, rank after rank (colour = rank), and the cap."""
    flat = loads.reshape(-1)
    ranks = np.repeat(np.arange(loads.shape[0]), loads.shape[1])
    colors = plt.cm.tab10(ranks % 10)
    ax.bar(np.arange(flat.size), flat, color=colors, width=0.9)
    if cap:
        over = int((flat > cap).sum())
        ax.axhline(cap, color="red", linestyle="--", linewidth=1,
                   label=f"cap {cap:,} tokens ({over} over: oversize singletons)")
        ax.legend(loc="upper right", framealpha=0.9, fontsize=8)
    ax.set_xlabel("micro-batch (rank by rank, in execution order)")
    ax.set_ylabel("tokens")
    ax.set_title(f"largest micro-batch {int(flat.max()):,} tokens")


Lines = dict[str, tuple[Sequence[float], Sequence[float]]]


def plot_curves(panels: dict[str, Lines], path: Path, xlabel: str = "rollout",
                title: str = "", log_panels: frozenset[str] = frozenset(),
                light_lines: frozenset[str] = frozenset()) -> Path:
    """One panel per entry, each with named ``(x, y)`` lines (e.g. train and eval reward), in
    rows of at most 4; panels named in ``log_panels`` use a log y axis; lines named in
    ``light_lines`` are drawn lighter, in the colour of the line before them (a spread such
    as the max over a rollout's steps, beside its mean)."""
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.3 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (name, lines) in zip(axes.flat, panels.items()):
        for label, (xs, ys) in lines.items():
            light = label in light_lines and ax.lines
            ax.plot(xs, ys, marker="." if len(lines) == 1 else "o", markersize=2 if
                    label == name else 4, linewidth=1, label=label,
                    **({"alpha": 0.4, "color": ax.lines[-1].get_color()} if light else {}))
        if len(lines) > 1:
            ax.legend(fontsize=7, framealpha=0.9)
        if name in log_panels and any(y and y > 0 for _, ys in lines.values() for y in ys):
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    """Lay out, write the PNG (creating its folder) and free the figure."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_file(path) as fh:  # a crash leaves the old plot; a FIFO is refused
            fig.savefig(fh, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path
