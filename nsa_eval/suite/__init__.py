"""YAML suites -> typed cells.

A suite names its models (a checkpoint, an attention method and its parameters; a model entry may
sweep methods and budgets), its tasks (any lm-eval task or group, with settings), and where results
go. `load_suite(path)` parses and checks every key, type and value; `check_suite(suite)` then checks
every name and machine-dependent value (method, checkpoint and its layer count, device, task,
generation settings, offline data) before any model loads. Each error is a `UsageError` naming the
file and the key, e.g. ``configs/x.yaml: models[1].budget: ...``.

The cell matrix is models x tasks (`Suite.cells`); a cell's key hashes everything that changes its
numbers and names its folder in the run directory. `sink_window` keeps sink + local keys whatever the
budget, so its budget is sink + local: a budget sweep gives it one variant.

    name: quickstart
    output: runs/quickstart
    defaults: {pretrained: smollm2-135m, dtype: float32, sink: 64, local: 256}
    models:
      - {attention: full}
      - {attention: [sink_window, topk], budget: [640, 1024]}
    tasks:
      - task: nsa_niah
        split: niah_lengths
        metadata: {niah_lengths: [1024, 2048], niah_depths: [0, 50, 100]}

Modules, in the order a suite goes through them:

- `safe_yaml.py`: the suite file and include_path task YAMLs read with bounds (size, depth, aliases).
- `parse.py`: `load_suite` / `parse_suite`: keys, types and values; a project task's metadata
  against the schema its own module declares (nsa_eval/tasks/catalog.py).
- `spec.py`: the typed `Suite`, `ModelSpec`, `TaskSpec` and `Cell`, and what each cell's key hashes.
- `identity.py`: the hashes (stable JSON, versions, include_path contents).
- `task_index.py`: the suite's lm-eval task index and the checks of its include_path files.
- `checks.py`: `check_suite`, everything checked before a model loads.
"""

from nsa_eval.suite.checks import check_suite
from nsa_eval.suite.identity import include_path_fingerprint, stable_hash
from nsa_eval.suite.parse import load_suite, parse_suite
from nsa_eval.suite.spec import Cell, ModelSpec, Suite, TaskSpec
from nsa_eval.suite.task_index import suite_task_manager

__all__ = [
    "Cell",
    "ModelSpec",
    "Suite",
    "TaskSpec",
    "check_suite",
    "include_path_fingerprint",
    "load_suite",
    "parse_suite",
    "stable_hash",
    "suite_task_manager",
]
