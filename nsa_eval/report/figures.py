"""PNG figures: NIAH heatmaps (one per method, one colour scale) and score-vs-budget curves (the
baselines' budgets, NSA's selected blocks)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


def length_label(tokens: int) -> str:
    return f"{tokens / 1024:g}k" if tokens >= 1024 and tokens % 128 == 0 else str(tokens)


def niah_heatmap(grid: np.ndarray, lengths: list[int], depths: list[float], title: str, path: Path) -> Path:
    """Draw one method's retrieval grid.

    Args:
        grid: `[len(depths), len(lengths)]` mean score in [0, 1]; NaN where no document was run.
        lengths: context lengths in tokens (columns); depths: needle depth in percent (rows).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.1 + 0.62 * len(lengths), 0.9 + 0.42 * len(depths)), dpi=110)
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=10)
    if grid.size <= 150:
        for (i, j), value in np.ndenumerate(grid):
            if np.isfinite(value):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, fraction=0.05, pad=0.03, label="score")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def budget_plot(curves: dict[str, list[tuple[int, float]]], references: dict[str, float], title: str,
                ylabel: str, path: Path, xlabel: str = "budget (activated tokens per query)") -> Path:
    """Score vs budget, one line per method; methods run at one setting as dashed lines.

    Args:
        curves: method -> [(budget, score), ...], budget on a log2 axis (activated tokens per query,
            or NSA's selected blocks per query); references: label -> score (full attention, NSA).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 3.6), dpi=110)
    for method, points in curves.items():
        points = sorted(points)
        ax.plot([b for b, _ in points], [s for _, s in points], marker="o", label=method)
    for i, (label, score) in enumerate(references.items()):
        ax.axhline(score, linestyle="--", color=f"C{len(curves) + i}", label=label)
    ax.set_xscale("log", base=2)
    budgets = sorted({b for points in curves.values() for b, _ in points})
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
