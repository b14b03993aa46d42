"""Benchmark data on local disk first, the Hugging Face hub second.

Every hub-backed task the project runs is built as `LocalFirstTask` (local_task.py; the
project's YAMLs and groups set `class: !function nsa_eval.tasks.local_task.LocalFirstTask`). It reads

    $NSA_EVAL_DATA/<hub path, "/" -> "__">/<config or "default">/<split>.jsonl

(default `~/.cache/nsa-eval/data`), rows in the dataset's own schema, one JSON object per line.
When those files are missing it loads from the hub like any lm-eval task, unless the hub is
offline (`HF_HUB_OFFLINE=1` or `HF_DATASETS_OFFLINE=1`): then one `UsageError` names the task,
the files expected and the `nsa-eval data fetch` command that writes them.

`check_task_data(names)` raises that error before a model loads; `fetch(names)` writes the files.
Both walk lm-eval's task index (groups, tags, per-member overrides) to find each leaf task's
dataset, so they know what a group such as `nsa_mmlu` (57 subjects) needs without loading it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nsa_eval.errors import UsageError

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


# --------------------------------------------------------------------------- walking the index


def _default_manager(names: list[str]):
    """The light index (project tasks + the lm-eval folders they use) when it covers every name."""
    from nsa_eval.tasks import PROJECT_TASKS, task_manager

    return task_manager(all_lm_eval_tasks=not all(name in PROJECT_TASKS for name in names))


def leaf_configs(names: Iterable[str], manager=None) -> list[tuple[str, dict[str, Any]]]:
    """(requested name, merged leaf config) for every leaf task under the given names.

    Walks groups and tags as lm-eval's TaskFactory does (group-level keys and per-member dict
    overrides flow down to the leaves) but reads YAML with functions unresolved, so nothing loads.
    """
    from lm_eval.tasks._factory import GROUP_FIELD_NAMES
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    names = list(names)
    index = (manager or _default_manager(names)).task_index
    out: list[tuple[str, dict[str, Any]]] = []

    def visit(root: str, name: str, overrides: dict[str, Any], seen: tuple[str, ...]) -> None:
        entry = index.get(name)
        if entry is None:
            raise UsageError(f"unknown task {name!r} (not in lm-eval's index nor the project's tasks)")
        if name in seen:
            return
        if entry.kind == Kind.TAG:
            for child in sorted(entry.tags):
                visit(root, child, overrides, seen + (name,))
            return
        cfg = load_yaml(entry.yaml_path, resolve_func=False) if entry.yaml_path else dict(entry.cfg or {})
        if entry.kind == Kind.GROUP:
            merged = {**{k: v for k, v in cfg.items() if k not in GROUP_FIELD_NAMES}, **overrides}
            visit_members(root, cfg.get("task") or [], merged, seen + (name,))
            return
        out.append((root, {**cfg, **overrides, "task": overrides.get("task", cfg.get("task", name))}))

    def visit_members(root: str, items: list, merged: dict[str, Any], seen: tuple[str, ...]) -> None:
        for item in items:
            if isinstance(item, str):
                visit(root, item, merged, seen)
            elif isinstance(item.get("task"), list):  # an inline sub-group: {group: name, task: [...]}
                extra = {k: v for k, v in item.items() if k not in GROUP_FIELD_NAMES}
                visit_members(root, item["task"], {**merged, **extra}, seen)
            elif "task" in item or "group" in item:
                child = item.get("task") or item.get("group")
                extra = {k: v for k, v in item.items() if k not in ("task", "group")}
                if child in index:
                    visit(root, child, {**merged, **extra}, seen)
                else:  # an inline task defined inside the group
                    out.append((root, {**merged, **item}))

    for name in names:
        visit(name, name, {}, ())
    return out


def is_local_first(task_class: Any) -> bool:
    """True when a config's `class` is LocalFirstTask or a subclass (e.g. mbpp.MbppTask).

    `task_class` is the class itself, or, from YAML read with functions unresolved, the string
    "<yaml dir>/<module>.<name>".
    """
    from nsa_eval.tasks.local_task import LocalFirstTask

    if isinstance(task_class, type):
        return issubclass(task_class, LocalFirstTask)
    ref = str(task_class or "").rsplit("/", 1)[-1]
    if ref.endswith("LocalFirstTask"):
        return True
    module, _, name = ref.rpartition(".")
    if not module.startswith("nsa_eval."):  # only the project's own classes are imported here
        return False
    import importlib

    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return False
    return isinstance(found, type) and issubclass(found, LocalFirstTask)


def data_specs(names: Iterable[str], manager=None) -> dict[str, list[DataSpec]]:
    """requested name -> the hub datasets its LocalFirstTask leaves read (deduplicated)."""
    specs: dict[str, list[DataSpec]] = {}
    for root, cfg in leaf_configs(names, manager):
        bucket = specs.setdefault(root, [])
        if not is_local_first(cfg.get("class")):
            continue  # lm-eval's own loader: it never reads the local folder
        spec = spec_from_config(cfg)
        if spec is not None and all((s.path, s.name) != (spec.path, spec.name) for s in bucket):
            bucket.append(spec)
    return specs


def missing_task_data(task_names: Iterable[str], manager=None) -> dict[str, list[Path]]:
    """requested name -> the local files its LocalFirstTask leaves read that are not on disk (only
    names with missing files). Reads the task index and the data folder; nothing loads."""
    missing: dict[str, list[Path]] = {}
    for root, specs in data_specs(list(task_names), manager).items():
        files = [f for spec in specs for f in spec.missing()]
        if files:
            missing[root] = files
    return missing


def hub_loaded_tasks(task_names: Iterable[str], manager=None) -> list[str]:
    """The requested names with a leaf that loads a hub dataset through lm-eval's own loader (not
    LocalFirstTask): their data cannot be fetched into, or checked in, the local folder."""
    hub = {root for root, cfg in leaf_configs(list(task_names), manager)
           if not is_local_first(cfg.get("class")) and spec_from_config(cfg) is not None}
    return [name for name in dict.fromkeys(task_names) if name in hub]


def check_task_data(task_names: Iterable[str], manager=None) -> None:
    """Raise one UsageError, before any model loads, when offline and a task's data is missing.

    Online, missing files are fine: the tasks fall back to the hub.
    """
    names = list(task_names)
    if not hub_offline():
        return
    missing = missing_task_data(names, manager)
    if missing:
        raise UsageError(missing_data_message(missing, list(missing)))


def task_data_warnings(task_names: Iterable[str], manager=None) -> list[str]:
    """What `validate` says about the tasks' data before anything loads, one line each.

    Offline, missing files are check_task_data's UsageError. Online, each task with files missing
    is named (the hub will be read when it loads), and so, either way, is each task that lm-eval
    loads from the hub itself, which no local file can stand in for.
    """
    names = list(task_names)
    missing = missing_task_data(names, manager)
    if missing and hub_offline():
        raise UsageError(missing_data_message(missing, list(missing)))
    warnings = []
    for task, files in missing.items():
        warnings.append(f"task {task}: {len(files)} data file(s) not on disk under {data_dir()} (e.g. "
                        f"{files[0]}): the hub will be read when it loads; `nsa-eval data fetch {task}` "
                        "fetches them now, for offline runs")
    for task in hub_loaded_tasks(names, manager):
        warnings.append(f"task {task}: lm-eval loads its data from the hub (or the hub's local cache) "
                        "itself, so nsa-eval cannot fetch or check it; offline it runs only if that "
                        "cache holds it (the project's tasks, `nsa-eval data list`, read the local folder)")
    return warnings


def download(spec: DataSpec, *, force: bool = False, log=print) -> list[Path]:
    """Load one dataset with `datasets.load_dataset` and write its splits as JSONL. Returns the files."""
    if not force and not spec.missing():
        return []
    import datasets

    loaded = datasets.load_dataset(spec.path, spec.name)
    written = []
    for split, path in zip(spec.splits, spec.files(), strict=True):
        if split not in loaded:
            raise UsageError(f"{spec.path} ({spec.name}) has no split {split!r}; it has {list(loaded)}")
        count = write_jsonl(path, loaded[split])
        written.append(path)
        log(f"{spec.task}: wrote {count} rows to {path}")
    return written


def fetch(task_names: Iterable[str], *, force: bool = False, manager=None, log=print) -> list[Path]:
    """Download every hub dataset the tasks read into data_dir() as JSONL. Returns files written."""
    names = list(task_names)
    if hub_offline():
        raise UsageError("`nsa-eval data fetch` needs the network; unset HF_HUB_OFFLINE/HF_DATASETS_OFFLINE")
    written: list[Path] = []
    seen: set[tuple[str, str | None]] = set()
    for root, specs in data_specs(names, manager).items():
        if not specs:
            log(f"{root}: builds its own data (or reads the hub itself): nothing to fetch")
        for spec in specs:
            if (spec.path, spec.name) not in seen:
                seen.add((spec.path, spec.name))
                written += download(spec, force=force, log=log)
    return written
