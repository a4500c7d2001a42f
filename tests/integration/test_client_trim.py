"""Trimming through the client, and reads below the trim point (issue 26). ``AsyncWaltzClient.trim`` and
``WaltzClient.trim`` raise the trim point in ZooKeeper under the rules of ``waltz cluster trim`` (only up,
never above the committed high-water mark + 1, never into the grace), and the owning server passes it on to
the replicas. Below it, a range read (``LogReader``) and a mount fail with TrimmedError, naming the partition,
the requested id and the trim point; an instance restored from a snapshot mounts and replays the rest."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import ClientTestCluster, CounterApp, Tagged
from tests.integration.server_process import wait_until
from waltz import AsyncWaltzClient, WaltzClient
from waltz.client.reader import LogReader
from waltz.cluster.features import write_feature_version
from waltz.cluster.retention import update_retention
from waltz.cluster.trim_points import cancel_pending_trim, read_trim_points
from waltz.errors import MetadataError, TrimmedError
from waltz.ops.servers import ADMIN_CLIENT_ID
from waltz.protocol import client_server as cs
from waltz.protocol.framing import MAGIC_CLIENT
from waltz.protocol.records import ReqId
from waltz.transport import open_connection

pytestmark = pytest.mark.integration

RECORDS = 30


@pytest.mark.timeout(120)
def test_an_application_trims_its_partition_through_the_client(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with ClientTestCluster(tmp_path, zk, zk_connect_string, feature_version=1) as cluster:
            config = cluster.client_config()
            async with AsyncWaltzClient(CounterApp(1), config) as client:
                for i in range(RECORDS):
                    await client.submit(Tagged(b"t%d" % i))
                await client.flush_transactions(30)
                assert await client.high_water_mark(0) == RECORDS - 1
                with pytest.raises(MetadataError, match="trim point 31 is above the high-water mark 29"):
                    await client.trim(0, 31, min_kept_transactions=0)
                with pytest.raises(MetadataError, match="would keep fewer than the 1000 most recent"):
                    await client.trim(0, 10)
                assert read_trim_points(zk, cluster.root).of(0) == 0
                # At feature version 1 (a Waltz 0.1.0 server may still run) a trim cannot be pending.
                with pytest.raises(MetadataError, match="needs feature version 2, and the cluster is at 1"):
                    await client.trim(0, 20, min_kept_transactions=10)
                write_feature_version(zk, cluster.root, 2, -1)
                # The cluster's grace (an hour by default): the trim point is pending, nothing is deleted.
                pending = await client.trim(0, 20, min_kept_transactions=10)
                assert pending.message.startswith(
                    "partition 0: trim point 20 pending, set by an application; it takes effect at"
                )
                assert pending.effective_at_ms >= time.time() * 1000 + 3_500_000
                assert read_trim_points(zk, cluster.root).of(0) == 0
                assert "cancelled" in cancel_pending_trim(zk, cluster.root, 0)
                update_retention(zk, cluster.root, grace_ms=0)  # from now on, in force at once
                outcome = await client.trim(0, 20, min_kept_transactions=10)
                assert (outcome.before, outcome.after) == (0, 20)
                assert outcome.message == "partition 0: trim point raised from 0 to 20"
                again = await client.trim(0, 15, min_kept_transactions=10)
                assert (again.before, again.after) == (20, 20)
                assert "already trimmed to 20; nothing to do for 15" in again.message
            await check_reads_below_the_trim_point(cluster)
            await check_a_v5_peer_still_reads(cluster)
            # The blocking client, from a thread.
            sync_outcome = await asyncio.to_thread(sync_trim, cluster, 25)
            assert (sync_outcome.before, sync_outcome.after) == (20, 25)
            assert read_trim_points(zk, cluster.root).of(0) == 25
            server = cluster.servers[0]
            await wait_until(
                lambda: "trim point 25 sent to replicas" in server.log_text(), 30, "the server to pass it on"
            )

    async def check_reads_below_the_trim_point(cluster: ClientTestCluster) -> None:
        # Range reads through the server: TrimmedError at once (before codec V6: no answer, a timeout).
        async with LogReader(cluster.client_config(request_timeout_ms=60_000)) as reader:
            with pytest.raises(TrimmedError, match="transaction 5 is below the trim point 20") as caught:
                await reader.read_range(0, 5, 10)
            assert (caught.value.partition_id, caught.value.transaction_id, caught.value.trim_point) == (
                0,
                5,
                20,
            )
            with pytest.raises(TrimmedError, match="transaction 0 is below the trim point 20"):
                [r async for r in reader.read(0)]
            assert [r.transaction_id async for r in reader.read(0, start=20)] == list(range(20, RECORDS))
        # A new instance with an empty database mounts below the trim point: the partition fails with it.
        empty = CounterApp(1)
        caplog.clear()
        with caplog.at_level("ERROR", logger="waltz"):
            async with AsyncWaltzClient(empty, cluster.client_config(mount_timeout_ms=60_000)) as client:
                with pytest.raises(TrimmedError, match="transaction 0 is below the trim point 20"):
                    await client.wait_applied(0, 0, timeout=30)
                with pytest.raises(TrimmedError):
                    await client.submit(Tagged(b"refused"))
        assert any("is below the trim point 20" in e for e in empty.errors)
        # The stop is one ERROR line that names the partition once.
        lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert [line for line in lines if "trim point" in line] == [
            "partition 0 stopped: transaction 0 is below the trim point 20 "
            "(transactions 0..19 were trimmed); bootstrap from a snapshot at or above 19"
        ], lines
        # One restored from a snapshot at 19 mounts and replays the rest.
        restored = CounterApp(1, start_hwm=19)
        async with AsyncWaltzClient(restored, cluster.client_config()) as client:
            await client.wait_applied(0, RECORDS - 1, timeout=30)
        assert [t for t, _ in restored.applied[0]] == list(range(20, RECORDS))

    async def check_a_v5_peer_still_reads(cluster: ClientTestCluster) -> None:
        # A peer without codec V6 cannot be told: its read below the trim point goes unanswered, as before;
        # its reads above it work on the same connection.
        conn = await open_connection(
            "127.0.0.1",
            cluster.servers[0].port,
            magic=MAGIC_CLIENT,
            versions=(0, 1, 2, 3, 4, 5),
            hello_text="V5 reader",
        )
        try:
            assert conn.negotiated_version == 5

            async def ask(seq: int, start: int, timeout_s: float) -> cs.Message:
                req = cs.TransactionRangeRequest(ReqId.of(ADMIN_CLIENT_ID, 1, 0, seq), start, 5)
                conn.send(cs.encode(req, 5))
                await conn.drain()
                async with asyncio.timeout(timeout_s):
                    return cs.decode(await conn.receive(), 5)

            with pytest.raises(TimeoutError):
                await ask(1, 5, 1.0)
            answer = await ask(2, 22, 30)
            assert isinstance(answer, cs.TransactionRangeResponse)
            assert [r.transaction_id for r in answer.records()] == [22, 23, 24, 25, 26]
        finally:
            await conn.aclose()

    def sync_trim(cluster: ClientTestCluster, target: int) -> object:
        with WaltzClient(CounterApp(1), cluster.client_config()) as client:
            return client.trim(0, target, min_kept_transactions=5)

    asyncio.run(main())
