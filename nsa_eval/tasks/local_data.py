"""The local folder of benchmark data: where each hub dataset's splits live, and reading them.

Every hub-backed task the project runs is built as `LocalFirstTask` (local_task.py; the
project's YAMLs and groups set `class: !function nsa_eval.tasks.local_task.LocalFirstTask`). It reads

    $NSA_EVAL_DATA/<hub path, "/" -> "__">/<config or "default">/<split>.jsonl

(default `~/.cache/nsa-eval/data`), rows in the dataset's own schema, one JSON object per line.
When those files are missing it loads from the hub like any lm-eval task, unless the hub is
offline (`HF_HUB_OFFLINE=1` or `HF_DATASETS_OFFLINE=1`): then one `UsageError` names the task,
the files expected and the `nsa-eval data fetch` command that writes them (data.py finds, checks
and fetches what a task needs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DATA_DIR = "~/.cache/nsa-eval/data"
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


def data_dir() -> Path:
    """The local data directory: $NSA_EVAL_DATA, else ~/.cache/nsa-eval/data."""
    return Path(os.environ.get("NSA_EVAL_DATA") or DEFAULT_DATA_DIR).expanduser()


def hub_offline() -> bool:
    """True when the Hugging Face hub must not be contacted."""
    truthy = {"1", "true", "yes", "on"}
    return any(
        os.environ.get(name, "").strip().lower() in truthy
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


@dataclass(frozen=True)
class DataSpec:
    """One hub dataset (path, config) and the splits a task reads from it."""

    task: str  # the leaf lm-eval task that reads it
    path: str  # hub path, e.g. "cais/mmlu"
    name: str | None  # hub config, e.g. "abstract_algebra"; None for the default config
    splits: tuple[str, ...]

    @property
    def folder(self) -> Path:
        return data_dir() / self.path.replace("/", "__") / (self.name or "default")

    def files(self) -> list[Path]:
        return [self.folder / f"{split}.jsonl" for split in self.splits]

    def missing(self) -> list[Path]:
        return [f for f in self.files() if not f.is_file()]


# --------------------------------------------------------------------------- loading


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows to path atomically (temporary name, then rename). Returns the row count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
            count += 1
    tmp.replace(path)
    return count


def load_local(spec: DataSpec):
    """The spec's splits as a datasets.DatasetDict, read from the local JSONL files."""
    import datasets

    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list(read_jsonl(f))
            for split, f in zip(spec.splits, spec.files(), strict=True)
        }
    )


def missing_data_message(missing: dict[str, list[Path]], requested: Iterable[str]) -> str:
    """One message naming each task with missing files, the files, and the fetch command."""
    lines = [f"benchmark data is not on disk and the Hugging Face hub is offline (data dir: {data_dir()})"]
    for task, files in missing.items():
        shown = ", ".join(str(f) for f in files[:4])
        more = f" and {len(files) - 4} more" if len(files) > 4 else ""
        lines.append(f"  task {task}: expected {shown}{more}")
    lines.append(
        f"fetch it on a machine with network: `nsa-eval data fetch {' '.join(requested)}` "
        "(set NSA_EVAL_DATA to choose the folder, then copy it here)"
    )
    return "\n".join(lines)


def spec_from_config(config: Any) -> DataSpec | None:
    """The hub dataset a task config reads, or None when it builds or points at its own data."""
    # a YAML dict, or lm-eval's TaskConfig (a dataclass that also subclasses dict: use attributes)
    get = config.get if type(config) is dict else lambda k, d=None: getattr(config, k, d)
    path = get("dataset_path")
    if get("custom_dataset") or not path or path in {"json", "csv", "parquet", "arrow", "text"}:
        return None
    splits = [s for key in SPLIT_KEYS if (s := get(key))]
    fewshot = get("fewshot_config")  # its `split` wins over fewshot_split (lm-eval's FewshotConfig)
    fewshot = fewshot if isinstance(fewshot, dict) else vars(fewshot) if fewshot is not None else {}
    if fewshot.get("split"):
        splits.append(fewshot["split"])
    splits = tuple(dict.fromkeys(splits))
    name = get("dataset_name") or None
    return DataSpec(task=str(get("task")), path=str(path), name=name, splits=splits)
