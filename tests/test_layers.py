"""The package's layers (docs/architecture.md): each module imports only its own layer and those below,
and no modules import each other in a circle. Imports inside functions count: they are circles too."""

from __future__ import annotations

import ast
from pathlib import Path

import nsa_eval

PACKAGE = Path(nsa_eval.__file__).parent
# lowest first; train, bench and suite share a rank and never import each other
LAYERS = [
    ("nsa_eval.errors", "nsa_eval.registry", "nsa_eval.values", "nsa_eval.folders", "nsa_eval.budget"),
    ("nsa_eval.kernels",),
    ("nsa_eval.baseline_kernels",),
    ("nsa_eval.methods",),
    ("nsa_eval.models",),
    ("nsa_eval.tasks",),
    ("nsa_eval.suite", "nsa_eval.train", "nsa_eval.bench"),
    ("nsa_eval.runner",),
    ("nsa_eval.report",),
    ("nsa_eval.commands",),
    ("nsa_eval.cli",),
    ("nsa_eval.__main__",),
]


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("nsa_eval", *path.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name imported from a module counts as the module)."""
    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names if a.name.startswith("nsa_eval")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from ..y import z
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base]).strip(".")
                if base.startswith("nsa_eval"):
                    found |= {owner(f"{base}.{a.name}") for a in node.names}
        graph[name] = {m for m in found if m and m != name}
    return graph


def _layer(module: str) -> tuple[int, str]:
    if module == "nsa_eval":  # only registers the lm-eval model name, lazily
        return 0, module
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                return rank, prefix
    raise AssertionError(f"{module} is in no layer of docs/architecture.md")


def test_every_import_points_down_or_within_its_own_package():
    graph = _imports(_modules())
    upward = []
    for module, imported in graph.items():
        rank, package = _layer(module)
        for target in imported:
            target_rank, target_package = _layer(target)
            if target_rank > rank or (target_rank == rank and rank > 0 and target_package != package):
                upward.append(f"{module} -> {target}")
    assert not upward


def test_no_import_circle():
    graph = _imports(_modules())
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:  # the circle: from target's first visit back to target
                walk = [*path, module, target]
                return walk[walk.index(target):]
            if target not in state and (circle := visit(target, [*path, module])):
                return circle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module, [])
            assert circle is None, " -> ".join(circle)
