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
    """One bar per DP rank, stacked by micro-batch (token loads), with the cap-derived mean."""
    lengths = np.asarray(schedule.lengths, dtype=np.int64)
    plan = schedule.steps[step]
    dp = schedule.layout.dp
    loads = np.array([[int(lengths[list(mb)].sum()) for mb in rank] for rank in plan.microbatches])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * dp + 3), 4))
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


Lines = dict[str, tuple[Sequence[float], Sequence[float]]]


def plot_curves(panels: dict[str, Lines], path: Path, xlabel: str = "rollout",
                title: str = "") -> Path:
    """One panel per entry, each with named ``(x, y)`` lines (e.g. train and eval reward)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5), squeeze=False)
    for ax, (name, lines) in zip(axes[0], panels.items()):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="." if len(lines) == 1 else "o", markersize=2 if
                    label == name else 4, linewidth=1, label=label)
        if len(lines) > 1:
            ax.legend(fontsize=7, framealpha=0.9)
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
