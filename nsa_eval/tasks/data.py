"""The data the requested tasks read: found through lm-eval's task index, checked on disk, fetched.

`check_task_data(names)` raises one UsageError before a model loads when the hub is offline and a
task's files are missing from the local folder (local_data.py); `fetch(names)` writes them. Both walk
lm-eval's task index (groups, tags, per-member overrides) to find each leaf task's dataset, so they
know what a group such as `nsa_mmlu` (57 subjects) needs without loading it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nsa_eval.errors import UsageError
from nsa_eval.tasks.index import leaf_configs
from nsa_eval.tasks.local_data import (
    DataSpec,
    data_dir,
    hub_offline,
    missing_data_message,
    spec_from_config,
    write_jsonl,
)


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
