"""The report's numbers and document: scores per task and method, paired differences with bootstrap
intervals, NIAH heatmaps, score-vs-budget curves (NSA's top-n too) and activated tokens, rebuilt
from a run's cells.

The protocol and environment sections (what ran, how) are protocol.py's; writing the files is
write_report's (report/__init__.py).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from nsa_eval.report.bootstrap import paired_bootstrap
from nsa_eval.report.document import Document
from nsa_eval.report.figures import budget_plot, length_label, niah_heatmap, slug
from nsa_eval.report.load import CellData, RunData
from nsa_eval.report.protocol import environment_section, protocol_section
from nsa_eval.report.scores import Score, TaskScore, doc_values, group_scores, task_score
from nsa_eval.suite.spec import UNBUDGETED

SCALE_NOTE = ("Scores are lm-eval's own metrics on a 0-1 scale (higher is better). A task that is an "
              "lm-eval group with an aggregate is scored by that aggregate (as lm-eval weights it); "
              "other averages are unweighted means over a table's rows, as in the NSA paper.")


class ReportBuilder:
    """The report of one run: its scores, differences and rows, and the document that shows them.

    `build()` returns the Document (report.md and report.html) and fills the rows that `data()` and
    the CSV files hold; write_report writes both.
    """

    def __init__(self, run: RunData, out: Path, bootstrap: int):
        self.run, self.out, self.iters = run, out, bootstrap
        self.models = run.models()
        self.tasks = run.tasks()
        # A (model, task) with unfinished cells gets no score: part of a split task would not be
        # comparable with the whole (its cells are listed as not finished).
        unfinished = {(c["model"], c["task"]) for c in run.manifest["cells"] if c["label"] in run.missing}
        self.scores: list[Score] = []
        self.task_scores: dict[tuple[str, str], TaskScore] = {}
        for m in self.models:
            for t in self.tasks:
                if (m, t) in unfinished:
                    continue
                scores = group_scores(run.cells_of(m, t))
                self.scores += scores
                total = task_score(run.cells_of(m, t), scores)
                if total is not None:
                    self.task_scores[(m, t)] = total
        self.reference = self._reference_model()
        self.differences: list[dict] = []
        self.niah_rows: list[dict] = []
        self.activation_rows: list[dict] = []
        self.table_rows: list[dict] = []

    # ------------------------------------------------------------ the document

    def build(self) -> Document:
        run = self.run
        doc = Document(f"nsa-eval report: {run.name}")
        if run.manifest.get("description"):
            doc.para(run.manifest["description"])
        env = run.manifest.get("environment", {})
        doc.para(f"Suite `{run.manifest.get('suite_path')}` (hash `{run.manifest.get('suite_hash')}`), "
                 f"{len(run.cells)} of {len(run.cells) + len(run.missing)} cells finished; "
                 f"device {env.get('device')}; git `{env.get('git')}`. {SCALE_NOTE}")
        if run.missing:
            doc.para("**Not finished** (re-run the same command to resume): "
                     + ", ".join(f"`{m}`" + (" (unreadable)" if m in run.unreadable else "")
                                 for m in run.missing))
        if not self.scores:
            doc.para("No finished cell has a score yet.")
            return doc
        self._summary(doc)
        for task in self.tasks:
            self._task_section(doc, task)
        self._niah_section(doc)
        self._budget_section(doc)
        self._selection_sweep_section(doc)
        self._activation_section(doc)
        protocol_section(doc, self)
        environment_section(doc, run)
        doc.heading("Files")
        doc.para("Every number above is in `scores.csv`, `differences.csv`, `niah.csv`, "
                 "`activated_tokens.csv` and `report.json` beside this report; figures are in `figures/`. "
                 f"Rebuild with `nsa-eval report {run.run_dir}`.")
        return doc

    def _summary(self, doc: Document) -> None:
        doc.heading("Summary")
        rows = []
        for task in self.tasks:
            rows.append([task] + [_fmt(self._average(model, task)) for model in self.models])
        caption = ("Each task's score (its table's group score or average where it has several "
                   "subtasks); methods as columns.")
        common, averages = self._summary_average()
        if len(self.tasks) > 1 and common:
            label = ("**Average**" if len(common) == len(self.tasks) else
                     f"**Average** ({len(common)} of {len(self.tasks)} tasks, those every method has)")
            rows.append([label] + [_fmt(averages[m]) for m in self.models])
            if len(common) < len(self.tasks):
                caption += (" The average is over the tasks every method has a score for: "
                            + ", ".join(f"`{t}`" for t in common) + ".")
        elif len(self.tasks) > 1:
            caption += " No task has a score for every method, so there is no overall average."
        doc.table(["task"] + self.models, rows, caption)

    def _summary_average(self) -> tuple[list[str], dict[str, float | None]]:
        """The tasks every model has a score for, and each model's unweighted mean over them: a
        column missing a task is not averaged over fewer tasks than the others."""
        common = [t for t in self.tasks if all(self._average(m, t) is not None for m in self.models)]
        return common, {m: (float(np.mean([self._average(m, t) for t in common])) if common else None)
                        for m in self.models}

    def _task_section(self, doc: Document, task: str) -> None:
        subtasks = self._subtasks(task)
        metrics = sorted({s.metric for s in self.scores if s.task == task})
        doc.heading(f"{task}")
        models = self.models_of(task)
        rows = []
        for sub in subtasks:
            row = [sub]
            for model in models:
                score = self._score(model, task, sub)
                row.append(_fmt(score.value if score else None))
                if score:
                    self.table_rows.append({"task": task, "subtask": sub, "model": model,
                                            "metric": score.metric, "value": score.value,
                                            "stderr": score.stderr, "n": score.n})
            rows.append(row)
        total = self._task_total(task)
        if len(subtasks) > 1:
            rows.append([self._total_label(task)] + [_fmt(self._average(m, task)) for m in models])
            for m in models:
                score = self.task_scores.get((m, task))
                if score is not None:
                    self.table_rows.append({"task": task, "subtask": "average" if score.group is None
                                            else score.group, "model": m, "metric": score.metric,
                                            "value": score.value, "stderr": score.stderr, "n": score.n,
                                            "aggregate": score.description})
        n = sorted({s.n for s in self.scores if s.task == task and s.n is not None})
        how = f" The last row is {total.description}." if total is not None and len(subtasks) > 1 else ""
        doc.table(["task"] + models, rows,
                  f"Metric {', '.join(f'`{m}`' for m in metrics)}; documents per subtask: "
                  f"{', '.join(map(str, n)) or '?'}.{how}")
        self._difference_table(doc, task, subtasks)

    def _difference_table(self, doc: Document, task: str, subtasks: list[str]) -> None:
        models = self.models_of(task)
        reference = self._reference_model(models)
        if reference is None or len(models) < 2:
            return
        others = [m for m in models if m != reference]
        for i, a in enumerate(models):  # every pair goes to differences.csv
            for b in models[i + 1:]:
                self._pair(task, subtasks, a, b)
        rows = []
        for sub in subtasks + (["average"] if len(subtasks) > 1 else []):
            row = [self._total_label(task) if sub == "average" else sub]
            for model in others:
                d = self._find_difference(task, sub, reference, model)
                row.append("n/a" if d is None else _interval(d))
            rows.append(row)
        total = self._task_total(task)
        how = ""
        if len(subtasks) > 1 and total is not None:
            how = (f" The last row is the difference of the task scores ({total.description}), "
                   "resampling each subtask's documents with the same weights."
                   if total.weights is not None else
                   " lm-eval's group score could not be split into weighted subtasks, so it has no "
                   "interval (n/a).")
        doc.table(["task"] + [f"{m} - {reference}" for m in others], rows,
                  f"Difference to `{reference}` with a paired bootstrap 95% interval over the same "
                  f"documents ({self.iters} resamples); an interval that contains 0 is not a "
                  f"measurable difference.{how}")

    def _pair(self, task: str, subtasks: list[str], a: str, b: str) -> None:
        cell_a, cell_b = self.run.cells_of(a, task), self.run.cells_of(b, task)
        if not cell_a or not cell_b:
            return
        aligned = []
        for sub in subtasks:
            score = self._score(a, task, sub)
            if score is None or self._score(b, task, sub) is None:
                continue
            va, vb = doc_values(cell_a, sub, score.metric), doc_values(cell_b, sub, score.metric)
            common = sorted(set(va) & set(vb))
            if not common:
                continue
            arr_a, arr_b = np.array([va[i] for i in common]), np.array([vb[i] for i in common])
            aligned.append((sub, arr_a, arr_b))
            self._add_difference(task, sub, a, b, [arr_a], [arr_b], score.metric)
        total = self.task_scores.get((a, task))
        if len(subtasks) > 1 and len(aligned) == len(subtasks) and total is not None \
                and total.weights is not None:
            self._add_difference(task, "average", a, b, [x[1] for x in aligned], [x[2] for x in aligned],
                                 total.metric, weights=[total.weights[x[0]] for x in aligned],
                                 aggregate=total.description)

    def _add_difference(self, task, sub, a, b, arr_a, arr_b, metric, weights=None, aggregate="") -> None:
        diff, low, high = paired_bootstrap(arr_a, arr_b, iters=self.iters, seed=0, weights=weights)
        self.differences.append({"task": task, "subtask": sub, "a": a, "b": b, "metric": metric,
                                 "difference": diff, "low": low, "high": high,
                                 "n": int(sum(len(x) for x in arr_a)), "iters": self.iters,
                                 "aggregate": aggregate})

    def _find_difference(self, task, sub, a, b) -> dict | None:
        """The difference b - a, flipping a stored a - b if the pair was computed the other way."""
        for d in self.differences:
            if (d["task"], d["subtask"]) != (task, sub):
                continue
            if (d["a"], d["b"]) == (a, b):
                return d
            if (d["a"], d["b"]) == (b, a):
                return d | {"difference": _neg(d["difference"]), "low": _neg(d["high"]),
                            "high": _neg(d["low"])}
        return None

    # ------------------------------------------------------------ NIAH

    def _niah_section(self, doc: Document) -> None:
        for task in self.tasks:
            grids = {}
            for model in self.models:
                grid = self._niah_grid(self.run.cells_of(model, task))
                if grid:
                    grids[model] = grid
            if not grids:
                continue
            lengths = sorted({k[0] for g in grids.values() for k in g})
            depths = sorted({k[1] for g in grids.values() for k in g})
            doc.heading(f"Needle in a haystack: {task}")
            doc.para("Mean score per context length (columns) and needle depth (rows), one figure per "
                     "method, all on the same 0-1 colour scale.")
            paths = []
            for model, grid in grids.items():
                array = np.full((len(depths), len(lengths)), np.nan)
                for (length, depth), (total, count) in grid.items():
                    array[depths.index(depth), lengths.index(length)] = total / count
                    self.niah_rows.append({"task": task, "model": model, "context_length": length,
                                           "depth_percent": depth, "score": total / count, "n": count})
                path = self.out / "figures" / f"niah_{slug(task)}_{slug(model)}.png"
                niah_heatmap(array, lengths, depths, f"{model}: {task}", path)
                paths.append((path, f"NIAH {model}"))
            doc.images(paths)
            rows = []
            for model, grid in grids.items():
                row = [model]
                for length in lengths:
                    values = [t / c for (n, _), (t, c) in grid.items() if n == length]
                    row.append(_fmt(_mean(values)))
                rows.append(row)
            doc.table(["method"] + [length_label(n) for n in lengths], rows,
                      "Mean over depths per context length.")

    def _niah_grid(self, cells: list[CellData]) -> dict:
        """(context_length, depth_percent) -> (sum of scores, count), from samples alone."""
        grid: dict = defaultdict(lambda: [0.0, 0])
        for cell, sub in [(c, sub) for c in cells for sub in c.leaf_tasks()]:
            score = self._score(cell.model, cell.task, sub)
            if score is None:
                continue
            name, filt = score.metric.split(",", 1)
            for row in cell.samples:
                d = row.get("doc", {})
                if row.get("task") != sub or row.get("filter", "none") != filt:
                    continue
                if not isinstance(d, dict) or "context_length" not in d or "depth_percent" not in d:
                    return {}
                value = row.get(name)
                if isinstance(value, (int, float)):
                    cell_ = grid[(int(d["context_length"]), float(d["depth_percent"]))]
                    cell_[0] += float(value)
                    cell_[1] += 1
        return {k: tuple(v) for k, v in grid.items()}

    # ------------------------------------------------------------ budgets

    def _budget_section(self, doc: Document) -> None:
        specs = {m: self.run.model_spec(m) for m in self.models}
        groups = defaultdict(list)  # (pretrained, attention) -> [(budget, model)]
        for model, spec in specs.items():
            if spec.get("budget") is not None and spec["attention"] not in UNBUDGETED:
                groups[(spec["pretrained"], spec["attention"])].append((spec["budget"], model))
        if not any(len(v) > 1 for v in groups.values()):
            return
        doc.heading("Score vs budget")
        doc.para("Each sparse method at several budgets (activated tokens per query); full attention "
                 "and NSA, which have no budget, as dashed lines.")
        paths = []
        for task in self.tasks:
            curves = {}
            for (pretrained, attention), members in groups.items():
                points = [(b, self._average(m, task)) for b, m in members]
                points = [(b, s) for b, s in points if s is not None]
                if len(points) > 1:
                    one_checkpoint = len({p for p, _ in groups}) == 1
                    name = attention if one_checkpoint else f"{Path(pretrained).name}:{attention}"
                    curves[name] = points
            if not curves:
                continue
            refs = {m: self._average(m, task) for m, s in specs.items() if s["attention"] in UNBUDGETED}
            refs = {m: v for m, v in refs.items() if v is not None}
            path = self.out / "figures" / f"budget_{slug(task)}.png"
            budget_plot(curves, refs, task, "score", path)
            paths.append((path, f"score vs budget: {task}"))
        doc.images(paths)

    def _selection_sweep_section(self, doc: Document) -> None:
        """NSA's selection cut at inference: one curve per NSA checkpoint that ran at several top-n,
        the other models of each task (full attention, the baselines at their budget) as lines."""
        sweeps = defaultdict(dict)  # pretrained -> {top-n: model}
        for model in self.models:
            spec = self.run.model_spec(model)
            n = self._num_selected(model)
            if spec["attention"] == "nsa" and n is not None:
                sweeps[spec["pretrained"]].setdefault(n, model)
        sweeps = {p: dict(sorted(by_n.items())) for p, by_n in sweeps.items() if len(by_n) > 1}
        if not sweeps:
            return
        swept = {m for by_n in sweeps.values() for m in by_n.values()}
        doc.heading("NSA's selection budget")
        doc.para("The same NSA checkpoint with its top-n (selected blocks per query, the forced initial "
                 "and local blocks included) cut at inference; every other model of the task as a "
                 "dashed line. How far can selection be cut before the score goes?")
        paths = []
        for task in self.tasks:
            curves = {}
            for pretrained, by_n in sweeps.items():
                points = [(n, s) for n, m in by_n.items() if (s := self._average(m, task)) is not None]
                if len(points) > 1:
                    curves[f"{Path(pretrained).name} (NSA)" if len(sweeps) > 1 else "NSA"] = points
            if not curves:
                continue
            refs = {m: v for m in self.models_of(task)
                    if m not in swept and (v := self._average(m, task)) is not None}
            path = self.out / "figures" / f"selection_{slug(task)}.png"
            budget_plot(curves, refs, task, "score", path, xlabel="selected blocks per query (top-n)")
            paths.append((path, f"score vs NSA's top-n: {task}"))
        doc.images(paths)
        rows = []
        for by_n in sweeps.values():
            for n, model in by_n.items():
                tokens = self._mean_activated_tokens(model)
                rows.append([model, str(n), "" if tokens is None else f"{tokens:,.0f}"]
                            + [_fmt(self._average(model, task)) for task in self.tasks])
        doc.table(["model", "top-n", "activated tokens per query (mean)"] + self.tasks, rows,
                  "Each setting's score per task; activated tokens are NSA's compressed, selected and "
                  "window tokens, averaged over every query the model ran.")

    def _num_selected(self, model: str) -> int | None:
        """The top-n an NSA model ran with: as its statistics record it, else as its entry sets it."""
        for cell in self.run.cells:
            stats = (cell.results.get("nsa_eval") or {}).get("activated_tokens")
            if cell.model == model and isinstance(stats, dict):
                n = (stats.get("params") or {}).get("num_selected")
                if isinstance(n, int):
                    return n
        n = (self.run.model_spec(model).get("params") or {}).get("num_selected")
        return n if isinstance(n, int) else None

    def _mean_activated_tokens(self, model: str) -> float | None:
        """Activated tokens per query over all of the model's cells, weighted by their queries."""
        total = count = 0.0
        for cell in self.run.cells:
            stats = (cell.results.get("nsa_eval") or {}).get("activated_tokens")
            if cell.model == model and isinstance(stats, dict) and stats.get("queries"):
                total += float(stats["mean"]) * stats["queries"]
                count += stats["queries"]
        return total / count if count else None

    # ------------------------------------------------------------ activated tokens

    def _activation_section(self, doc: Document) -> None:
        columns = []  # (task, part) in suite order
        for cell in self.run.cells:
            stats = (cell.results.get("nsa_eval") or {}).get("activated_tokens")
            if not isinstance(stats, dict) or "mean" not in stats or "max" not in stats:
                continue
            decode = (stats.get("phases") or {}).get("decode") or {}
            self.activation_rows.append({
                "model": cell.model, "task": cell.task, "part": cell.part, "mean": float(stats["mean"]),
                "max": float(stats["max"]), "queries": stats.get("queries"),
                "decode_mean": decode.get("mean"), "decode_max": decode.get("max"),
                "budget": stats.get("budget") if stats.get("method") not in (None, "full") else None})
            if (cell.task, cell.part) not in columns:
                columns.append((cell.task, cell.part))
        if not self.activation_rows:
            return
        columns.sort(key=lambda c: (self.tasks.index(c[0]), _part_key(c[1])))
        doc.heading("Activated tokens per query")
        doc.para("Keys each query attended to, counted by the model during the run over all layers, "
                 "query heads and queries (prefill and decode), as mean / max. Sparse baselines count "
                 "sink and local keys; NSA counts its compressed, selected and window tokens.")
        rows = []
        for model in self.models:
            row = [model]
            for task, part in columns:
                hit = [r for r in self.activation_rows
                       if (r["model"], r["task"], r["part"]) == (model, task, part)]
                row.append(f"{hit[0]['mean']:,.0f} / {hit[0]['max']:,.0f}" if hit else "")
            rows.append(row)
        header = [task if part is None else f"{task} {_part_label(part)}" for task, part in columns]
        doc.table(["method"] + header, rows, "mean / max activated tokens per query")

    # ------------------------------------------------------------ report.json

    def data(self) -> dict:
        """Every number of the report (report.json); call after `build()`."""
        common, averages = self._summary_average()
        return {"suite": self.run.name, "suite_hash": self.run.manifest.get("suite_hash"),
                "reference": self.reference, "models": self.models, "tasks": self.tasks,
                "averages": {t: {m: self._average(m, t) for m in self.models} for t in self.tasks},
                "task_scores": {t: {m: {"value": s.value, "metric": s.metric, "stderr": s.stderr, "n": s.n,
                                        "aggregate": s.description, "weights": s.weights}
                                    for m in self.models if (s := self.task_scores.get((m, t)))}
                                for t in self.tasks},
                "summary_average": {"tasks": common, "values": averages},
                "scores": self.table_rows, "differences": self.differences, "niah": self.niah_rows,
                "activated_tokens": self.activation_rows, "missing_cells": self.run.missing,
                "unreadable_cells": self.run.unreadable,
                "environment": self.run.manifest.get("environment")}

    # ------------------------------------------------------------ helpers

    def _reference_model(self, models: list[str] | None = None) -> str | None:
        """The first full-attention model among `models` (default: all), else the first model."""
        models = self.models if models is None else models
        for model in models:
            if self.run.model_spec(model)["attention"] == "full":
                return model
        return models[0] if models else None

    def models_of(self, task: str) -> list[str]:
        """The models that ran `task`: a task limited to some models compares only those."""
        return [m for m in self.models if self.run.cells_of(m, task)]

    def _subtasks(self, task: str) -> list[str]:
        seen = []
        for s in self.scores:
            if s.task == task and s.subtask not in seen:
                seen.append(s.subtask)
        return seen

    def _score(self, model: str, task: str, subtask: str) -> Score | None:
        return next((s for s in self.scores if (s.model, s.task, s.subtask) == (model, task, subtask)), None)

    def _average(self, model: str, task: str) -> float | None:
        """The (model, task)'s score: lm-eval's group aggregate where the task has one, else the
        unweighted mean of its subtasks; None where a subtask has no score."""
        values = [self._score(model, task, sub) for sub in self._subtasks(task)]
        if not values or any(v is None for v in values):
            return None
        score = self.task_scores.get((model, task))
        return None if score is None else score.value

    def _task_total(self, task: str) -> TaskScore | None:
        return next((self.task_scores[(m, task)] for m in self.models if (m, task) in self.task_scores), None)

    def _total_label(self, task: str) -> str:
        total = self._task_total(task)
        if total is None or total.group is None:
            return "**Average**"
        return f"**{total.group}** (lm-eval group)"


def _part_key(part) -> tuple:
    return (0, part, "") if isinstance(part, (int, float)) else (1, 0, str(part))


def _part_label(part) -> str:
    return length_label(part) if isinstance(part, int) else str(part)


def _neg(value: float) -> float:
    return -value + 0.0  # + 0.0: a zero stays +0.0, not -0.0


def _signed(value: float) -> str:
    text = f"{value:+.3f}"
    return "+0.000" if text == "-0.000" else text  # a difference that rounds to zero has no sign


def _interval(d: dict) -> str:
    return f"{_signed(d['difference'])} [{_signed(d['low'])}, {_signed(d['high'])}]"


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    text = f"{value:.3f}"
    return "0.000" if text == "-0.000" else text


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None
