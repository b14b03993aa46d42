"""Loss curves of training runs on one figure (training text loss, held-out loss, NIAH probe).

    python -m nsa_eval.train.plots RUN_DIR [RUN_DIR ...] --png reports/training/loss_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def read_run(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    lines = lambda name: [json.loads(x) for x in (run_dir / name).read_text().splitlines() if x.strip()]
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "train": lines("log.jsonl"),
            "evals": lines("evals.jsonl")}


def smooth(values: list[float], window: int = 10) -> np.ndarray:
    """Trailing moving average (NaNs ignored)."""
    x = np.asarray(values, dtype=float)
    out = np.empty_like(x)
    for i in range(len(x)):
        chunk = x[max(0, i - window + 1) : i + 1]
        out[i] = np.nanmean(chunk) if np.isfinite(chunk).any() else np.nan
    return out


def plot_runs(run_dirs, png: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run_dir in run_dirs:
        run = read_run(run_dir)
        name = Path(run_dir).name  # "nsa", "full", "nsa-nowindow": the run's folder
        tokens = np.array([r["tokens"] for r in run["train"]]) / 1e6
        axes[0].plot(tokens, smooth([r["text_loss"] for r in run["train"]]), label=f"{name}: text")
        answer_loss = smooth([r["answer_loss"] for r in run["train"]])
        axes[0].plot(tokens, answer_loss, "--", label=f"{name}: NIAH answers")
        ev_tokens = np.array([e["tokens"] for e in run["evals"]]) / 1e6
        axes[1].plot(ev_tokens, [e["heldout_loss"] for e in run["evals"]], "o-", label=name)
        line, = axes[2].plot(ev_tokens, [e["probe_exact_match"] for e in run["evals"]], "o-", label=name)
        selected = [e.get("probe_needle_selected", np.nan) for e in run["evals"]]
        if np.isfinite(selected).any():  # NSA runs since the metric exists
            axes[2].plot(ev_tokens, selected, "x--", color=line.get_color(),
                         label=f"{name}: needle selected (share of layer x KV head)")
    axes[0].set(xlabel="training tokens (M)", ylabel="cross-entropy (nats/token)", title="training loss",
                yscale="log")
    axes[1].set(xlabel="training tokens (M)", ylabel="cross-entropy (nats/token)",
                title="held-out text loss (held-out files)")
    axes[2].set(xlabel="training tokens (M)", ylabel="exact match / share", ylim=(-0.05, 1.05),
                title="held-out NIAH probe (teacher-forced)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--png", required=True)
    args = p.parse_args(argv)
    plot_runs(args.runs, args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
