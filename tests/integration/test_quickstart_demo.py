"""The quickstart's first command, ``python -m demo.run``, as a user runs it (short, no Spark report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_demo_run_brings_a_cluster_up_runs_the_bank_and_leaves_nothing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "demo.run", "--seconds", "9", "--no-report", "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "== waltz local up" in result.stdout
    assert "== waltz local down" in result.stdout
    # ``local down`` stopped every process ``up`` started (cluster.json keeps their pids).
    state = json.loads((tmp_path / "cluster" / "cluster.json").read_text())
    pids = [state["zookeeper"]["pid"]] + [p["pid"] for p in state["storages"] + state["servers"]]
    assert len(pids) == 6
    assert all(isinstance(pid, int) for pid in pids)
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"still running after local down: {alive}"
