"""The project's lm-eval tasks: NIAH grids (one needle, several keys, two-hop chains), LongBench
(10 subsets), general benchmarks, AIME 2024.

- `TASKS_DIR`: the lm-eval include_path holding the project's YAMLs (niah/, longbench/, general/,
  aime/); `task_manager(metadata)` is a TaskManager that knows them and lm-eval's own tasks.
- `PROJECT_TASKS`: name -> one-line protocol, for `nsa-eval data list` and the docs;
  `PROTOCOL_NOTES`: name -> the scoring choices a report states in its protocol section;
  `TASK_METADATA`: name -> the metadata keys it reads, declared by its module (catalog.py).
- `check_task_data(names)`: one UsageError before any model loads when data is missing offline.
- `requires_unsafe_code(names)`: the requested tasks whose leaf configs set `unsafe_code` (they run
  model-written code, e.g. nsa_mbpp, nsa_humaneval, mbpp, humaneval).

Modules, lowest first: metadata.py (the schema type), local_data.py (the local data folder),
haystack.py, needles.py (needles at exact token positions in a prompt of exact length), niah.py,
niah_multi.py, longbench.py and the other task modules, catalog.py (the project's tasks), index.py
(lm-eval's task index), data.py (what the tasks need: check and fetch), local_task.py (the lm-eval
task class that reads the local folder first).

Importing this package does not import lm_eval; the functions do, when called.
docs/tasks.md describes every family's protocol, metadata keys and data layout.
"""

from __future__ import annotations

from nsa_eval.tasks.catalog import PROJECT_TASKS, PROTOCOL_NOTES, TASK_METADATA, TASKS_DIR
from nsa_eval.tasks.data import check_task_data, fetch
from nsa_eval.tasks.index import requires_unsafe_code, task_manager
from nsa_eval.tasks.local_data import data_dir

__all__ = [
    "PROJECT_TASKS",
    "PROTOCOL_NOTES",
    "TASKS_DIR",
    "TASK_METADATA",
    "check_task_data",
    "data_dir",
    "fetch",
    "requires_unsafe_code",
    "task_manager",
]
