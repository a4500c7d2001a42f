"""The bank's invariants on a real local cluster while a storage node and a server are killed mid-run."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from demo.bank.__main__ import instance_factory
from demo.bank.auto import AutoOptions, Drill, run_auto
from rich.console import Console

from waltz import local
from waltz.client.config import ClientConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "cluster"
    local.up(local.UpOptions(directory=directory, storages=3, servers=2, partitions=2))
    try:
        yield directory
    finally:
        local.down(directory)


@pytest.mark.timeout(300)
def test_bank_invariants_hold_with_a_storage_node_and_a_server_killed(cluster_dir: Path) -> None:
    config = ClientConfig.from_yaml(cluster_dir / "client.yaml")
    factory = instance_factory(config, cluster_dir / "bank", None)
    drills = [
        Drill(3, "kill storage 1", lambda: local.kill(cluster_dir, "storage", 1)),
        Drill(6, "kill server 0", lambda: local.kill(cluster_dir, "server", 0)),
        Drill(13, "start storage 1", lambda: local.start(cluster_dir, "storage", 1)),
        Drill(15, "start server 0", lambda: local.start(cluster_dir, "server", 0)),
    ]
    opts = AutoOptions(instances=2, duration_s=20, accounts=20, rate_per_instance=15, seed=11)
    output = io.StringIO()
    report = run_auto(factory, opts, drills, Console(file=output, width=120))
    assert report.ok, report.render()
    assert len(report.drills) == 4
    assert not any("FAILED" in d for d in report.drills), report.drills
    assert report.totals["committed"] > 50
    assert sum(report.high_water_marks.values()) + len(report.high_water_marks) >= report.totals["committed"]
    status = local.status(cluster_dir)
    assert all(p.running for p in status.processes)
