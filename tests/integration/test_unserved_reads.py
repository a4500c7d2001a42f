"""A partition whose store session was open and then ended is not served, and every read path says so at once
(issue 12, item 5): the server no longer answers with the last high-water mark it knew, and range reads get an
answer instead of none (readers waited out their request timeout for it).

Real ZooKeeper, three storage nodes and one server process: the quorum is lost by stopping two storage nodes,
then the reader (``LogReader``: high-water mark, ranges, runs, the record iterator) and ``waltz client
high-water-mark`` must fail with a retriable "partition 0 is not served" well inside the request timeout.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient
from tests.integration.server_process import TEST_ZK_SESSION_TIMEOUT_MS, wait_until
from waltz.client.config import ClientConfig
from waltz.client.reader import LogReader
from waltz.cluster.membership import ClusterWatcher
from waltz.errors import ClientTimeoutError, PartitionNotReadyError
from waltz.local.probe import http_get

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RECORDS = 20
REQUEST_TIMEOUT_MS = 3000
"""Each read retries a not-served partition within this, then fails; without an answer from the server an
attempt alone takes longer (the reader's 5 s attempt timeout)."""


@pytest.mark.timeout(120)
def test_a_partition_that_lost_its_quorum_fails_every_read_path_promptly(
    cluster_factory: ClusterFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = cluster_factory()
    config = ClientConfig(
        zookeeper_connect_string=cluster.zk_connect,
        zookeeper_session_timeout_ms=TEST_ZK_SESSION_TIMEOUT_MS,
        cluster_root=cluster.root,
        request_timeout_ms=REQUEST_TIMEOUT_MS,
    )

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        server = cluster.servers[0]
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            writer = await RawClient(watcher, 1).start()
            try:
                futures = [await writer.append(b"committed-%02d" % i) for i in range(RECORDS)]
                assert await asyncio.gather(*futures) == list(range(RECORDS))
            finally:
                await writer.aclose()

        async with LogReader(config) as reader:
            # Served: the mark and every record.
            assert await reader.high_water_mark(0) == RECORDS - 1
            assert len((await reader.read_run(0, 0, RECORDS)).records()) == RECORDS

            for storage in cluster.storages[1:]:
                await asyncio.to_thread(storage.stop)

            def unserved() -> bool:
                status, _ = http_get(server.http_port, "/health")
                return status != 200

            # The server's session ends (one replica left of three); /health has said so all along.
            await wait_until(unserved, 30, "the server to lose partition 0's store session")

            calls = {
                "high_water_mark": lambda: reader.high_water_mark(0),
                "read_range": lambda: reader.read_range(0, 0, 10),
                "read_run": lambda: reader.read_run(0, 5, 10),
                "read": lambda: reader.read(0, 0, RECORDS - 1).__anext__(),
            }
            caplog.set_level("DEBUG", logger="waltz.client")
            for name, call in calls.items():
                started = time.monotonic()
                with pytest.raises(ClientTimeoutError) as caught:
                    await call()
                elapsed_s = time.monotonic() - started
                # Answered, then retried within the request timeout: not one 5 s attempt waiting for nothing.
                assert elapsed_s < REQUEST_TIMEOUT_MS / 1000 + 2, (name, elapsed_s)
                assert caught.value.retriable, name
                assert isinstance(caught.value.__cause__, PartitionNotReadyError), name
                assert "partition 0 is not served" in str(caught.value), name
            # Only the first read waited (up to 1 s) for a session: the later ones were answered at once, so
            # a reader retried many times within its timeout (a 1 s wait per attempt leaves room for two).
            messages = [r.getMessage() for r in caplog.records]
            retries = [m for m in messages if m.startswith("read_range(0, 0, 10)") and "retrying" in m]
            assert len(retries) >= 4, retries

        # The CLI: an error and a non-zero exit status, not the last mark the server knew.
        client_yaml = tmp_path / "client.yaml"
        client_yaml.write_text(
            f"zookeeper.connectString: {cluster.zk_connect}\n"
            f"zookeeper.sessionTimeout: {TEST_ZK_SESSION_TIMEOUT_MS}\n"
            f"cluster.root: {cluster.root}\n"
            f"client.requestTimeout: {REQUEST_TIMEOUT_MS}\n",
            encoding="utf-8",
        )
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "waltz.cli.main", "client", "high-water-mark", "-c", str(client_yaml)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode != 0
        assert "not served" in result.stderr
        assert str(RECORDS - 1) not in result.stdout

        # The quorum back: served again, nothing lost.
        for storage in cluster.storages[1:]:
            await asyncio.to_thread(storage.start)
        async with LogReader(config.replace(request_timeout_ms=30000)) as reader:
            assert await reader.high_water_mark(0) == RECORDS - 1
            records = [r async for r in reader.read(0)]
            assert [r.data for r in records] == [b"committed-%02d" % i for i in range(RECORDS)]

    asyncio.run(main())
