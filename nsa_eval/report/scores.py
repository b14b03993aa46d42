"""Scores out of lm-eval results and samples: the main metric of each task, per-document values,
and a task's own score (lm-eval's group aggregate where the task is a group that has one)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nsa_eval.errors import UsageError
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


@dataclass(frozen=True)
class TaskScore:
    """One (model, task)'s score: lm-eval's group aggregate, or the unweighted mean of subtasks."""

    model: str
    task: str
    metric: str  # e.g. "acc,none"; "average" for the mean of subtasks that differ in metric
    value: float
    stderr: float | None
    n: int | None
    group: str | None  # the lm-eval group whose aggregate this is; None: mean of the subtasks
    # "size": documents pooled (weight_by_size: true); "equal": mean of subtask means; None: lm-eval's
    # group row taken as it is (its weighting could not be recovered from the subtasks)
    weighting: str | None
    weights: dict[str, float] | None  # subtask -> weight (sum 1) when weighting is known

    @property
    def description(self) -> str:
        if self.group is None:
            return "unweighted mean of the subtasks"
        how = {"size": "documents pooled (weighted by size)", "equal": "unweighted mean of the subtasks",
               None: "as lm-eval reports it"}[self.weighting]
        return f"lm-eval's `{self.group}` aggregate, {how}"


def main_metric(cell: CellData, subtask: str) -> str | None:
    """'metric,filter' of the subtask's headline number: the suite's `metric` if given, else the
    first metric lm-eval reports for it. A suite `metric` the subtask does not report is a
    UsageError naming the task, the metric and the metrics there are."""
    row = cell.results["results"].get(subtask, {})
    keys = [k for k in row if "," in k and "_stderr," not in k and _is_number(row[k])]
    wanted = cell.task_spec.get("metric")
    if wanted and keys:
        chosen = [k for k in keys if k.split(",")[0] == wanted]
        if not chosen:
            available = ", ".join(dict.fromkeys(k.split(",")[0] for k in keys))
            raise UsageError(
                f"task {cell.task!r}: the suite's metric {wanted!r} is not among the metrics lm-eval "
                f"reported for {subtask!r} ({available}) in cell {cell.label!r}; set `metric:` to one "
                "of those, or leave it out for the first one")
        keys = chosen
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


def task_score(cells: list[CellData], scores: list[Score]) -> TaskScore | None:
    """The score of one (model, task) from its subtask `scores` (None where there are none).

    Where the suite's task is an lm-eval group with an aggregate row for the subtasks' metric, the
    score is that aggregate: lm-eval's `weight_by_size` (pooled documents, or the mean of subtask
    means) is read back from the numbers, since results.json does not record it, and the score
    recomputed from the subtask scores with those weights (equal to the group row for one cell,
    and right for the parts of a split task pooled). Elsewhere it is the unweighted mean of the
    subtasks, as the NSA paper averages LongBench.
    """
    if not cells or not scores:
        return None
    first = cells[0]
    group = first.task_spec["task"]
    metrics = {s.metric for s in scores}
    subtasks = [s.subtask for s in scores]
    metric = next(iter(metrics))
    rows = [_group_row(c, group) for c in cells]
    if len(metrics) == 1 and all(r is not None and _is_number(r.get(metric)) for r in rows):
        weighting = _weighting(cells, group, metric, subtasks)
        if weighting is not None:
            raw = {s.subtask: float(s.n or 1) if weighting == "size" else 1.0 for s in scores}
            total = sum(raw.values())
            weights = {k: v / total for k, v in raw.items()}
            value = sum(weights[s.subtask] * s.value for s in scores)
            if len(cells) == 1:
                stderr = rows[0].get(_stderr_key(metric))
                stderr = float(stderr) if _is_number(stderr) else None
            elif any(s.stderr is None for s in scores):
                stderr = None
            else:
                stderr = float(np.sqrt(sum((weights[s.subtask] * s.stderr) ** 2 for s in scores)))
            return TaskScore(first.model, first.task, metric, float(value), stderr,
                             sum(s.n or 0 for s in scores) or None, group, weighting, weights)
        # lm-eval's row stands, pooled over the parts of a split task by its documents
        counts = [(r.get("sample_count") or {}).get(metric) or r.get("sample_len") or 1 for r in rows]
        value = sum(float(r[metric]) * n for r, n in zip(rows, counts, strict=True)) / sum(counts)
        stderr = rows[0].get(_stderr_key(metric)) if len(rows) == 1 else None
        return TaskScore(first.model, first.task, metric, float(value),
                         float(stderr) if _is_number(stderr) else None, int(sum(counts)), group, None, None)
    weights = {s.subtask: 1 / len(scores) for s in scores}
    return TaskScore(first.model, first.task, metric if len(metrics) == 1 else "average",
                     float(np.mean([s.value for s in scores])), None,
                     sum(s.n or 0 for s in scores) or None, None, "equal", weights)


def group_leaves(results: dict, group: str) -> list[str]:
    """The lm-eval tasks (not groups) under `group`, however deeply nested."""
    tree = results.get("group_subtasks", {})
    out: list[str] = []
    for child in tree.get(group, []):
        out += group_leaves(results, child) if child in tree else [child]
    return out


def _group_row(cell: CellData, group: str) -> dict | None:
    if group not in cell.results.get("group_subtasks", {}):
        return None
    return cell.results.get("results", {}).get(group) or cell.results.get("groups", {}).get(group)


def _weighting(cells: list[CellData], group: str, metric: str, subtasks: list[str]) -> str | None:
    """'size' or 'equal': the weighting under which every cell's group row is its leaves' aggregate;
    None when neither reproduces it (or the group aggregates other tasks than the report's rows)."""
    candidates = {"size", "equal"}
    for cell in cells:
        results = cell.results.get("results", {})
        leaves = [t for t in group_leaves(cell.results, group) if _is_number(results.get(t, {}).get(metric))]
        if sorted(leaves) != sorted(subtasks):
            return None
        values = [float(results[t][metric]) for t in leaves]
        sizes = [results[t].get("sample_len") or
                 cell.results.get("n-samples", {}).get(t, {}).get("effective") or 0 for t in leaves]
        target = float(_group_row(cell, group)[metric])
        matches = set()
        pooled = sum(v * n for v, n in zip(values, sizes, strict=True)) / sum(sizes) if sum(sizes) else None
        if pooled is not None and _close(pooled, target):
            matches.add("size")
        if _close(float(np.mean(values)), target):
            matches.add("equal")
        candidates &= matches
    if not candidates:
        return None
    return "size" if "size" in candidates else "equal"  # both: equal sizes or values, the same number


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 + 1e-7 * abs(b)


def _stderr_key(metric: str) -> str:
    name, filt = metric.split(",", 1)
    return f"{name}_stderr,{filt}"


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
