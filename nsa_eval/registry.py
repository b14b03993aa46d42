"""Name -> object tables with one error for unknown names, shared by methods, models and tasks."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from nsa_eval.errors import UsageError

T = TypeVar("T")


class Registry(Generic[T]):
    """A lowercase name -> object table.

    >>> methods = Registry("attention method")
    >>> @methods.register("topk")
    ... class TopK: ...
    >>> methods.get("topk") is TopK
    True
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        if name not in self._items:
            raise UsageError(unknown_name_message(self.kind, name, self.names()))
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def unknown_name_message(kind: str, name: str, valid: list[str]) -> str:
    """'unknown attention method 'topkk' (did you mean 'topk'?); expected one of: ...'."""
    close = difflib.get_close_matches(str(name), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {kind} {name!r}{hint}; expected one of: {', '.join(valid)}"
