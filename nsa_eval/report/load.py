"""Read a run directory back: the manifest and every finished cell. Nothing else is consulted.

A cell counts only when `runner.cell_problem` finds it whole (its checksums match, its files parse,
every record names this cell); any other is listed in `RunData.unreadable` with the file and the
reason, and left out like a cell not yet run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from nsa_eval.errors import UsageError
from nsa_eval.runner import NOT_STARTED, cell_problem, check_run_dir


@dataclass
class CellData:
    """One finished cell: its config, lm-eval results and (lazily) its samples."""

    folder: Path
    config: dict
    results: dict

    @property
    def label(self) -> str:
        return self.config["label"]

    @property
    def model(self) -> str:
        return self.config["model"]["label"]

    @property
    def task(self) -> str:
        return self.config["task"]["label"]

    @property
    def part(self):
        """The element of the task's split list this cell ran (None when the task is not split)."""
        return self.config.get("part")

    @property
    def model_spec(self) -> dict:
        return self.config["model"]

    @property
    def task_spec(self) -> dict:
        return self.config["task"]

    def leaf_tasks(self) -> list[str]:
        """lm-eval task names with their own scores (groups left out: their rows are averages)."""
        groups = set(self.results.get("groups", {}))
        return [name for name in self.results.get("results", {}) if name not in groups]

    @cached_property
    def samples(self) -> list[dict]:
        with open(self.folder / "samples.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]


@dataclass
class RunData:
    run_dir: Path
    manifest: dict
    cells: list[CellData] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # labels of the suite's cells not done yet
    unreadable: dict[str, str] = field(default_factory=dict)  # label -> "folder: what is wrong"

    @property
    def name(self) -> str:
        return self.manifest["suite"]

    def models(self) -> list[str]:
        """Model labels in suite order, only those with at least one finished cell."""
        done = {c.model for c in self.cells}
        return [m["label"] for m in self.manifest["models"] if m["label"] in done]

    def tasks(self) -> list[str]:
        done = {c.task for c in self.cells}
        return [t["label"] for t in self.manifest["tasks"] if t["label"] in done]

    def cells_of(self, model: str, task: str) -> list[CellData]:
        """The finished cells of one (model, task): one, or one per element of a split task."""
        return [c for c in self.cells if c.model == model and c.task == task]

    def model_spec(self, model: str) -> dict:
        return next(m for m in self.manifest["models"] if m["label"] == model)

    def task_spec(self, task: str) -> dict:
        return next(t for t in self.manifest["tasks"] if t["label"] == task)


def load_run(run_dir: str | Path) -> RunData:
    """The manifest and the whole cells of `run_dir`; UsageError naming run.json when it is not one."""
    run_dir = check_run_dir(run_dir)
    manifest = _read_manifest(run_dir / "run.json")
    run = RunData(run_dir, manifest)
    for entry in manifest["cells"]:
        folder = run_dir / "cells" / entry["key"]
        problem = cell_problem(folder)
        if problem is not None:
            run.missing.append(entry["label"])
            if problem != NOT_STARTED:
                run.unreadable[entry["label"]] = f"{folder}: {problem}"
            continue
        run.cells.append(CellData(folder, json.loads((folder / "config.json").read_text(encoding="utf-8")),
                                  json.loads((folder / "results.json").read_text(encoding="utf-8"))))
    return run


def _read_manifest(path: Path) -> dict:
    """run.json, checked for what the report reads: the suite, the cells (16-hex-digit keys, so a cell
    folder cannot lie outside cells/), the models and tasks, and the report folder (a string)."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UsageError(f"{path}: cannot be read as JSON ({getattr(err, 'strerror', None) or err}); "
                         "expected the run.json that `nsa-eval run` writes") from None
    problem = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("suite"), str):
        problem = "no suite name"
    elif not isinstance(manifest.get("cells"), list) or not all(
            isinstance(c, dict) and isinstance(c.get("key"), str) and re.fullmatch(r"[0-9a-f]{16}", c["key"])
            and isinstance(c.get("label"), str) for c in manifest["cells"]):
        problem = "its cells are not a list of {key: 16 hex digits, label, ...}"
    elif not all(isinstance(manifest.get(k), list) for k in ("models", "tasks")):
        problem = "no models or tasks list"
    elif not isinstance(manifest.get("report", ""), str):
        problem = "its report folder is not a path"
    if problem:
        raise UsageError(f"{path}: not a run manifest ({problem}); expected the run.json that "
                         "`nsa-eval run` writes")
    return manifest


def report_folder(run: RunData) -> Path:
    """The report folder run.json records, relative to the run directory (an absolute path, from an
    older nsa-eval, as it stands); reports/<suite> when it records none."""
    recorded = run.manifest.get("report")
    if not recorded:
        return Path("reports") / run.name
    return Path(recorded) if Path(recorded).is_absolute() else run.run_dir / recorded
