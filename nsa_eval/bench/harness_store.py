"""The harness's results on disk: one CSV row per figure, appended as each finishes, so a run that is
killed keeps what it measured and a second run with the same settings measures only what is missing.

A figure is one cell of the tables: a prefill (method, length, batch 1), a decode (method, length,
batch) or a generation throughput (method, prompt length, batch, new tokens). Its `status` is
- "ok": measured;
- "timeout": it ran past the per-figure cap (what finished before the cap may still be reported);
- "OOM": the GPU ran out of memory;
- "skipped": not run because its outcome was decided by another figure (`note` says which), e.g. a
  prompt whose prefill ran past the cap is not decoded from.

The folder holds `harness.json` (the settings every row depends on, and one entry per run),
`harness.csv` (append-only; a later row of the same figure replaces an earlier one) and `harness.md`
(rebuilt from the two after every figure). A folder with another run's settings is refused rather
than mixed; `--fresh` replaces these three files and nothing else.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from nsa_eval.errors import UsageError

FILES = ("harness.json", "harness.csv", "harness.md")
STATUSES = ("ok", "timeout", "OOM", "error", "skipped")


@dataclass
class Figure:
    """One measured cell (module docstring). Times in ms, memory in GiB, bytes as counts; None where
    not measured."""

    kind: str  # "prefill", "decode" or "throughput"
    method: str
    length: int  # prompt tokens
    batch: int
    status: str = "ok"
    ms: float | None = None  # prefill: per call; decode: wall time per token; throughput: per step
    calls: int | None = None  # timed prefill calls or decode rounds that finished (median over them)
    gpu_ms: float | None = None  # nsa decode: GPU time per step, from graph replays
    first_step_ms: float | None = None  # decode: the first step after the prefill (compiles, captures)
    weight_bytes: int | None = None  # decode: the model's parameters
    kv_bytes: int | None = None  # decode: keys and values one step reads per sequence (floor.py)
    bandwidth_gbs: float | None = None  # decode: the run's measured copy bandwidth
    cache_gib: float | None = None  # memory the cache holds after the prefill
    peak_gib: float | None = None  # peak memory above the weights over the prefill and the decode
    compilations: int | None = None  # Triton compilations during the timed decode
    new_tokens: int | None = None  # throughput: tokens generated per sequence
    tokens_per_s: float | None = None  # throughput: batch x new tokens / wall time
    seconds: float | None = None  # wall time the figure took, warm-up and prefill included
    warmup_s: float | None = None  # of which its warm-up (compiles, autotunes, captures), before the cap
    cap_s: float | None = None  # the cap it ran under
    note: str = ""

    @property
    def key(self) -> tuple:
        return self.kind, self.method, self.length, self.batch, self.new_tokens

    @property
    def floor_ms(self) -> float | None:
        """The decode step's memory floor (floor.py), or None where its inputs were not recorded."""
        if None in (self.weight_bytes, self.kv_bytes, self.bandwidth_gbs):
            return None
        return (self.weight_bytes + self.batch * self.kv_bytes) / (self.bandwidth_gbs * 1e9) * 1e3

    def settled(self, cap_s: float) -> bool:
        """Whether a new run under `cap_s` keeps this figure: measured, out of memory, or cut off by a
        cap at least as long (a longer cap runs it again). A figure that raised an error runs again."""
        if self.status == "error":
            return False
        return self.status in ("ok", "OOM") or (self.cap_s is not None and self.cap_s >= cap_s)


FIELDS = [f.name for f in dataclasses.fields(Figure)]
_TYPES = {f.name: f.type for f in dataclasses.fields(Figure)}


