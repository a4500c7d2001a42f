"""The client package's shape: no import cycle between its modules (imports under ``TYPE_CHECKING`` and
inside functions count too), no module of 900 lines or more, no function of 70 lines or more."""

from __future__ import annotations

import ast
from pathlib import Path

import waltz.client

PACKAGE = Path(waltz.client.__file__).parent
MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 70


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def _imports(tree: ast.Module) -> set[str]:
    """The sibling modules ``tree`` imports, wherever the import statement is."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module.startswith("waltz.client."):
                found.add(node.module.split(".")[2])
            elif node.module == "waltz.client":
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("waltz.client."))
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as the path that closes it), or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for target in sorted(graph.get(name, ())):
            found = visit(target, [*path, name])
            if found is not None:
                return found
        done.add(name)
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found is not None:
            return found
    return None


def test_the_client_modules_import_each_other_without_a_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(tree) & set(modules) for name, tree in modules.items() if name != "__init__"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"config": {"driver"}, "driver": {"config"}}) == ["config", "driver", "config"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_client_module_or_function_is_too_long() -> None:
    too_long: list[str] = []
    for path in sorted(PACKAGE.glob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines >= MAX_MODULE_LINES:
            too_long.append(f"{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length >= MAX_FUNCTION_LINES:
                    too_long.append(f"{path.name}: {node.name} {length} lines")
    assert not too_long, too_long
