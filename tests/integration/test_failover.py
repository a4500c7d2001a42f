"""Failover under load on a ``waltz local up --zookeepers 3`` cluster with its default settings: a killed
server, a killed ZooKeeper leader, a lost ZooKeeper quorum. One cluster for the module (3 ZooKeepers, 3
storage nodes, 2 servers, 4 partitions); each test puts back what it killed. The drills are
``bench/failover.py``'s, which also measures the figures in docs/deploy.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench import failover

from waltz import local
from waltz.client.config import ClientConfig
from waltz.client.core import AsyncWaltzClient
from waltz.errors import ClientTimeoutError
from waltz.local import procs
from waltz.local.state import LocalCluster
from waltz.perf.common import MarkCallbacks, ReportingContext

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("failover") / "cluster"
    try:
        local.up(local.UpOptions(directory=directory, zookeepers=3, storages=3, servers=2, partitions=4))
        yield directory
    finally:
        if (directory / "cluster.json").exists():
            local.down(directory)
            cluster = LocalCluster.load(directory)
            assert not any(procs.is_alive(p.process) for p in cluster.processes)


def assert_nothing_lost(report: failover.LoadReport) -> None:
    assert report.failed == 0, report.errors
    assert report.acked == report.submitted
    assert report.missing == 0
    assert report.duplicated == 0


@pytest.mark.timeout(300)
def test_a_killed_server_is_replaced_within_3_s_and_no_submit_fails(cluster_dir: Path) -> None:
    assert LocalCluster.load(cluster_dir).zk_session_timeout_ms == local.DEFAULT_ZK_SESSION_TIMEOUT_MS

    async def run() -> tuple[float, failover.LoadReport]:
        load = failover.Load(ClientConfig.from_yaml(cluster_dir / "client.yaml"))
        await load.start()
        try:
            await load.wait_acked(100, 30)
            unserved_s = await failover.kill_server(cluster_dir)
            await load.wait_acked(200, 30)  # appends continue on the survivor
        finally:
            report = await load.stop()
        return unserved_s, report

    try:
        unserved_s, report = asyncio.run(run())
    finally:
        failover.restore(cluster_dir)
    assert unserved_s <= 3.0
    assert_nothing_lost(report)
    assert report.longest_wait_s < 10  # within client.mountTimeout, the bound a submit waits for a mount


@pytest.mark.timeout(300)
def test_zookeeper_leader_killed_under_load(cluster_dir: Path) -> None:
    async def run() -> tuple[int, failover.LoadReport]:
        load = failover.Load(ClientConfig.from_yaml(cluster_dir / "client.yaml"))
        await load.start()
        try:
            await load.wait_acked(100, 30)
            leader, _ = await failover.kill_zk_leader(cluster_dir)
            await load.wait_acked(300, 30)
        finally:
            report = await load.stop()
        return leader, report

    try:
        leader, report = asyncio.run(run())
        cluster = LocalCluster.load(cluster_dir)
        assert not procs.is_alive(cluster.zookeepers[leader].process)
        assert failover.zk_leader(cluster) != leader  # the other two elected a new one
    finally:
        failover.restore(cluster_dir)
    assert_nothing_lost(report)


@pytest.mark.timeout(300)
def test_zookeeper_quorum_lost_under_load(cluster_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Submits wait while no quorum answers and say it is ZooKeeper they wait on (the log, and the error of
    a client whose timeouts are shorter than the outage); then everything resumes and nothing is lost."""
    caplog.set_level(logging.WARNING, logger="waltz.client.core")
    config = ClientConfig.from_yaml(cluster_dir / "client.yaml")
    impatient_config = config.replace(
        max_concurrent_transactions=1, submit_timeout_ms=1000, mount_timeout_ms=1000
    )

    async def run() -> tuple[str, failover.LoadReport]:
        # More contexts in flight than the client's slots (4 partitions x 5): submits also wait for room.
        load = failover.Load(config, window=40)
        await load.start()
        impatient = AsyncWaltzClient(MarkCallbacks({}), impatient_config)
        await impatient.start()
        loop = asyncio.get_running_loop()
        try:
            await load.wait_acked(100, 30)
            cluster = LocalCluster.load(cluster_dir)
            leader = failover.zk_leader(cluster)
            victims = [leader, next(z.index for z in cluster.zookeepers if z.index != leader)]
            for index in victims:
                await asyncio.to_thread(local.kill, cluster_dir, "zookeeper", index)
            # One transaction in flight fills the impatient client's only slot; the next submit times out.
            await impatient.submit(ReportingContext(loop, 0, b"impatient:0"))
            with pytest.raises(ClientTimeoutError) as refused:
                await impatient.submit(ReportingContext(loop, 0, b"impatient:1"))
            await asyncio.sleep(1.0)
            for index in victims:
                await asyncio.to_thread(local.start, cluster_dir, "zookeeper", index)
            await load.wait_acked(300, 60)  # appends resume
        finally:
            report = await load.stop()
            await impatient.close()
        return str(refused.value), report

    try:
        refused, report = asyncio.run(run())
    finally:
        failover.restore(cluster_dir)
    assert "waiting on ZooKeeper" in refused
    assert "client.maxConcurrentTransactions" not in refused
    said = [r.getMessage() for r in caplog.records if r.name == "waltz.client.core"]
    assert any("waiting on ZooKeeper" in m and "has not answered this client" in m for m in said), said
    assert_nothing_lost(report)