def _parse(name: str, text: str):
    kind = _TYPES[name]
    if kind == "str":
        return text
    if text == "":
        return None
    return int(text) if kind.startswith("int") else float(text)


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, then rename: a reader sees all of it or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class HarnessStore:
    """The harness files under one folder (module docstring)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.json_path, self.csv_path, self.md_path = (self.folder / name for name in FILES)

    # ---- settings
    def check(self, settings: dict, fresh: bool = False) -> None:
        """UsageError when the folder holds harness results of other settings (unless `fresh`), or is
        not a folder; nothing is written."""
        if self.folder.exists() and not self.folder.is_dir():
            raise UsageError(f"--out: {str(self.folder)!r} is a file; expected a folder")
        if fresh or not self.json_path.is_file():
            return
        earlier = self.read_json().get("settings", {})
        if earlier != settings:
            changed = ", ".join(f"{k} {earlier.get(k)!r} -> {settings.get(k)!r}"
                                for k in sorted(set(earlier) | set(settings))
                                if earlier.get(k) != settings.get(k))
            raise UsageError(f"--out: {self.folder} holds harness results of other settings ({changed}); "
                             "its rows would not compare with these: name another --out, or pass --fresh "
                             "to replace its harness files")

    def open(self, settings: dict, run: dict, fresh: bool = False, **extra) -> list[Figure]:
        """Start a run: the figures kept from earlier runs (none when `fresh`), with `run` (command,
        versions, bandwidth, ...) appended to harness.json and `extra` entries set in it."""
        self.check(settings, fresh)
        self.folder.mkdir(parents=True, exist_ok=True)
        if fresh:
            for path in (self.json_path, self.csv_path, self.md_path):
                path.unlink(missing_ok=True)
        data = self.read_json() if self.json_path.is_file() else {"settings": settings, "runs": []}
        data["runs"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), **run})
        data.update(extra)
        write_atomic(self.json_path, json.dumps(data, indent=2) + "\n")
        if not self.csv_path.is_file():
            with self.csv_path.open("w", newline="") as f:
                csv.writer(f).writerow(FIELDS)
        elif not self.csv_path.read_bytes().endswith(b"\n"):  # killed mid-row: the next row starts a line
            with self.csv_path.open("a", newline="") as f:
                f.write("\r\n")
        self._add_new_columns()
        return self.figures()

    def _add_new_columns(self) -> None:
        """Rewrite a CSV written before a column was added (a newer nsa-eval's fields left empty), so its
        figures are kept and the rows appended next line up with the header."""
        with self.csv_path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header == FIELDS:
            return
        unknown = sorted(set(header) - set(FIELDS))
        if unknown:
            raise UsageError(f"--out: {self.csv_path} has columns this nsa-eval does not write "
                             f"({', '.join(unknown)}); pass --fresh to replace its harness files, or name "
                             "another --out")
        with self.csv_path.open(newline="") as f:
            rows = [row for row in csv.DictReader(f) if None not in row.values()]
        text = io.StringIO()
        writer = csv.DictWriter(text, FIELDS, restval="")
        writer.writeheader()
        writer.writerows(rows)
        write_atomic(self.csv_path, text.getvalue())

    def read_json(self) -> dict:
        return json.loads(self.json_path.read_text())

    # ---- rows
    def append(self, figure: Figure) -> None:
        """One row, flushed to disk before the next figure starts."""
        with self.csv_path.open("a", newline="") as f:
            csv.DictWriter(f, FIELDS).writerow(dataclasses.asdict(figure))
            f.flush()

    def figures(self) -> list[Figure]:
        """Every figure on disk, the latest row of each, in the order first written."""
        if not self.csv_path.is_file():
            return []
        latest: dict[tuple, Figure] = {}
        with self.csv_path.open(newline="") as f:
            for row in csv.DictReader(f):
                if set(row) != set(FIELDS) or None in row.values():  # a row cut off by a kill mid-write
                    continue
                try:
                    figure = Figure(**{name: _parse(name, text) for name, text in row.items()})
                except ValueError:  # the same, cut inside a number
                    continue
                latest[figure.key] = figure
        return list(latest.values())
