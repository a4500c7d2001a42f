"""The import layering between Waltz's packages, as ``docs/architecture.md`` draws it.

Each package may import only the packages listed for it (and itself); a new edge must be added here and in
the architecture document on purpose, never by accident. Imports inside functions count too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import waltz

SRC = Path(waltz.__file__).parent

# Foundation modules: small, shared by every layer.
_BASE = {"errors", "config", "tls", "http", "transport", "runtime", "version"}

ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "version": set(),
    "runtime": set(),
    "config": {"errors"},
    "tls": {"errors", "config"},
    "http": {"errors", "version"},
    "protocol": {"errors"},
    "transport": {"errors", "protocol"},
    "cluster": {"errors", "config", "tls", "version", "runtime"},
    "storage": _BASE | {"protocol", "cluster"},
    "server": _BASE | {"protocol", "cluster"},
    "client": _BASE | {"protocol", "cluster"},
    "testing": _BASE | {"protocol", "cluster", "client", "server", "storage"},
    "perf": _BASE | {"client", "protocol"},
    "spark": _BASE | {"client", "protocol"},
    "local": _BASE | {"cluster", "server", "protocol"},
    "ops": _BASE | {"cluster", "server", "protocol", "client"},
    "cli": _BASE | {"protocol", "cluster", "storage", "server", "client", "perf", "local", "testing", "ops"},
    "__init__": {"client", "errors", "version"},
    "__main__": {"cli"},
}

# Edges that must never appear, whatever the table above grows into: the core must not know the command
# line, and the storage node must not depend on the server that drives it (nor the reverse, except through
# the wire protocol).
FORBIDDEN = {
    ("server", "cli"),
    ("storage", "cli"),
    ("client", "cli"),
    ("cluster", "cli"),
    ("ops", "cli"),
    ("protocol", "transport"),
    ("storage", "server"),
    ("server", "storage"),
    ("client", "server"),
    ("client", "storage"),
}


def _edges() -> set[tuple[str, str, str]]:
    found: set[tuple[str, str, str]] = set()
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        pkg = rel.parts[0].removesuffix(".py")
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            modules: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "waltz":
                    modules = [f"waltz.{alias.name}" for alias in node.names]
                elif node.module.startswith("waltz."):
                    modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names if a.name.startswith("waltz.")]
            for module in modules:
                target = module.split(".")[1]
                if target != pkg:
                    found.add((pkg, target, str(rel)))
    return found


EDGES = _edges()


def test_every_package_is_in_the_table() -> None:
    packages = {
        p.name.removesuffix(".py") for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert packages - set(ALLOWED) == set(), "add new packages to ALLOWED and docs/architecture.md"


def test_the_forbidden_edges_are_not_allowed_by_the_table() -> None:
    assert {(a, b) for a, b in FORBIDDEN if b in ALLOWED.get(a, set())} == set()


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_package_imports_only_what_the_layering_allows(pkg: str) -> None:
    bad = sorted(
        f"{where} imports waltz.{target}"
        for src, target, where in EDGES
        if src == pkg and target not in ALLOWED[pkg]
    )
    assert bad == []


def test_the_checker_sees_imports() -> None:
    # The scan must find the edges it is meant to police; an empty scan would pass every test above.
    assert ("server", "protocol") in {(a, b) for a, b, _ in EDGES}
    assert ("cli", "server") in {(a, b) for a, b, _ in EDGES}


def _module_imports(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (anywhere in it, ``TYPE_CHECKING`` blocks included)."""
    modules: dict[str, set[str]] = {}
    for path in (SRC / package).rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        modules[name] = found
    return {m: {t for t in targets if t in modules and t != m} for m, targets in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a path that comes back to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


PACKAGES = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists())

KNOWN_CYCLES: dict[str, str] = {}
"""Packages with an import cycle still, each with why and who removes it; the list may hold no stale entry."""


def _package_cycle(package: str) -> list[str] | None:
    # A package's ``__init__`` re-exports its modules; an edge into it is an edge into them, not a cycle.
    graph = _module_imports(package)
    inits = {m for m in graph if (SRC.parent / m.replace(".", "/") / "__init__.py").exists()}
    graph = {m: targets - inits for m, targets in graph.items()}
    return _cycle(graph)


@pytest.mark.parametrize("package", [p for p in PACKAGES if p not in KNOWN_CYCLES])
def test_no_import_cycle_between_the_modules_of(package: str) -> None:
    assert _package_cycle(package) is None


def test_every_known_cycle_is_still_one() -> None:
    for package in sorted(KNOWN_CYCLES):
        assert package in PACKAGES
        assert _package_cycle(package) is not None, f"{package} has no cycle now: remove it from KNOWN_CYCLES"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_storage_nodes_and_servers_do_not_load_the_client_library() -> None:
    # Importing any module of the package runs waltz/__init__.py first: the client API there must stay lazy
    # (and the version must come from waltz.version), or every storage node and server loads the client.
    code = (
        "import sys, waltz.cli.main, waltz.cli.storage, waltz.cli.server, waltz.storage.node, "
        "waltz.server.server, waltz.http\n"
        "print(sorted(m for m in sys.modules if m == 'waltz.client' or m.startswith('waltz.client.')))"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_package_root_still_offers_the_client_api() -> None:
    assert {name: getattr(waltz, name).__name__ for name in waltz.__all__ if name != "__version__"} == {
        name: name for name in waltz.__all__ if name != "__version__"
    }
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = waltz.nothing
