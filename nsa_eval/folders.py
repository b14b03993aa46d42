"""The folders nsa-eval writes: whose they are, one writer at a time, and what a crash leaves.

nsa-eval writes and deletes only inside folders it made. A folder it makes gets a marker file,
`.nsa-eval`, naming what it holds (`run` cells or a `report`). Before anything is written:

- `check_folder(path, kind, where)` refuses the filesystem root, the home folder and the current
  directory itself, a path that is a file, a folder of another kind, and an existing folder without
  the marker (unless it is empty, or holds only the files an older nsa-eval wrote there). A folder
  that does not exist yet must be creatable: its nearest existing parent is probed (a folder made
  and removed at once), so a read-only mount or /proc fails here, not after a model has loaded.
- `claim_folder(path, kind)` creates the folder (or adopts an empty or older one) and writes the
  marker.
- `RunLock(run_dir)` lets one process at a time write a run folder: an advisory `flock` on
  `.nsa-eval.lock`, which the kernel releases when its holder dies (a `kill -9` leaves no stale
  lock), holding the holder's pid, host, start time and command for the message of a second run.
- `remove_stale_temporaries(run_dir)` removes the `.NAME.tmp-PID` files an interrupted write leaves
  (called under the lock, when no other writer can be mid-write).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from nsa_eval.errors import UsageError

MARKER = ".nsa-eval"
LOCK_FILE = ".nsa-eval.lock"
KINDS = ("run", "report")
# What an nsa-eval from before the marker left in its folders: such a folder is adopted, not refused.
_OLDER_RUN_ENTRIES = {"run.json", "suite.yaml", "cells", "report"}
_OLDER_REPORT_ENTRIES = {"report.md", "report.html", "scores.csv", "differences.csv", "niah.csv",
                         "activated_tokens.csv", "report.json", "figures"}
_EXPECTED = "a new folder, an empty one, or one nsa-eval made"


def check_folder(path: str | os.PathLike, kind: str, where: str) -> Path:
    """The folder `path` as a Path (~ expanded), or a UsageError naming `where` (the key or flag that
    chose it).

    `kind` is "run" (a run's cells) or "report". Nothing is written but a probe folder that is
    removed at once, and only where `path` does not exist yet.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    text = os.fspath(path)
    folder = Path(text or ".").expanduser()
    resolved = folder.resolve()
    if not text.strip() or resolved == Path.cwd().resolve():
        raise UsageError(f"{where}: {text!r} is the current directory itself; nsa-eval writes its {kind} "
                         f"into a folder of its own: name a subfolder, e.g. {_example(kind)}")
    if resolved == Path(resolved.anchor):
        raise UsageError(f"{where}: {text!r} is the filesystem root; name a folder of its own, e.g. "
                         f"{_example(kind)}")
    if resolved == Path.home().resolve():
        raise UsageError(f"{where}: {text!r} is your home folder; name a folder of its own, e.g. "
                         f"{_example(kind)}")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{where}: {text!r} is a file; expected a directory (or a path that does not "
                         "exist yet)")
    if folder.is_dir():
        owner = folder_kind(folder)
        if owner is None and not _adoptable(folder, kind):
            raise UsageError(f"{where}: {text!r} already exists and was not made by nsa-eval (no {MARKER} "
                             f"file in it); nsa-eval would overwrite or delete files there. Expected "
                             f"{_EXPECTED}: name another folder, or empty this one")
        if owner is not None and owner != kind:
            raise UsageError(f"{where}: {text!r} is an nsa-eval {owner} folder, not a {kind} folder; "
                             f"name another folder for the {kind}")
        return folder
    _probe_creatable(folder, where)
    return folder


def check_output_folders(folders: list[tuple[str, str | os.PathLike, str]]) -> None:
    """`check_folder` for each (where, path, kind), and no two of them the same folder (a report
    written into the run folder would mix with the cells)."""
    seen: dict[Path, str] = {}
    for where, path, kind in folders:
        resolved = check_folder(path, kind, where).expanduser().resolve()
        if resolved in seen:
            raise UsageError(f"{where}: {os.fspath(path)!r} is also {seen[resolved]}; expected separate "
                             "folders for the run's cells and its report (e.g. runs/NAME and reports/NAME)")
        seen[resolved] = where
    return None


def folder_kind(folder: Path) -> str | None:
    """"run" or "report" when `folder` holds nsa-eval's marker, else None."""
    try:
        with open(Path(folder) / MARKER, encoding="utf-8") as f:
            kind = json.loads(f.read(4096)).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in KINDS else None


def claim_folder(path: str | os.PathLike, kind: str) -> Path:
    """Create `path` (and its parents) or adopt it, and write the marker; see `check_folder`."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if folder_kind(folder) != kind:
        marker = {"made_by": "nsa-eval", "kind": kind,
                  "note": f"nsa-eval writes its {kind} here and may replace or delete files in this folder"}
        (folder / MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
    return folder


def is_writable(folder: Path) -> bool:
    """Whether files can be created in the existing `folder` (no read-only mount, permission)."""
    try:
        probe = tempfile.mkdtemp(prefix=".nsa-eval-probe-", dir=folder)
    except OSError:
        return False
    os.rmdir(probe)
    return True


def _adoptable(folder: Path, kind: str) -> bool:
    """An empty folder, or one holding only what an older nsa-eval (before the marker) wrote."""
    entries = {p.name for p in folder.iterdir() if not _left_by_nsa_eval(p.name)}
    if not entries:
        return True
    if kind == "run":
        return "run.json" in entries and entries <= _OLDER_RUN_ENTRIES
    figures = folder / "figures"
    return ("report.json" in entries and entries <= _OLDER_REPORT_ENTRIES
            and (not figures.is_dir() or all(p.suffix == ".png" for p in figures.iterdir())))


def _left_by_nsa_eval(name: str) -> bool:
    """The marker, the lock and what an interrupted write or probe leaves: not a user's file."""
    return name in (MARKER, LOCK_FILE) or name.startswith(".nsa-eval-probe-") or (
        name.startswith(".") and ".tmp-" in name)


def _probe_creatable(folder: Path, where: str) -> None:
    """UsageError unless a folder can be made where `folder` will be (its nearest existing parent)."""
    parent = folder.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{where}: cannot create {str(folder)!r}: {parent} is a file; expected a path "
                         "under a directory")
    try:
        probe = tempfile.mkdtemp(prefix=".nsa-eval-probe-", dir=parent)
    except OSError as err:
        raise UsageError(f"{where}: cannot create {str(folder)!r}: {parent} does not take new folders "
                         f"({err.strerror}); expected a writable location") from None
    os.rmdir(probe)


