"""Read a run directory back: the manifest and every finished cell. Nothing else is consulted."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from nsa_eval.runner import CELL_FILES, check_run_dir


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
    run_dir = check_run_dir(run_dir)
    manifest = json.loads((run_dir / "run.json").read_text())
    run = RunData(run_dir, manifest)
    for entry in manifest["cells"]:
        folder = run_dir / "cells" / entry["key"]
        if not all((folder / name).is_file() for name in CELL_FILES):
            run.missing.append(entry["label"])
            continue
        run.cells.append(CellData(folder, json.loads((folder / "config.json").read_text()),
                                  json.loads((folder / "results.json").read_text())))
    return run
