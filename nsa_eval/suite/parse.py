"""Suite YAML -> a typed `Suite`: every key, type and value checked, no name looked up yet.

`load_suite(path)` reads the file (safe_yaml.py) and `parse_suite` builds the `Suite`: one `ModelSpec`
per (entry, method, budget), one `TaskSpec` per task entry, each error a UsageError naming the file
and the key, e.g. ``configs/x.yaml: models[1].budget: ...``. A project task's `metadata:` is checked
against the schema its module declares (tasks/catalog.py); the names (methods, checkpoints, tasks)
are checked by `check_suite` (checks.py).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from pathlib import Path
from typing import Any

from nsa_eval.budget import BudgetConfig
from nsa_eval.errors import UsageError
from nsa_eval.models.loading import NSA_ATTENTION, check_nsa_params
from nsa_eval.registry import unknown_name_message
from nsa_eval.suite.safe_yaml import read_suite_yaml
from nsa_eval.suite.spec import SINK_LOCAL_ONLY, UNBUDGETED, ModelSpec, Suite, TaskSpec
from nsa_eval.tasks.catalog import metadata_schema
from nsa_eval.values import MAX_INT, is_int, is_number, short_repr

DTYPES = ("auto", "float32", "bfloat16", "float16")
TRUNCATIONS = ("middle", "left")
BACKENDS = ("hf", "vllm")

# key -> (accepted types, description) for every model key; `attention` and `budget` may be lists.
MODEL_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "label": ((str,), "a string"),
    "pretrained": ((str,), "a checkpoint path or short name"),
    "attention": ((str, list), "a method name or a list of them"),
    "budget": ((int, list), "an integer or a list of integers"),
    "sink": ((int,), "an integer"),
    "local": ((int,), "an integer"),
    "sparse_prefill": ((bool,), "true or false"),
    "dense_layers": ((int,), "an integer"),
    "params": ((dict,), "a mapping of extra method parameters"),
    "dtype": ((str,), f"one of {', '.join(DTYPES)}"),
    "device": ((str,), "a device such as cpu, cuda or cuda:1"),
    "parallelize": ((bool,), "true or false (split one model over the visible GPUs)"),
    "max_length": ((int,), "an integer"),
    "batch_size": ((int, str), "a positive integer, 'auto' or 'auto:N'"),
    "truncation": ((str,), f"one of {', '.join(TRUNCATIONS)}"),
    "backend": ((str,), f"one of {', '.join(BACKENDS)}"),
    "vllm": ((dict,), "a mapping of vllm engine arguments"),
}
TASK_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "task": ((str,), "an lm-eval task or group name"),
    "label": ((str,), "a string"),
    "num_fewshot": ((int,), "an integer"),
    "limit": ((int,), "an integer"),
    "metadata": ((dict,), "a mapping (lm-eval task metadata)"),
    "gen_kwargs": ((dict,), "a mapping of generation settings"),
    "apply_chat_template": ((bool,), "true or false"),
    "fewshot_as_multiturn": ((bool,), "true or false"),
    "system_instruction": ((str,), "a string"),
    "metric": ((str,), "a metric name such as exact_match or f1"),
    "models": ((list,), "a list of model labels or glob patterns"),
    "confirm_run_unsafe_code": ((bool,), "true or false"),
    "split": ((str,), "a metadata key holding a list (one cell per element, e.g. niah_lengths)"),
}
SUITE_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "name": ((str,), "a string"),
    "description": ((str,), "a string"),
    "output": ((str,), "a directory for the run's cells"),
    "report": ((str,), "a directory for the report"),
    "seed": ((int,), "an integer"),
    "bootstrap_iters": ((int,), "an integer"),
    "include_path": ((str, list), "a directory of lm-eval task YAMLs, or a list of them"),
    "defaults": ((dict,), "a mapping of model keys"),
    "models": ((list,), "a list of model entries"),
    "tasks": ((list,), "a list of task entries"),
}
# numpy takes 32-bit seeds; other integer keys fit MAX_INT.
INT_RANGES = {"seed": (0, 2**32 - 1), "bootstrap_iters": (0, 1_000_000)}

# Generation settings whose values lm-eval or the backends check only when generating, after the
# model has loaded: (accepts, what is expected).
GEN_KWARG_VALUES: dict[str, tuple[Any, str]] = {
    **{name: (lambda v: is_int(v) and 1 <= v <= MAX_INT, "a positive integer (new tokens)")
       for name in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")},
    "temperature": (lambda v: is_number(v) and 0 <= v <= 1e6, "a number >= 0"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "until": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
              "a string or a list of strings"),
    "top_p": (lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: is_int(v) and 0 <= v <= MAX_INT, "a non-negative integer"),
    "num_beams": (lambda v: is_int(v) and 1 <= v <= 1024, "a positive integer"),
}


def load_suite(path: str | Path) -> Suite:
    """Read and parse a suite file; every structural error is a UsageError naming file and key."""
    path = Path(path)
    raw, source = read_suite_yaml(path)
    return parse_suite(raw, str(path), source)


def parse_suite(raw: Any, where: str, source: str = "") -> Suite:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: expected a mapping with keys name, models, tasks")
    _check_keys(raw, SUITE_KEYS, where, "")
    for required in ("name", "models", "tasks"):
        if required not in raw:
            raise UsageError(f"{where}: missing key {required!r}")
    name = _get(raw, "name", SUITE_KEYS, where, "")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise UsageError(f"{where}: name: {name!r} must be letters, digits, '.', '_' or '-'")
    defaults = _get(raw, "defaults", SUITE_KEYS, where, "", {})
    _check_keys(defaults, MODEL_KEYS, where, "defaults.")
    for key in defaults:  # type errors in defaults are reported there, not on every model
        _get(defaults, key, MODEL_KEYS, where, "defaults.")
    models = _parse_models(raw["models"], defaults, where)
    tasks = _parse_tasks(raw["tasks"], where, {m.label for m in models})
    suite = Suite(
        name=name, path=where, models=tuple(models), tasks=tuple(tasks),
        output=_get(raw, "output", SUITE_KEYS, where, "", f"runs/{name}"),
        report=_get(raw, "report", SUITE_KEYS, where, "", f"reports/{name}"),
        description=_get(raw, "description", SUITE_KEYS, where, "", ""),
        seed=_get(raw, "seed", SUITE_KEYS, where, "", 1234),
        bootstrap_iters=_nonnegative(_get(raw, "bootstrap_iters", SUITE_KEYS, where, "", 1000),
                                     where, "bootstrap_iters"),
        include_path=_include_paths(raw, where),
        source=source or json.dumps(raw, sort_keys=True),
    )
    suite.cells()  # two entries that would fill the same cells fail here, with the other keys
    return suite


def _include_paths(raw: dict, where: str) -> tuple[str, ...]:
    """include_path entries, relative to the suite file; each must be an existing directory."""
    value = _get(raw, "include_path", SUITE_KEYS, where, "", [])
    paths = []
    for entry in _as_list(value, str, where, "include_path", "directories") if value else []:
        path = Path(entry).expanduser()
        if not path.is_absolute():
            path = Path(where).resolve().parent / path
        if not path.is_dir():
            raise UsageError(f"{where}: include_path: {entry!r} is not a directory ({path})")
        paths.append(str(path))
    return tuple(paths)


# ---------------------------------------------------------------- models


def _parse_models(entries: Any, defaults: dict, where: str) -> list[ModelSpec]:
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{where}: models: expected a non-empty list of model entries")
    pretrained_names = set()
    expanded: list[tuple[str, dict, int]] = []  # (key prefix, merged entry, expansion count)
    for i, entry in enumerate(entries):
        key = f"models[{i}]."
        if not isinstance(entry, dict):
            raise UsageError(f"{where}: models[{i}]: expected a mapping, got {entry!r}")
        _check_keys(entry, MODEL_KEYS, where, key)
        merged = defaults | entry
        for required in ("pretrained", "attention"):
            if merged.get(required) is None:
                raise UsageError(f"{where}: {key}{required}: missing (set it here or in defaults)")
        pretrained = _get(merged, "pretrained", MODEL_KEYS, where, key)
        if not pretrained.strip():
            raise UsageError(f"{where}: {key}pretrained: expected a checkpoint path or short name, "
                             "got an empty string")
        merged["pretrained"] = _spelled_once(pretrained)
        pretrained_names.add(merged["pretrained"])
        expanded.append((key, merged, i))
    models = []
    for key, merged, i in expanded:
        models.extend(_expand_model(merged, where, key, multi_checkpoint=len(pretrained_names) > 1,
                                    own_keys=set(entries[i])))
    seen: dict[str, str] = {}
    for model in models:
        if model.label in seen:
            raise UsageError(f"{where}: models: two entries are both labelled {model.label!r}; "
                             "give one a distinct `label`")
        seen[model.label] = model.label
    return models


def _spelled_once(pretrained: str) -> str:
    """One spelling of a checkpoint path ('runs/x/', './runs/x' -> 'runs/x'), so that two entries naming
    one folder share its cells (and the duplicate check sees them); short names and hub ids keep theirs."""
    return os.path.normpath(pretrained) if "/" in pretrained else pretrained


def _expand_model(entry: dict, where: str, key: str, multi_checkpoint: bool,
                  own_keys: set = frozenset()) -> list[ModelSpec]:
    """One entry -> one ModelSpec per (attention, budget); unbudgeted methods ignore budgets, and
    sink_window's budget is sink + local (the keys it keeps) whatever the entry's budgets."""
    get = lambda name, default=None: _get(entry, name, MODEL_KEYS, where, key, default)  # noqa: E731
    attentions = _as_list(get("attention"), str, where, key + "attention", "method names")
    budgets = _as_list(get("budget", BudgetConfig.budget), int, where, key + "budget", "integers")
    dtype = _choice(get("dtype", "auto"), DTYPES, where, key + "dtype")
    truncation = _choice(get("truncation", "middle"), TRUNCATIONS, where, key + "truncation")
    backend = _choice(get("backend", "hf"), BACKENDS, where, key + "backend")
    batch_size = get("batch_size", 1)
    if (isinstance(batch_size, str) and not re.fullmatch(r"auto(:[1-9]\d*)?", batch_size)) or (
            isinstance(batch_size, int) and batch_size < 1):
        raise UsageError(f"{where}: {key}batch_size: expected a positive integer, 'auto' or 'auto:N' "
                         f"(N >= 1), got {batch_size!r}")
    sink = _nonnegative(get("sink", BudgetConfig.sink), where, key + "sink")
    local = _nonnegative(get("local", BudgetConfig.local), where, key + "local")
    max_length = get("max_length")
    if max_length is not None:
        _positive(max_length, where, key + "max_length")
    if backend == "vllm" and attentions != ["full"]:
        raise UsageError(f"{where}: {key}backend: vllm runs full attention only (stock vLLM kernels); "
                         f"got attention {attentions}; use backend: hf for sparse methods")
    pretrained = get("pretrained")
    params = get("params", {})
    origin = "" if "params" in own_keys else " (params is set in defaults)"
    if params and "full" in attentions:
        fix = ("remove params" if len(attentions) == 1 else f"an entry's params apply to each of its "
               f"methods {attentions}: give full an entry of its own without params")
        raise UsageError(f"{where}: {key}params: full takes no method parameters{origin}; " + fix)
    if params and NSA_ATTENTION in attentions:
        try:
            check_nsa_params(params)  # against the checkpoint's forced blocks in check_suite
        except UsageError as err:
            raise UsageError(f"{where}: {key}params: {err}{origin}") from None
    variants = []
    for a in attentions:
        if a in UNBUDGETED:
            variants.append((a, None))
        elif a in SINK_LOCAL_ONLY:  # keeps sink + local keys whatever the budget: one variant
            variants.append((a, sink + local))
        else:
            variants.extend((a, b) for b in budgets)
    specs = []
    for attention, budget in variants:
        if budget is not None and attention not in SINK_LOCAL_ONLY:
            _in_range(_positive(budget, where, key + "budget"), where, key + "budget", 1, MAX_INT)
            if budget < sink + local:
                raise UsageError(f"{where}: {key}budget: {budget} is below sink + local = "
                                 f"{sink} + {local} = {sink + local}; raise the budget or lower "
                                 "sink/local")
        label = _label(get("label"), pretrained, attention, budget, len(attentions) > 1,
                       len(budgets) > 1 and attention not in SINK_LOCAL_ONLY, multi_checkpoint)
        specs.append(ModelSpec(
            label=label, pretrained=pretrained, attention=attention, budget=budget, sink=sink,
            local=local, sparse_prefill=get("sparse_prefill", True),
            dense_layers=_nonnegative(get("dense_layers", 0), where, key + "dense_layers"),
            params=params, dtype=dtype, device=get("device", "cpu"),
            parallelize=get("parallelize", False), max_length=max_length,
            batch_size=batch_size, truncation=truncation, backend=backend, vllm=get("vllm", {}),
        ))
    return specs


def _label(given, pretrained, attention, budget, many_methods, many_budgets, multi_checkpoint) -> str:
    if given:
        parts = [given] + ([attention] if many_methods else [])
        return ":".join(parts) + (f"@{budget}" if budget is not None and many_budgets else "")
    stem = Path(pretrained).name if multi_checkpoint else ""
    method = attention if budget is None else f"{attention}@{budget}"
    return f"{stem}:{method}" if stem else method


# ---------------------------------------------------------------- tasks


def _parse_tasks(entries: Any, where: str, model_labels: set[str]) -> list[TaskSpec]:
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{where}: tasks: expected a non-empty list of task entries")
    tasks = []
    for i, entry in enumerate(entries):
        key = f"tasks[{i}]."
        if isinstance(entry, str):
            entry = {"task": entry}
        if not isinstance(entry, dict):
            raise UsageError(f"{where}: tasks[{i}]: expected a task name or a mapping, got {entry!r}")
        _check_keys(entry, TASK_KEYS, where, key)
        if "task" not in entry:
            raise UsageError(f"{where}: {key}task: missing (an lm-eval task or group name)")
        get = lambda name, default=None, e=entry, k=key: _get(e, name, TASK_KEYS, where, k, default)  # noqa: E731
        patterns = get("models", [])
        patterns = tuple(_as_list(patterns, str, where, key + "models", "model labels") if patterns else ())
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(label, pattern) for label in model_labels):
                raise UsageError(f"{where}: {key}models: {pattern!r} matches no model label; labels are "
                                 + ", ".join(sorted(model_labels)))
        limit = get("limit")
        tasks.append(TaskSpec(
            label=get("label", entry["task"]), task=get("task"), num_fewshot=get("num_fewshot"),
            limit=None if limit is None else _positive(limit, where, key + "limit"),
            metadata=get("metadata", {}), gen_kwargs=get("gen_kwargs", {}),
            apply_chat_template=get("apply_chat_template", False),
            fewshot_as_multiturn=get("fewshot_as_multiturn", False),
            system_instruction=get("system_instruction"), metric=get("metric"), models=patterns,
            confirm_run_unsafe_code=get("confirm_run_unsafe_code", False), split=get("split"),
        ))
        split = tasks[-1].split
        if split is not None:
            values = tasks[-1].metadata.get(split)
            if not isinstance(values, list) or not values:
                raise UsageError(f"{where}: {key}split: {split!r} must name a metadata key holding a "
                                 f"non-empty list; metadata.{split} is {values!r}")
            if any(isinstance(v, dict | list) for v in values):
                raise UsageError(f"{where}: {key}metadata.{split}: a split list holds plain values "
                                 f"(one cell each), got {values!r}")
        _check_task_metadata(tasks[-1], where, key)
        _check_gen_kwargs_values(tasks[-1].gen_kwargs, where, key + "gen_kwargs")
        if tasks[-1].num_fewshot is not None:
            _nonnegative(tasks[-1].num_fewshot, where, key + "num_fewshot")
    labels = [t.label for t in tasks]
    if len(set(labels)) != len(labels):
        dup = next(x for x in labels if labels.count(x) > 1)
        raise UsageError(f"{where}: tasks: two entries are both labelled {dup!r}; give one a `label`")
    return tasks


def _check_task_metadata(task: TaskSpec, where: str, key: str) -> None:
    """The metadata keys a project task reads, against the schema its module declares; no repeated
    value in a grid list (a repeated split value would make two cells with one key)."""
    schema = metadata_schema(task.task)
    for name, value in task.metadata.items():
        if schema is not None:
            if name not in schema:
                if not schema:
                    raise UsageError(f"{where}: {key}metadata.{name}: {task.task} reads no metadata keys; "
                                     "remove `metadata`")
                raise UsageError(f"{where}: {key}metadata.{name}: {task.task}: "
                                 + unknown_name_message("metadata key", str(name), list(schema)))
            if not schema[name].accepts(value):
                raise UsageError(f"{where}: {key}metadata.{name}: expected {schema[name].expected}, got "
                                 f"{short_repr(value)}")
            if schema[name].check is not None:
                schema[name].check(value, f"{where}: {key}metadata.{name}")
        if isinstance(value, list) and (name == task.split or schema is not None):
            seen = []
            for v in value:
                if v in seen:
                    raise UsageError(f"{where}: {key}metadata.{name}: {v!r} appears twice in {value!r}")
                seen.append(v)


def _check_gen_kwargs_values(gen_kwargs: dict, where: str, key: str) -> None:
    for name, value in gen_kwargs.items():
        if name in GEN_KWARG_VALUES and not GEN_KWARG_VALUES[name][0](value):
            raise UsageError(f"{where}: {key}.{name}: expected {GEN_KWARG_VALUES[name][1]}, got "
                             f"{short_repr(value)}")


# ---------------------------------------------------------------- one key's value


def _check_keys(entry: dict, schema: dict, where: str, key: str) -> None:
    for name in entry:
        if name not in schema:
            raise UsageError(f"{where}: {key}{name}: "
                             + unknown_name_message("key", str(name), list(schema)))


def _get(entry: dict, name: str, schema: dict, where: str, key: str, default: Any = None) -> Any:
    if name not in entry or entry[name] is None:
        return default
    value = entry[name]
    types, expected = schema[name]
    # YAML booleans are ints in Python; an int key must not accept true/false.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise UsageError(f"{where}: {key}{name}: expected {expected}, got {short_repr(value)}")
    if is_int(value):
        _in_range(value, where, key + name, *INT_RANGES.get(name, (-MAX_INT, MAX_INT)))
    return value


def _in_range(value: int, where: str, key: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise UsageError(f"{where}: {key}: {short_repr(value)} is out of range; expected an integer "
                         f"from {low:,} to {high:,}")
    return value


def _as_list(value: Any, kind: type, where: str, key: str, what: str) -> list:
    values = value if isinstance(value, list) else [value]
    if not values or any(not isinstance(v, kind) or isinstance(v, bool) for v in values):
        raise UsageError(f"{where}: {key}: expected {what}, got {short_repr(value)}")
    return values


def _choice(value: str, choices: tuple[str, ...], where: str, key: str) -> str:
    if value not in choices:
        raise UsageError(f"{where}: {key}: " + unknown_name_message("value", value, list(choices)))
    return value


def _positive(value: int, where: str, key: str) -> int:
    if value <= 0:
        raise UsageError(f"{where}: {key}: expected a positive integer, got {value}")
    return value


def _nonnegative(value: int, where: str, key: str) -> int:
    if value < 0:
        raise UsageError(f"{where}: {key}: expected a non-negative integer, got {value}")
    return value
