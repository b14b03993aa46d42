"""Comparison reports rebuilt from a run directory's saved cells alone.

`write_report(run_dir, out_dir)` writes into out_dir (default: the suite's `report`, e.g.
reports/quickstart/):

    report.md, report.html    tables laid out like the paper's (tasks as rows, methods as columns,
                              averages), paired-bootstrap 95% intervals for differences, NIAH
                              heatmaps, score-vs-budget plots, activated tokens per query, the
                              protocol and the environment; the HTML inlines its figures
    scores.csv, differences.csv, niah.csv, activated_tokens.csv, report.json: every number shown
    figures/*.png

Building and writing are apart: builder.py computes the numbers and the document (protocol.py its
protocol and environment sections); this module writes them into a staging folder and moves it into
place, so a failed build leaves the previous report whole.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from nsa_eval.errors import UsageError, print_warning
from nsa_eval.report.bootstrap import paired_bootstrap
from nsa_eval.report.builder import ReportBuilder
from nsa_eval.report.load import load_run

__all__ = ["ReportBuilder", "load_run", "paired_bootstrap", "write_report"]

REPORT_FILES = ("report.md", "report.html", "scores.csv", "differences.csv", "niah.csv",
                "activated_tokens.csv", "report.json")


def check_bootstrap(iters) -> int:
    """The number of bootstrap resamples, or a UsageError (before any work)."""
    if isinstance(iters, bool) or not isinstance(iters, (int, np.integer)) or iters < 1:
        raise UsageError(f"--bootstrap must be an integer >= 1, got {iters!r}")
    return int(iters)


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, *, bootstrap: int = 2000,
                 warn=None) -> Path:
    """Build the report of a run directory; returns the report directory.

    The report folder is `out_dir`, else the one run.json records (relative to the run directory);
    it must be new, empty or nsa-eval's (`folders.check_folder`). Everything (figures, report.md,
    report.html, CSV, JSON) is built in a temporary folder beside it first and only then moved into
    place, so a failure leaves the previous report whole. `warn(line)` receives each cell whose files
    cannot be read (default: printed to stderr); such a cell is reported as not finished.
    """
    from nsa_eval.folders import check_folder
    from nsa_eval.report.load import report_folder

    iters = check_bootstrap(bootstrap)
    run = load_run(run_dir)
    out = check_folder(out_dir or report_folder(run), "report", "report folder")
    for label, problem in run.unreadable.items():
        (warn or print_warning)(f"cell {label} left out of the report: {problem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-{os.getpid()}-", dir=out.parent))
    try:
        (staging / "figures").mkdir()
        report = ReportBuilder(run, staging, iters)
        doc = report.build()
        (staging / "report.md").write_text(doc.markdown(staging))
        (staging / "report.html").write_text(doc.html())
        _write_data(report, staging)
        _move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _remove_stale_staging(out: Path) -> None:
    """Staging folders of report builds whose process is gone (killed mid-build)."""
    for folder in out.parent.glob(f".{out.name}.building-*"):
        pid = folder.name.rsplit(".building-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _move_into_place(staging: Path, out: Path) -> None:
    """Move a built report over `out`: figures first, then the files that point at them; PNGs of
    cells no longer in the suite go."""
    from nsa_eval.folders import claim_folder

    claim_folder(out, "report")
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    built = {p.name for p in (staging / "figures").glob("*.png")}
    for name in sorted(built):
        os.replace(staging / "figures" / name, figures / name)
    for stale in figures.glob("*.png"):
        if stale.name not in built:
            stale.unlink()
    for name in REPORT_FILES:
        os.replace(staging / name, out / name)


def _write_data(report: ReportBuilder, out: Path) -> None:
    """Every number of a built report as CSV (one file per table) and report.json."""
    _write_csv(out / "scores.csv", report.table_rows)
    _write_csv(out / "differences.csv", report.differences)
    _write_csv(out / "niah.csv", report.niah_rows)
    _write_csv(out / "activated_tokens.csv", report.activation_rows)
    (out / "report.json").write_text(json.dumps(report.data(), indent=1, default=str))


def _write_csv(path: Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row)) or ["empty"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
