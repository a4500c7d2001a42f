"""The peer comparison and the many-clients phase run end to end, briefly: ``bench/peer.py`` against a real
3-node JetStream cluster and a real ``waltz local`` cluster (default and tuned client), every phase; and
``bench/clients.py`` with a few client processes against one cluster. Their figures are docs/BENCHMARKS.md's;
here only that every phase of every system ran and counted acknowledged appends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench import clients, peer

from waltz import local

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_peer_runs_every_phase_against_jetstream_and_waltz(capsys: pytest.CaptureFixture[str]) -> None:
    results = peer.main(["--seconds", "0.5", "--warmup", "0.3"])

    ran = {(r.system, r.phase): r.ops for r in results}
    assert set(ran) == {(s, p) for s in peer.SYSTEMS for p in peer.PHASES}
    assert all(ops > 0 for ops in ran.values()), ran
    out = capsys.readouterr().out
    assert "load average at start" in out
    assert "waltz-tuned/js" in out.splitlines()[-len(peer.PHASES) - 3]  # the table's head, then its rows


@pytest.mark.timeout(300)
def test_clients_phase_measures_each_process(tmp_path: Path) -> None:
    cluster = local.up(local.UpOptions(directory=tmp_path / "cluster", storages=1, servers=1, partitions=1))
    try:
        one, many = clients.run(Path(cluster.directory) / "client.yaml", clients=3, in_flight=2, seconds=1.0)
    finally:
        local.down(cluster.directory, purge=True)

    assert (one.processes, one.in_flight) == (1, 6)
    assert (many.processes, many.in_flight) == (3, 2)
    assert one.children[0].count > 0
    assert len(many.children) == 3
    assert all(c.count > 0 for c in many.children), many.children
    assert "slowest process / mean" in clients.verdict(one, many)
