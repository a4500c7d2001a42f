"""What an operator reads in the logs of real processes at the default level (INFO): a failover, a replica
that dies and comes back, and the JSON line format."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient
from tests.integration.server_process import Cluster, ServerProcess, wait_until
from tests.integration.waltz_process import WaltzProcess
from waltz import __version__, local
from waltz.cluster.membership import ClusterWatcher

pytestmark = [pytest.mark.integration]


async def _owner(cluster: Cluster, watcher: ClusterWatcher, not_port: int = 0) -> tuple[ServerProcess, int]:
    endpoints = await watcher.wait_for(lambda e: 0 in e and not e[0][0].endswith(f":{not_port}"), 30)
    server, generation = endpoints[0]
    return cluster.server_by_port(int(server.rpartition(":")[2])), generation


async def _log_shows(proc: WaltzProcess, pattern: str, timeout_s: float = 20.0) -> re.Match[str]:
    await wait_until(
        lambda: re.search(pattern, proc.log_text()), timeout_s, f"{proc.name} to log {pattern!r}"
    )
    match = re.search(pattern, proc.log_text())
    assert match is not None
    return match


@pytest.mark.timeout(120)
def test_a_failover_and_a_returning_replica_leave_one_info_line_per_event(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=2)
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            old_owner, _ = await _owner(cluster, watcher)
            client = await RawClient(watcher, 1).start()
            try:
                for i in range(20):
                    await client.append_and_wait(b"%d" % i)
                old_owner.kill()
                new_owner, generation = await _owner(cluster, watcher, not_port=old_owner.port)
                await client.append_and_wait(b"after the failover")
                hwm = client.hwm

                # The new owner tells the takeover: start, ZooKeeper, partition opened, store session opened
                # with how it recovered and where.
                await _log_shows(
                    new_owner,
                    rf"INFO waltz.server.server: waltz server {re.escape(__version__)} "
                    r"starting \(python [\d.]+",
                )
                await _log_shows(new_owner, r"INFO waltz.cluster.zk: ZooKeeper session started")
                await _log_shows(new_owner, rf"partition 0 opened at generation {generation}, replicas")
                opened = await _log_shows(
                    new_owner,
                    rf"partition 0: store session (\d+) opened \(generation {generation}\) at high-water "
                    r"mark (\d+) after [\d.]+ s of recovery: previous session \d+, votes ",
                )
                assert int(opened.group(2)) == 19  # the 20 appends acknowledged before the kill
                # Each storage node logs the new session fencing the old owner's.
                for sp in cluster.storages:
                    await _log_shows(sp, rf"partition 0: session {opened.group(1)} from .* fences session")

                # A replica dies: the session ends naming it; it comes back and catches up.
                victim = cluster.storages[2]
                victim.kill()
                await client.append_and_wait(b"while a replica is down")
                await _log_shows(
                    new_owner, rf"store session \d+ ends: replica failed \(127.0.0.1:{victim.port}"
                )
                await asyncio.to_thread(victim.start)
                await _log_shows(
                    new_owner,
                    rf"partition 0: replica 127.0.0.1:{victim.port} caught up and rejoined session \d+ "
                    r"[\d.]+ s after the session started",
                )
                assert client.hwm >= hwm + 1
            finally:
                await client.aclose()

        server_log = new_owner.log_text()
        assert " DEBUG " not in server_log  # INFO by default: no connection chatter
        assert "Traceback" not in server_log
        for proc in [*cluster.servers, *cluster.storages]:
            assert "Connection dropped" not in proc.log_text()  # kazoo's per-attempt warnings stay quiet
        for sp in cluster.storages[:2]:
            text = sp.log_text()
            assert re.search(rf"waltz storage node {re.escape(__version__)} starting", text)
            assert "partition 0 assigned (max transaction id -1)" in text

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_log_format_json_writes_one_object_per_line(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.add_storage()
        server = ServerProcess(
            cluster.base, zk_connect=cluster.zk_connect, cluster_root=cluster.root, name="json-server"
        )
        server.extra_args = ["--log-format", "json", "--log-level", "debug"]
        cluster.servers.append(server)
        await asyncio.to_thread(server.start)
        await wait_until(lambda: "store session" in server.log_text(), 20, "a store session line")
        lines = [line for line in server.log_text().splitlines() if line.strip()]
        records = [json.loads(line) for line in lines]  # every line is one JSON object
        assert {"ts", "level", "logger", "msg"} <= set(records[0])
        assert any(r["level"] == "DEBUG" for r in records)
        assert any(r["msg"].startswith("partition 0 opened at generation") for r in records)

    asyncio.run(main())


@pytest.fixture
def local_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "local"
    try:
        yield directory
    finally:
        if (directory / "cluster.json").exists():
            local.down(directory)


@pytest.mark.timeout(120)
def test_waltz_local_passes_the_log_options_to_the_processes_it_starts(local_dir: Path) -> None:
    options = ["--log-level", "debug", "--log-format", "json"]
    size = ["--storages", "1", "--servers", "1", "--partitions", "1"]
    up = subprocess.run(
        [sys.executable, "-m", "waltz.cli.main", *options, "local", "up", "--dir", str(local_dir), *size],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert up.returncode == 0, up.stderr
    for name in ("server-0", "storage-0"):
        lines = (local_dir / "logs" / f"{name}.log").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        assert records, name
        assert records[0]["msg"].startswith("waltz "), records[0]
        assert any(r["level"] == "DEBUG" for r in records), name


@pytest.mark.timeout(60)
def test_an_expired_zookeeper_session_is_three_lines_not_a_warning_per_attempt(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=1, servers=1)
        server = cluster.servers[0]
        server.pause()  # longer than the 4 s session: ZooKeeper expires it
        await asyncio.sleep(5)
        server.resume()
        await _log_shows(server, r"WARNING waltz.cluster.zk: ZooKeeper session expired")
        await _log_shows(server, r"(?s)session expired.*INFO waltz.cluster.zk: ZooKeeper session started")
        text = server.log_text()
        zk_lines = [line for line in text.splitlines() if "waltz.cluster.zk" in line or "kazoo" in line]
        assert len(zk_lines) <= 4, zk_lines  # started, (lost,) expired, started again
        assert "Connection dropped" not in text

    asyncio.run(main())
