"""Scores out of lm-eval results and samples: the main metric of each task, per-document values."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nsa_eval.report.load import CellData

SKIPPED_RESULT_KEYS = ("alias", "name", "sample_len", " ")


@dataclass(frozen=True)
class Score:
    model: str
    task: str  # the suite's task label
    subtask: str  # the lm-eval task name
    metric: str  # e.g. "exact_match,none"
    value: float
    stderr: float | None
    n: int | None


def main_metric(cell: CellData, subtask: str) -> str | None:
    """'metric,filter' of the subtask's headline number: the suite's `metric` if given, else the
    first metric lm-eval reports for it."""
    row = cell.results["results"].get(subtask, {})
    keys = [k for k in row if "," in k and "_stderr," not in k and _is_number(row[k])]
    wanted = cell.task_spec.get("metric")
    if wanted:
        keys = [k for k in keys if k.split(",")[0] == wanted] or keys
    return keys[0] if keys else None


def cell_scores(cell: CellData) -> list[Score]:
    scores = []
    n_samples = cell.results.get("n-samples", {})
    for subtask in cell.leaf_tasks():
        metric = main_metric(cell, subtask)
        if metric is None:
            continue
        row = cell.results["results"][subtask]
        name, filt = metric.split(",", 1)
        stderr = row.get(f"{name}_stderr,{filt}")
        n = n_samples.get(subtask, {}).get("effective")
        scores.append(Score(cell.model, cell.task, subtask, metric, float(row[metric]),
                            float(stderr) if _is_number(stderr) else None, n))
    return scores


def doc_values(cell: CellData, subtask: str, metric: str) -> dict[int, float]:
    """doc_id -> the metric's per-document value (only numeric ones; corpus metrics have none)."""
    name, filt = metric.split(",", 1)
    out = {}
    for row in cell.samples:
        if row.get("task") == subtask and row.get("filter", "none") == filt and _is_value(row.get(name)):
            out[row["doc_id"]] = float(row[name])
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool) \
        and math.isfinite(float(value))


def _is_value(value) -> bool:
    return isinstance(value, bool) or _is_number(value)
