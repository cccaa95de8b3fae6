"""The layout's rules, read from the source: the runtime half never imports the compile stage, the
compile stage's import graph has no cycle, and no function in it runs past a screen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LONGEST_FUNCTION = 80  # lines, decorators excluded


def modules(package: str) -> dict[str, ast.Module]:
    """Every module of `package` by dotted name, parsed."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def imported_names(name: str, tree: ast.Module, is_package: bool) -> set[str]:
    """Dotted names `tree` imports anywhere (inside functions too), relative imports resolved."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    trees = modules(package)
    packages = {n for n in trees if (ROOT / n.replace(".", "/") / "__init__.py").is_file()}
    return {name: {other for other in imported_names(name, tree, name in packages) if other in trees and other != name}
            for name, tree in trees.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ["compile", "artifact", "service", "loadtest"])
def test_no_import_cycles(package):
    assert cycles(import_graph(package)) == []


@pytest.mark.parametrize("package", ["artifact"])
def test_runtime_half_never_imports_the_compile_stage(package):
    for name, tree in modules(package).items():
        outside = {n.split(".")[0] for n in imported_names(name, tree, False)} & {"compile", "service", "loadtest"}
        assert not outside, f"{name} imports {outside}"


def test_no_long_functions_in_the_compile_stage():
    long = []
    for name, tree in modules("compile").items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []
