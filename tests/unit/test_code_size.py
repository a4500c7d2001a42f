"""The size limits of the developers' guide: no function over 70 lines and no module over 900.

A function fits a screen; a module a reader can hold in mind. The checked part of ``src/waltz`` is
:data:`CHECKED` (folders or modules, relative to the package); checking all of it is ``CHECKED = ("",)``.
An exception is listed in :data:`EXCEPTIONS` with the reason it is one (a codec table, say), and the list
may hold no stale entry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import waltz

SRC = Path(waltz.__file__).parent

MAX_FUNCTION_LINES = 70
MAX_MODULE_LINES = 900

CHECKED: tuple[str, ...] = ("",)
"""What is checked, relative to ``src/waltz``: ``""`` is all of it."""

EXCEPTIONS: dict[str, str] = {
    "protocol/storage.py": (
        "the storage codec table: the byte-by-byte format of its 27 messages (the 220-line module doc) "
        "beside their classes and the type table, so the documented format and its codec change together"
    ),
}
"""``"path/of/module.py"`` or ``"path/of/module.py::Class.function"`` -> why it may be longer."""


def _modules() -> list[Path]:
    found: set[Path] = set()
    for part in CHECKED:
        path = SRC / part
        found.update([path] if path.suffix == ".py" else path.rglob("*.py"))
    return sorted(found)


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of every function and method in ``tree``, nested ones included."""
    out: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            assert node.end_lineno is not None
            out.append((name, node.end_lineno - node.lineno + 1))
            out.extend(_functions(node, f"{name}."))
        elif isinstance(node, ast.ClassDef):
            out.extend(_functions(node, f"{prefix}{node.name}."))
        else:
            out.extend(_functions(node, prefix))
    return out


def _oversized() -> dict[str, int]:
    """Every module and function over its limit in the checked code, with its length in lines."""
    over: dict[str, int] = {}
    for path in _modules():
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text()
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines > MAX_MODULE_LINES:
            over[rel] = lines
        for name, n in _functions(ast.parse(text, filename=str(path))):
            if n > MAX_FUNCTION_LINES:
                over[f"{rel}::{name}"] = n
    return over


def test_no_function_or_module_is_over_its_limit_unless_listed_with_a_reason() -> None:
    unexplained = {where: n for where, n in _oversized().items() if where not in EXCEPTIONS}
    assert unexplained == {}, (
        f"over {MAX_FUNCTION_LINES} lines per function or {MAX_MODULE_LINES} per module: split them, or list "
        "them in EXCEPTIONS with the reason"
    )


def test_every_listed_exception_is_still_one() -> None:
    oversized = _oversized()
    assert all(reason.strip() for reason in EXCEPTIONS.values())
    assert sorted(set(EXCEPTIONS) - set(oversized)) == []


def test_the_checker_sees_long_functions() -> None:
    tree = ast.parse("class A:\n    def f(self):\n" + "        x = 1\n" * 80 + "\ndef g():\n    pass\n")
    assert dict(_functions(tree)) == {"A.f": 81, "g": 2}
    assert _modules(), "CHECKED names nothing"
