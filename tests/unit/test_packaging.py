"""Packaging: the declared license ships as a file, the package is marked typed, and ``rich`` (which only the
``waltz`` command draws with) is imported by nothing a server, storage node or application loads."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import waltz

SRC = Path(waltz.__file__).parent
ROOT = SRC.parents[1]


def _project() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        data: dict[str, object] = tomllib.load(f)
    return data


def test_the_license_file_is_the_declared_apache_license() -> None:
    project = _project()["project"]
    assert isinstance(project, dict)
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_classifiers_say_typed_and_python_3_only() -> None:
    project = _project()["project"]
    assert isinstance(project, dict)
    classifiers = project["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3 :: Only" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)  # the SPDX expression says it


def test_py_typed_is_package_data() -> None:
    assert (SRC / "py.typed").is_file()
    tool = _project()["tool"]
    assert isinstance(tool, dict)
    assert "py.typed" in tool["setuptools"]["package-data"]["waltz"]


def _rich_importers() -> set[str]:
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            if any(n == "rich" or n.startswith("rich.") for n in names):
                found.add(str(path.relative_to(SRC)))
    return found


def test_rich_is_imported_by_the_command_line_only() -> None:
    importers = _rich_importers()
    assert importers, "nothing imports rich: drop the dependency"
    assert all(p.startswith("cli/") for p in importers), importers


def test_servers_storage_nodes_clients_and_the_cli_entry_do_not_load_rich() -> None:
    code = (
        "import sys, waltz, waltz.server.server, waltz.storage.node, waltz.client.core, waltz.cli.main;"
        "waltz.cli.main.build_parser();"
        "print('rich' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"
