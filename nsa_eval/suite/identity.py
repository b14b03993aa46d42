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
    own outputs (a folder holding run.json or report.json), so `include_path: .` still resumes.
    Relative paths keep the keys when the project moves."""
    listing = []
    for root in include_path:
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not _unread_by_tasks(Path(folder, d)))
            for name in names:
                path = Path(folder, name)
                if not name.startswith(".") and not name.endswith(".pyc") and path.is_file():
                    files.append((path.relative_to(root).as_posix(), _file_sha256(path)))
        listing.append(sorted(files))
    return stable_hash(listing)[:16]


def _unread_by_tasks(folder: Path) -> bool:
    return (folder.name.startswith(".") or folder.name == "__pycache__" or (folder / MARKER).is_file()
            or (folder / "run.json").is_file() or (folder / "report.json").is_file())


def _file_sha256(path: Path) -> str:
    """sha256 of a file read in 1 MiB blocks: a 2 GB data file costs time, not memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
