"""The project's tasks: their names, one-line protocols, scoring notes and metadata schemas.

Adding a task under nsa_eval/tasks/ means adding its YAML, its name to `PROJECT_TASKS` and, when it
reads task metadata, its module's `METADATA` schema to `TASK_METADATA` (tasks/metadata.py); the suite
checks a suite's `metadata:` against that schema, and knows nothing else about the task.
"""

from __future__ import annotations

from pathlib import Path

from nsa_eval.tasks.longbench import METADATA as LONGBENCH_METADATA
from nsa_eval.tasks.longbench import SUBSETS
from nsa_eval.tasks.metadata import MetadataKey
from nsa_eval.tasks.niah import METADATA as NIAH_METADATA
from nsa_eval.tasks.niah_multi import MULTIHOP_METADATA, MULTIKEY_METADATA

TASKS_DIR = Path(__file__).resolve().parent

# name -> protocol summary; every name is an lm-eval task or group under TASKS_DIR.
PROJECT_TASKS: dict[str, str] = {
    "nsa_niah": "needle in a haystack: context lengths x depths grid, exact match of a 7-digit value",
    "nsa_niah_multikey": "NIAH with needles of several keys (RULER multikey), the asked key's 7-digit value",
    "nsa_niah_multihop": "NIAH with two-needle chains (key -> name -> value), the asked key's 7-digit value",
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

# Task name -> the metadata keys it reads. A project task not listed reads none.
TASK_METADATA: dict[str, dict[str, MetadataKey]] = {
    "nsa_niah": NIAH_METADATA,
    "nsa_niah_multikey": MULTIKEY_METADATA,
    "nsa_niah_multihop": MULTIHOP_METADATA,
    **dict.fromkeys(("nsa_longbench", *(f"nsa_longbench_{s}" for s in SUBSETS)), LONGBENCH_METADATA),
}


# The custom_dataset builders of the needle grids: every prompt is exactly `niah_lengths` tokens long
# (the suite checks that the longest fits each model's context with what lm-eval adds around it).
NIAH_GRID_DATASETS = ("nsa_eval.tasks.niah.niah_dataset", "nsa_eval.tasks.niah_multi.multikey_dataset",
                      "nsa_eval.tasks.niah_multi.multihop_dataset")


def prompt_length_key(task: str) -> str | None:
    """The metadata key with which `task` cuts its own prompts (`MetadataKey.prompt_length`), if any."""
    return next((name for name, key in (metadata_schema(task) or {}).items() if key.prompt_length), None)


def metadata_schema(task: str) -> dict[str, MetadataKey] | None:
    """The metadata keys `task` reads: its schema for a project task ({} when it reads none), None
    for any other task (lm-eval's own, or an include_path task), whose metadata is not checked."""
    if task in TASK_METADATA:
        return TASK_METADATA[task]
    return {} if task in PROJECT_TASKS else None
