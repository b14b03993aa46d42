"""A suite's task index: the project's and lm-eval's tasks plus its include_path folders, read safely.

- `suite_task_manager(include_path)`: the lm-eval TaskManager a suite's task names are looked up in,
  built once per process and include_path.
- `check_include_path_files(suite)`: every task YAML lm-eval will read there is a bounded regular
  file; a task that runs Python code (`!function`) is named in a warning.
- `check_shadowed_tasks(suite)`: an include_path task may not take the name of an existing one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nsa_eval.errors import UsageError
from nsa_eval.suite.identity import task_yaml_paths
from nsa_eval.suite.safe_yaml import (
    MAX_TASK_YAML_BYTES,
    YamlTooLarge,
    read_regular_file,
    task_yaml_loader,
    yaml_nodes,
)
from nsa_eval.suite.spec import Suite
from nsa_eval.tasks import TASKS_DIR

_TASK_MANAGERS: dict[tuple[str, ...], Any] = {}
# include_path -> (name, file, the file it replaces) for each task an include_path file shadows
_SHADOWED: dict[tuple[str, ...], list[tuple[str, str, str]]] = {}


def suite_task_manager(include_path: tuple[str, ...] = ()):
    """An indexed lm-eval TaskManager with the project's tasks (+ include_path), one per process:
    indexing lm-eval's ~15,000 task names takes seconds. The names an include_path file takes from
    an earlier folder (lm-eval logs each one) are kept for `check_shadowed_tasks`."""
    if include_path not in _TASK_MANAGERS:
        from lm_eval.tasks import TaskManager

        paths = [str(TASKS_DIR), *include_path]
        with _IndexOverrides(include_path) as overrides:
            _TASK_MANAGERS[include_path] = TaskManager(include_path=paths)
        _SHADOWED[include_path] = overrides.found
    return _TASK_MANAGERS[include_path]


class _IndexOverrides:
    """Collects lm-eval's "Task X from A overrides existing task from B" records (lm_eval.tasks._index)
    for files A under `include_path`, while the index is built."""

    def __init__(self, include_path: tuple[str, ...]):
        import logging

        self.roots = [Path(p).resolve() for p in include_path]
        self.found: list[tuple[str, str, str]] = []
        self.logger = logging.getLogger("lm_eval.tasks._index")
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = self._record

    def _record(self, record) -> None:
        if "overrides existing task" in str(record.msg) and len(record.args or ()) == 3:
            name, new, old = record.args
            new_file, old_file = Path(str(new)).resolve(), Path(str(old)).resolve()
            if new_file != old_file and any(new_file.is_relative_to(root) for root in self.roots):
                self.found.append((str(name), str(new), str(old)))

    def __enter__(self):
        import logging

        self.level = self.logger.level
        if not self.logger.isEnabledFor(logging.WARNING):
            self.logger.setLevel(logging.WARNING)
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def check_shadowed_tasks(suite: Suite) -> None:
    """An include_path task or group named like one of lm-eval's or the project's replaces it
    silently in lm-eval (a log line); here it is an error naming both files."""
    for name, new, old in _SHADOWED.get(suite.include_path, []):
        raise UsageError(f"{suite.path}: include_path: {new} defines {name!r}, which {old} already "
                         "defines; lm-eval would silently run yours instead. Expected a name of its own")


def check_include_path_files(suite: Suite) -> list[str]:
    """The task YAMLs lm-eval will read under include_path (every *.yaml, and what their `include:`
    names): regular files of at most MAX_TASK_YAML_BYTES with bounded YAML, so none can block lm-eval
    (a FIFO), feed it forever (/dev/zero) or expand without end. Returns a warning for each task file
    that names Python code with `!function`: that code runs when the task is built."""
    code: list[tuple[Path, list[str]]] = []  # (task file, the functions it names)
    seen: set[Path] = set()
    for root in suite.include_path:
        for path in task_yaml_paths(root):
            code += _check_task_file(path, suite.path, seen)
    if not code:
        return []
    if len(code) == 1:
        (path, functions), = code
        return [f"{suite.path}: include_path: {path} runs Python code when its task is built (!function "
                f"{', '.join(functions)}); run only task folders you trust"]
    named = "; ".join(f"{path} (!function {', '.join(functions)})" for path, functions in code[:3])
    more = f", and {len(code) - 3} more" if len(code) > 3 else ""
    return [f"{suite.path}: include_path: {len(code)} task files run Python code when their tasks are "
            f"built: {named}{more}; run only task folders you trust"]


def _check_task_file(path: Path, where: str, seen: set[Path]) -> list[tuple[Path, list[str]]]:
    """UsageError when lm-eval could not read `path` safely; (path, functions) where it names code."""
    import yaml

    resolved = path.resolve()
    if resolved in seen:
        return []
    seen.add(resolved)
    try:
        text = read_regular_file(path, MAX_TASK_YAML_BYTES)
    except FileNotFoundError:
        return []  # a dangling link: lm-eval skips it too
    except OSError as err:
        raise UsageError(f"{where}: include_path: {path}: {err.strerror}; expected task YAML files "
                         f"(regular files of at most {MAX_TASK_YAML_BYTES:,} bytes)") from None
    try:
        root = yaml.compose(text, Loader=task_yaml_loader())
    except YamlTooLarge as err:
        raise UsageError(f"{where}: include_path: {path}: {err}") from None
    except yaml.YAMLError:
        return []  # lm-eval skips a file it cannot parse; the task it would define is then unknown
    functions = sorted({node.value for node in yaml_nodes(root) if node.tag == "!function"})
    code = [(path, functions)] if functions else []
    if isinstance(root, yaml.MappingNode):
        for key, value in root.value:
            if key.value == "include":
                targets = [value] if isinstance(value, yaml.ScalarNode) else list(value.value)
                for target in targets:
                    if isinstance(target, yaml.ScalarNode):
                        code += _check_task_file(path.parent / target.value, where, seen)
    return code