def _example(kind: str) -> str:
    return "runs/NAME" if kind == "run" else "reports/NAME"


class RunLock:
    """One writer per run folder: `with RunLock(run_dir): ...` or UsageError naming the holder.

    The lock is `flock` on `run_dir/.nsa-eval.lock`: the kernel drops it when the process holding it
    exits, however it exits, so the file left behind by a killed run locks nothing.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self._file = None

    def __enter__(self) -> RunLock:
        import fcntl

        file = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = _describe_holder(file.read(4096))
            file.close()
            raise UsageError(f"{self.path.parent} is in use by another nsa-eval run ({holder}); one run "
                             "writes a run folder at a time: wait for it to finish, or stop it") from None
        except BaseException:
            file.close()
            raise
        file.seek(0)
        file.truncate()
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                               "command": " ".join(sys.argv)}) + "\n")
        file.flush()
        self._file = file
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor releases the flock
            self._file = None


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return (f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: "
                f"`{holder['command']}`")
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove the `.NAME.tmp-PID` files of writes that never finished; returns what was removed.

    Call it only under `RunLock`: then no other process can be writing them."""
    removed = []
    for pattern in (".*.tmp-*", "cells/*/.*.tmp-*"):
        for path in Path(run_dir).glob(pattern):
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except FileNotFoundError:
                continue
            removed.append(path)
    return removed
