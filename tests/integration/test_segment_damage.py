"""Bit rot inside a segment is kept as damage when a storage node restarts, never cut as a torn tail (issue
24): a flipped byte in a committed record near the start of the only segment, found when the killed node
restarts. Every other acknowledged transaction stays served; with three replicas the damaged copy is
repaired."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import NotCommitted, RawClient
from tests.integration.server_process import wait_until
from tests.integration.test_security_probes import _flip_byte
from waltz.cluster.membership import ClusterWatcher
from waltz.errors import CorruptionError, StorageRpcError
from waltz.storage.index_writes import FLUSHED_INDEX_DELAY_S

pytestmark = [pytest.mark.integration]

RECORDS = 300


@pytest.mark.timeout(120)
@pytest.mark.parametrize("replicas", [1, 3])
def test_a_flipped_byte_near_the_start_of_a_segment_loses_nothing_at_a_restart(
    cluster_factory: ClusterFactory, replicas: int
) -> None:
    cluster = cluster_factory(server_config={"storage.damagePollInterval": 200})

    async def main() -> None:
        await cluster.start(storages=replicas, servers=1)
        bad = cluster.storages[0]
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 1).start()
            try:
                futures = [await client.append(b"record-%04d" % i) for i in range(RECORDS)]
                assert await asyncio.gather(*futures) == list(range(RECORDS))
                # The node writes the index entries of flushed records within FLUSHED_INDEX_DELAY_S of their
                # fsync (waltz.storage.index_writes); bit rot strikes records older than that.
                await asyncio.sleep(5 * FLUSHED_INDEX_DELAY_S)
                # A crash (no clean close: the index was never completed by a checkpoint), then bit rot.
                await asyncio.to_thread(bad.kill)
                _flip_byte(bad, 0, b"record-0001")
                await asyncio.to_thread(bad.start)
                text = bad.log_text()
                assert "transaction(s) 1..1 do not verify but were durable" in text
                assert "partial or unverified tail" not in text
                # The server carries on at 300: nothing acknowledged was cut.
                assert await asyncio.wait_for(_append_once_served(client, b"after"), 60) == RECORDS
                assert client.violations == []
            finally:
                await client.aclose()
        async with await cluster.admin(bad) as admin:
            rest = await admin.read_records(0, 2, RECORDS - 2)
        assert [r.data for r in rest] == [b"record-%04d" % i for i in range(2, RECORDS)]
        if replicas == 1:
            # The damaged record is reported (nowhere to repair it from), the rest served.
            assert "stored transaction 1 is damaged on this node" in bad.log_text()
            async with await cluster.admin(bad) as admin:
                with pytest.raises(StorageRpcError, match="record 1 at offset 179: record checksum mismatch"):
                    await admin.read_records(0, 1, 1)
            return

        async def repaired() -> bool:
            async with await cluster.admin(bad) as admin:
                try:
                    (rec,) = await admin.read_records(0, 1, 1)
                except (CorruptionError, StorageRpcError):
                    return False
            return rec.data == b"record-0001" and rec.verify()

        await wait_until(repaired, 30, "the damaged copy to be repaired from a good replica")
        assert "repaired 1 damaged record(s) from another replica's copy (1..1)" in bad.log_text()

    asyncio.run(main())


async def _append_once_served(client: RawClient, data: bytes) -> int:
    """Append ``data`` until it commits. An append sent while the store session that lost its replica is
    ending is answered "not in the log" (definitive: it is not there), and is sent again, as a client does."""
    while True:
        try:
            return await client.append_and_wait(data)
        except NotCommitted:
            await asyncio.sleep(0.1)
