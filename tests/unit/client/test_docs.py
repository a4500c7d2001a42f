"""The tutorial in docs/client.md runs as written (its python blocks form one program)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "client.md"


def test_tutorial_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(
        r"^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE
    )
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)  # The tutorial's SQLite file goes here.
    namespace: dict[str, object] = {"__name__": "tutorial"}
    exec(compile("\n".join(blocks), str(DOC), "exec"), namespace)
    engine = namespace["engine"]
    engine.dispose()  # type: ignore[attr-defined]
