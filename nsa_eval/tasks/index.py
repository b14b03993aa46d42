"""lm-eval's task index with the project's tasks: task managers, and the leaf configs under a name.

Nothing here imports lm_eval until a function is called.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from nsa_eval.errors import UsageError
from nsa_eval.tasks.catalog import PROJECT_TASKS, TASKS_DIR

# lm-eval's task folders the project's groups build on (general/*.yaml; nsa_mbpp and nsa_humaneval
# are the project's own)
LM_EVAL_TASK_DIRS = ("mmlu/default", "mmlu_pro", "cmmlu", "bbh/cot_fewshot", "bbh/fewshot", "gsm8k",
                     "minerva_math", "drop")


@lru_cache(maxsize=2)
def _base_task_manager(all_lm_eval_tasks: bool):
    from lm_eval.tasks import TaskManager

    if all_lm_eval_tasks:
        return TaskManager(include_path=str(TASKS_DIR))
    import lm_eval.tasks

    lm_eval_dir = Path(lm_eval.tasks.__file__).parent
    dirs = [str(lm_eval_dir / d) for d in LM_EVAL_TASK_DIRS] + [str(TASKS_DIR)]
    return TaskManager(include_path=dirs, include_defaults=False)


def with_metadata(manager, metadata: dict[str, Any] | None):
    """A copy of `manager` that shares its (slow to build) index and gives every task `metadata`:
    lm-eval applies metadata when it builds a task, through the manager's TaskFactory."""
    from lm_eval.tasks._factory import TaskFactory

    manager = copy.copy(manager)
    manager.metadata = metadata or None
    manager._factory = TaskFactory(meta=metadata or None)
    return manager


@lru_cache(maxsize=16)
def _task_manager_for(metadata_json: str, all_lm_eval_tasks: bool):
    return with_metadata(_base_task_manager(all_lm_eval_tasks), json.loads(metadata_json))


def task_manager(metadata: dict[str, Any] | None = None, *, all_lm_eval_tasks: bool = True):
    """An lm-eval TaskManager with lm-eval's tasks and the project's (include_path=TASKS_DIR).

    `metadata` reaches every task's config (and NIAH's data builder), as `--metadata` does on
    lm-eval's command line: e.g. `{"tokenizer": "smollm2-135m", "niah_lengths": [1024, 2048]}`.
    Pass it here: `simple_evaluate` ignores its own `metadata=` when given a task manager.
    Building the index of all ~14,000 lm-eval tasks takes ~10 s once per process;
    `all_lm_eval_tasks=False` indexes only the project's tasks and the lm-eval folders they build
    on (about 1 s). Managers are cached per metadata (a metadata value that is not JSON, e.g. a
    tokenizer object, gets a fresh, uncached manager).
    """
    try:
        key = json.dumps(metadata or {}, sort_keys=True)
    except TypeError:
        return with_metadata(_base_task_manager(all_lm_eval_tasks), metadata)
    return _task_manager_for(key, all_lm_eval_tasks)


def _default_manager(names: list[str]):
    """The light index (project tasks + the lm-eval folders they use) when it covers every name."""
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


def requires_unsafe_code(task_names, manager=None) -> list[str]:
    """The requested tasks (project or lm-eval, groups and tags included) that execute model code.

    A name is listed when any leaf task under it sets `unsafe_code: true` (nsa_mbpp, lm-eval's
    mbpp and humaneval, ...), i.e. when lm-eval would refuse it without confirm_run_unsafe_code.
    Reads the task index (YAML only, nothing loads); an unknown name raises UsageError.
    """
    names = list(task_names)
    unsafe = {root for root, cfg in leaf_configs(names, manager) if cfg.get("unsafe_code")}
    return [name for name in names if name in unsafe]
