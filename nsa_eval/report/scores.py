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


def group_scores(cells: list[CellData]) -> list[Score]:
    """Scores of one (model, task): the parts of a split task pooled, weighted by their documents
    (exact for lm-eval's mean-aggregated metrics; the stderr of a pooled mean likewise)."""
    if not cells:
        return []
    first = cells[0]
    scores = []
    for subtask in first.leaf_tasks():
        metric = main_metric(first, subtask)
        if metric is None:
            continue
        name, filt = metric.split(",", 1)
        values, errors, counts = [], [], []
        for cell in cells:
            row = cell.results["results"].get(subtask, {})
            if not _is_number(row.get(metric)):
                break
            values.append(float(row[metric]))
            stderr = row.get(f"{name}_stderr,{filt}")
            errors.append(float(stderr) if _is_number(stderr) else None)
            counts.append(cell.results.get("n-samples", {}).get(subtask, {}).get("effective") or 1)
        else:
            total = sum(counts)
            value = sum(v * n for v, n in zip(values, counts, strict=True)) / total
            stderr = (None if None in errors else
                      float(np.sqrt(sum((e * n) ** 2 for e, n in zip(errors, counts, strict=True)))) / total)
            scores.append(Score(first.model, first.task, subtask, metric, value, stderr, total))
    return scores


def doc_values(cells: list[CellData], subtask: str, metric: str) -> dict[tuple, float]:
    """(part, doc_id) -> the metric's per-document value (numeric ones only; corpus metrics have
    none). The part keeps documents of different cells of a split task apart."""
    name, filt = metric.split(",", 1)
    out = {}
    for cell in cells:
        for row in cell.samples:
            if row.get("task") == subtask and row.get("filter", "none") == filt and _is_value(row.get(name)):
                out[(str(cell.part), row["doc_id"])] = float(row[name])
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool) \
        and math.isfinite(float(value))


def _is_value(value) -> bool:
    return isinstance(value, bool) or _is_number(value)
