"""Tests of the values a user writes (suite keys, task metadata), shared by the suite and the tasks."""

from __future__ import annotations

from typing import Any

# Integers a run passes to torch, numpy or lm-eval: token counts and lengths fit int32, and a value
# past this fails only once the model has loaded.
MAX_INT = 2**31 - 1


def is_int(v: Any) -> bool:
    """An integer that is not a bool (YAML's true/false are ints in Python)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def short_repr(value: Any, limit: int = 200) -> str:
    """repr cut to `limit` characters: an error message must not print a whole document."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"
