"""Reading a suite file and the task YAMLs under its include_path without letting them hang or flood us.

- `read_regular_file(path, max_bytes)`: the bytes of a regular file of bounded size (a FIFO would
  block forever, /dev/zero never end).
- `read_suite_yaml(path)`: a suite file as (parsed YAML, source text), each problem a UsageError
  naming the file: not UTF-8, not valid YAML, a key given twice in one mapping, nested too deep, or
  aliases that expand past a bound (a "billion laughs").
- `task_yaml_loader()`: the same bounds for an include_path task YAML, its tags (`!function`) kept.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from nsa_eval.errors import UsageError

# Bounds on what a suite or task file may make the YAML reader build: real suites nest 5 levels
# and hold a few hundred nodes (configs/paper.yaml: 223), so these stop only runaway documents.
MAX_SUITE_BYTES = 1 << 20
MAX_TASK_YAML_BYTES = 4 << 20  # an include_path task YAML (lm-eval's largest is ~200 kB)
MAX_YAML_DEPTH = 32
MAX_YAML_NODES = {"suite": 10_000, "task": 200_000}  # after expanding aliases (*name)


def read_suite_yaml(path: Path) -> tuple[Any, str]:
    """(the suite file's YAML as Python values, its text); a UsageError naming the file otherwise."""
    import yaml

    if not path.exists():
        raise UsageError(f"{path}: no such suite file")
    try:
        source = read_regular_file(path, MAX_SUITE_BYTES).decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{path}: not a UTF-8 text file (byte {err.start}: {err.reason}); save "
                         "the suite as UTF-8") from None
    except OSError as err:
        raise UsageError(f"{path}: cannot read the suite file ({err.strerror})") from None
    try:
        raw = yaml.load(source, Loader=_unique_key_loader())
    except DuplicateKeyError as err:
        raise UsageError(f"{path}:{err.line}: duplicate key {err.key!r} (the second would silently "
                         "replace the first); keep one") from None
    except YamlTooLarge as err:
        raise UsageError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise UsageError(f"{path}: not valid YAML: {err}") from None
    return raw, source


def read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of `path`, or OSError when it is not a regular file (a FIFO would block forever,
    /dev/zero never end) or is larger than `max_bytes`."""
    import errno
    import stat

    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"{info.st_size:,} bytes; at most {max_bytes:,} expected", str(path))
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew since fstat
        raise OSError(errno.EFBIG, f"more than {max_bytes:,} bytes", str(path))
    return data


class YamlTooLarge(Exception):
    """A YAML document nests too deep, refers to itself, or expands past its node budget."""


def _bounded_composer(kind: str):
    """Mixin for a PyYAML loader: composing refuses a document deeper than MAX_YAML_DEPTH, an alias
    that contains itself, or one whose aliases expand past MAX_YAML_NODES[kind] nodes (the "billion
    laughs": nine anchors of ten aliases each are 10^9 nodes once a reader walks them)."""
    import yaml

    limit = MAX_YAML_NODES[kind]

    class BoundedComposer:
        def compose_node(self, parent, index):
            depth = self.__dict__.get("_depth", 0) + 1
            if depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlTooLarge(f"line {mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels; "
                                   "expected a few levels of mappings and lists")
            self._depth = depth
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth = depth - 1

        def compose_document(self):
            node = super().compose_document()
            _check_expanded_size(node, limit, yaml)
            return node

    return BoundedComposer


def _check_expanded_size(root, limit: int, yaml) -> None:
    """YamlTooLarge when the node graph under `root`, with every alias expanded, exceeds `limit`
    nodes or has a cycle. Sizes are summed once per node (aliases share nodes), so this is linear."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        if children_done:
            on_path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > limit:
                raise YamlTooLarge(f"line {node.start_mark.line + 1}: its aliases (*name) expand to more "
                                   f"than {limit:,} values; expected a document that is not built from "
                                   "repeated aliases")
            continue
        if id(node) in on_path:
            raise YamlTooLarge(f"line {node.start_mark.line + 1}: an alias refers to a node that "
                               "contains it; expected no recursive anchors")
        on_path.add(id(node))
        stack.append((node, True))
        for child in children:
            if id(child) in on_path:
                raise YamlTooLarge(f"line {child.start_mark.line + 1}: an alias refers to a node that "
                                   "contains it; expected no recursive anchors")
            if id(child) not in sizes:
                stack.append((child, False))


class DuplicateKeyError(Exception):
    """A mapping of a suite file gives one key twice (`line` is the second one's, from 1)."""

    def __init__(self, key: Any, line: int):
        super().__init__(f"line {line}: duplicate key {key!r}")
        self.key, self.line = key, line


@functools.cache
def _unique_key_loader():
    """yaml.SafeLoader that rejects a key given twice in one mapping: safe_load keeps the last one,
    so a second `budget:` in a model entry would silently replace the first. Keys a merge (`<<:`)
    brings in may be overridden by an explicit one, as YAML intends; only explicit keys are compared.

    The check runs in flatten_mapping, the first time it sees a mapping: flattening (which puts the
    merged pairs beside the explicit ones) happens there, sometimes before the mapping's own turn."""
    import yaml

    class UniqueKeyLoader(_bounded_composer("suite"), yaml.SafeLoader):
        def flatten_mapping(self, node):
            checked = self.__dict__.setdefault("_checked_mappings", set())
            if id(node) not in checked:
                checked.add(id(node))
                self._check_unique(node)
            super().flatten_mapping(node)

        def _check_unique(self, node):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                except TypeError:  # an unhashable key: the base constructor reports it
                    continue
                if repeated:
                    raise DuplicateKeyError(key, key_node.start_mark.line + 1)
                seen.add(key)

    return UniqueKeyLoader


@functools.cache
def task_yaml_loader():
    """A bounded composer for task YAMLs: lm-eval's tags (!function) and any other are kept as tags."""
    import yaml

    class TaskYamlLoader(_bounded_composer("task"), yaml.SafeLoader):
        pass

    return TaskYamlLoader


def yaml_nodes(root):
    """Every node of a composed YAML graph once (aliases share nodes)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if isinstance(node.value, list):
            stack.extend(n for item in node.value for n in (item if isinstance(item, tuple) else (item,)))
