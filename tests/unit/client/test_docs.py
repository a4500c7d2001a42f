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


def test_the_service_bench_runs_the_docs_service_block() -> None:
    """bench/service.py measures the tutorial's asyncio service as the doc writes it: one python block that
    starts with its marker, which test_tutorial_runs runs too."""
    blocks = re.findall(
        r"^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE
    )
    service = [b for b in blocks if b.startswith("# The counter service")]
    assert len(service) == 1
    bench = (DOC.parents[1] / "bench" / "service.py").read_text(encoding="utf-8")
    assert 'MARKER = "# The counter service"' in bench
    assert "async def apply_transaction" in service[0]
    assert "callback_mode" not in service[0]  # The defaults, as written.
