"""The metadata keys a project task reads, declared by the task's own module (e.g. `niah.METADATA`).

A suite's `metadata:` for a project task is checked against its task's schema (`catalog.TASK_METADATA`)
when the suite loads: an unknown key, a value `accepts` refuses, or one its `check` refuses stops
validation with a UsageError naming the key. `check_here` runs later, before any model loads, against
this machine's files. lm-eval's own tasks and include_path tasks are not checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nsa_eval.values import is_int, is_number


@dataclass(frozen=True)
class MetadataKey:
    """One metadata key a task reads.

    Attributes:
        accepts: True for a value of the right type and range.
        expected: what an error says is expected, e.g. "a positive integer".
        check: a closer look at an accepted value, `check(value, location)`, raising a UsageError
            that starts with `location` (e.g. ``configs/x.yaml: tasks[0].metadata.niah_template``).
        check_here: the same against this machine's files, run by `check_suite` (a folder to read).
        prompt_length: the task cuts its prompts to this many tokens itself (LongBench's own length):
            the suite checks that it and the answer fit each model, the report shows it.
    """

    accepts: Callable[[Any], bool]
    expected: str
    check: Callable[[Any, str], None] | None = None
    check_here: Callable[[Any, str], None] | None = None
    prompt_length: bool = False


TOKENIZER = MetadataKey(lambda v: isinstance(v, str) and bool(v), "a tokenizer name or directory")


def int_list(value: Any, ok: Callable[[int], bool]) -> bool:
    """A non-empty list of integers (or one integer) that all pass `ok`."""
    values = value if isinstance(value, list) else [value]
    return bool(values) and all(is_int(x) and ok(x) for x in values)


def number_list(value: Any, ok: Callable[[float], bool]) -> bool:
    """A non-empty list of numbers (or one number) that all pass `ok`."""
    values = value if isinstance(value, list) else [value]
    return bool(values) and all(is_number(x) and ok(x) for x in values)
