"""The project's lm-eval tasks: NIAH grid, LongBench (10 subsets), general benchmarks, AIME 2024.

- `TASKS_DIR`: the lm-eval include_path holding the project's YAMLs (niah/, longbench/, general/,
  aime/); `task_manager(metadata)` is a TaskManager that knows them and lm-eval's own tasks.
- `PROJECT_TASKS`: name -> one-line protocol, for `nsa-eval data list` and the docs;
  `PROTOCOL_NOTES`: name -> the scoring choices a report states in its protocol section.
- `check_task_data(names)`: one UsageError before any model loads when data is missing offline.
- `requires_unsafe_code(names)`: the requested tasks whose leaf configs set `unsafe_code` (they run
  model-written code, e.g. nsa_mbpp, nsa_humaneval, mbpp, humaneval).

Importing this package does not import lm_eval; the functions do, when called.
docs/tasks.md describes every family's protocol, metadata keys and data layout.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from nsa_eval.tasks.data import check_task_data, data_dir, fetch
from nsa_eval.tasks.longbench import SUBSETS

TASKS_DIR = Path(__file__).resolve().parent

# name -> protocol summary; every name is an lm-eval task or group under TASKS_DIR.
PROJECT_TASKS: dict[str, str] = {
    "nsa_niah": "needle in a haystack: context lengths x depths grid, exact match of a 7-digit value",
    "nsa_longbench": "LongBench v1, the paper's 10 subsets, official prompts/metrics, 0-1 scale",
    **{f"nsa_longbench_{s}": f"LongBench {s}" for s in SUBSETS},
    "nsa_mmlu": "MMLU 5-shot, loglikelihood multiple choice (acc)",
    "nsa_mmlu_pro": "MMLU-Pro 5-shot chain of thought, exact match of 'answer is (X)'",
    "nsa_cmmlu": "CMMLU 5-shot, loglikelihood multiple choice (acc)",
    "nsa_bbh": "BBH 3-shot chain of thought, exact match of 'the answer is ...'",
    "nsa_bbh_direct": "BBH 3-shot answer only (no chain of thought), exact match",
    "nsa_gsm8k": "GSM8K 8-shot chain of thought (exact match)",
    "nsa_math": "MATH 4-shot (Minerva) chain of thought, exact match (and math_verify)",
    "nsa_drop": "DROP 1-shot, generative (f1, em), stops at a line or sentence end",
    "nsa_mbpp": "MBPP 3-shot, pass@1; executes model code: needs confirm_run_unsafe_code",
    "nsa_humaneval": "HumanEval 0-shot, pass@1; executes model code: needs confirm_run_unsafe_code",
    "nsa_aime24_8k": "AIME 2024, 16 samples at T=0.7 top-p 0.95, 8,192 new tokens; avg@k, pass@k",
    "nsa_aime24_16k": "AIME 2024, 16 samples at T=0.7 top-p 0.95, 16,384 new tokens; avg@k, pass@k",
}

# The scoring choices a report states beside its protocol (docs/tasks.md gives each one's reason):
# task or group name -> one sentence.
_LONGBENCH_NOTE = ("LongBench: the official prompts and metrics; lcc's code_sim is fuzzywuzzy's ratio on "
                   "python-Levenshtein (pinned; the difflib fallback, which scores differently, is refused); "
                   "a prompt longer than `longbench_max_length` tokens is cut in the middle as LongBench's "
                   "pred.py cuts it.")
_AIME_NOTE = ("AIME: the answer is the last complete `\\boxed{}` (read after `</think>`; formatting "
              "wrappers, a currency sign, a choice or Answer: label and units dropped, an equation read by "
              "its right-hand side), which must hold one integer; a response without one (an unboxed "
              "answer, a trace cut off by the generation limit) scores 0.")
PROTOCOL_NOTES: dict[str, str] = {
    "nsa_longbench": _LONGBENCH_NOTE,
    **{f"nsa_longbench_{s}": _LONGBENCH_NOTE for s in SUBSETS},
    "nsa_aime24_8k": _AIME_NOTE,
    "nsa_aime24_16k": _AIME_NOTE,
    "nsa_drop": ("DROP: lm-eval's drop and F1, its 1-shot example showing its first answer as DROP's "
                 "official evaluation reads it; generation stops at a newline or a sentence end, not at "
                 "any \".\" (which cut 3.5 to 3), and one final period is dropped before scoring."),
    "nsa_mbpp": ("MBPP: lm-eval's mbpp prompt and its 3 examples; pass@1 by running each program with its "
                 "tests in a fresh python subprocess (nsa_eval.tasks.mbpp), offline."),
    "nsa_humaneval": ("HumanEval: lm-eval's humaneval prompt, stops and create_test filter; pass@1 by the "
                      "executor MBPP uses, offline (lm-eval's own task loads code_eval from the hub)."),
    "nsa_math": "MATH: lm-eval's minerva_math, 4 Minerva examples; exact_match is the headline.",
}

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


def _with_metadata(metadata: dict[str, Any] | None, all_lm_eval_tasks: bool):
    from lm_eval.tasks._factory import TaskFactory

    manager = copy.copy(_base_task_manager(all_lm_eval_tasks))  # shares the (slow to build) index
    manager.metadata = metadata or None
    manager._factory = TaskFactory(meta=metadata or None)
    return manager


@lru_cache(maxsize=16)
def _task_manager_for(metadata_json: str, all_lm_eval_tasks: bool):
    return _with_metadata(json.loads(metadata_json), all_lm_eval_tasks)


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
        return _with_metadata(metadata, all_lm_eval_tasks)
    return _task_manager_for(key, all_lm_eval_tasks)


def requires_unsafe_code(task_names, manager=None) -> list[str]:
    """The requested tasks (project or lm-eval, groups and tags included) that execute model code.

    A name is listed when any leaf task under it sets `unsafe_code: true` (nsa_mbpp, lm-eval's
    mbpp and humaneval, ...), i.e. when lm-eval would refuse it without confirm_run_unsafe_code.
    Reads the task index (YAML only, nothing loads); an unknown name raises UsageError.
    """
    from nsa_eval.tasks.data import leaf_configs

    names = list(task_names)
    unsafe = {root for root, cfg in leaf_configs(names, manager) if cfg.get("unsafe_code")}
    return [name for name in names if name in unsafe]


__all__ = [
    "PROJECT_TASKS",
    "PROTOCOL_NOTES",
    "TASKS_DIR",
    "check_task_data",
    "data_dir",
    "fetch",
    "requires_unsafe_code",
    "task_manager",
]
