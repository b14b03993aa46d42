"""Hashes that name a cell's folder: stable JSON hashes, the versions and the include_path contents.

What goes into a cell's identity is decided by `ModelSpec.identity`, `TaskSpec.identity` and
`Cell.identity` (spec.py); this module turns it into the same key on every machine.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from nsa_eval.folders import MARKER


def stable_hash(obj: Any) -> str:
    """sha256 of sorted-key JSON: the same inputs give the same folder on every machine."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def versions_that_change_numbers() -> dict:
    """Package versions hashed into every cell, so an upgrade recomputes instead of mixing."""
    return {package: package_version(package) for package in ("nsa-eval", "lm-eval")}


def package_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def include_path_fingerprint(include_path: tuple[str, ...]) -> str:
    """A short content hash of the include_path directories, so an edited task YAML (or a .py,
    .txt or .json file it reads) gets new cells instead of resuming old ones. Per directory, in
    order (lm-eval reads them in order): every regular file below it as (path relative to it,
    sha256 of its bytes), sorted. Left out: what no task reads but changes on its own (hidden
    files and folders such as .git or an editor's swap files, __pycache__ and *.pyc) and nsa-eval's
    own outputs (a folder holding run.json or report.json), so `include_path: .` still resumes; but
    every task YAML lm-eval indexes (`task_yaml_paths`) is in, hidden folders included.
    Relative paths keep the keys when the project moves."""
    listing = []
    for root in include_path:
        paths = set()
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not _unread_by_tasks(Path(folder, d)))
            paths.update(Path(folder, n) for n in names if not n.startswith(".") and not n.endswith(".pyc"))
        paths.update(p for p in task_yaml_paths(root)
                     if not any(_is_output(Path(root, d)) for d in p.relative_to(root).parents if d.parts))
        files = [(p.relative_to(root).as_posix(), _file_sha256(p)) for p in paths if p.is_file()]
        listing.append(sorted(files))
    return stable_hash(listing)[:16]


def task_yaml_paths(root: str | os.PathLike) -> list[Path]:
    """The *.yaml files lm-eval's task index reads under `root`: its glob, hidden folders included,
    less the two folder names it skips."""
    return sorted(p for p in Path(root).glob("**/*.yaml")
                  if not ({"__pycache__", ".ipynb_checkpoints"} & set(p.parts)) and not p.is_dir())


def _unread_by_tasks(folder: Path) -> bool:
    return folder.name.startswith(".") or folder.name == "__pycache__" or _is_output(folder)


def _is_output(folder: Path) -> bool:
    """A folder nsa-eval wrote (a run's cells or a report): its contents change with every run."""
    return any((folder / name).is_file() for name in (MARKER, "run.json", "report.json"))


def _file_sha256(path: Path) -> str:
    """sha256 of a file read in 1 MiB blocks: a 2 GB data file costs time, not memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
