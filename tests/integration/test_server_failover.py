"""Partition ownership moving between two real server processes: a killed owner, and a fenced old owner."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import NotCommitted, RawClient, append_stream
from tests.integration.server_process import (
    Cluster,
    ServerProcess,
    assert_identical,
    settled_logs,
    wait_until,
)
from waltz.cli.server import query
from waltz.cluster.membership import ClusterWatcher
from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId

pytestmark = [pytest.mark.integration]


async def _owner(cluster: Cluster, watcher: ClusterWatcher, partition: int = 0) -> tuple[ServerProcess, int]:
    endpoints = await watcher.wait_for(lambda e: partition in e, 30)
    server, generation = endpoints[partition]
    return cluster.server_by_port(int(server.rpartition(":")[2])), generation


async def _all(futures: list[asyncio.Future[int]]) -> list[int]:
    return [await f for f in futures]


async def _served_partitions(server: ServerProcess) -> tuple[int, ...]:
    (answer,) = await query(server.address, [cs.ServerPartitionsAssignmentRequest(ReqId.of(-1, 0, 0, 1))])
    assert isinstance(answer, cs.ServerPartitionsAssignmentResponse)
    return answer.partition_ids


@pytest.mark.timeout(150)
def test_owner_killed_another_server_takes_over_with_a_higher_generation(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=2)
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            old_owner, old_generation = await _owner(cluster, watcher)
            client = await RawClient(watcher, 1).start()
            try:
                stop = asyncio.Event()

                async def writer() -> None:
                    for f in await append_stream(client, None, stop=stop):
                        try:
                            await f
                        except NotCommitted:
                            pass  # in flight when the owner died, and not in the log

                task = asyncio.create_task(writer())
                await wait_until(lambda: client.stats.acknowledged >= 1000, 30, "1000 acknowledged appends")
                old_owner.kill()
                acked_before = client.stats.acknowledged
                new_owner, new_generation = await _owner_change(cluster, watcher, old_owner)
                assert new_owner is not old_owner
                assert new_generation > old_generation
                # Writes continue through the new owner, after the client remounted there.
                await wait_until(
                    lambda: client.stats.acknowledged >= acked_before + 1000, 60, "writes on the new owner"
                )
                assert client.generation == new_generation
                stop.set()
                await task
                assert client.violations == []
                assert cluster.partition_metadata_generation() == new_generation
                logs = await settled_logs(cluster, cluster.storages, client.hwm)
                assert_identical(logs, client.hwm)
                for rid, txn in client.acked.items():
                    assert logs[0][txn].req_id == rid
            finally:
                await client.aclose()

    asyncio.run(main())


async def _owner_change(
    cluster: Cluster, watcher: ClusterWatcher, old: ServerProcess
) -> tuple[ServerProcess, int]:
    old_endpoint = old.address
    endpoints = await watcher.wait_for(lambda e: 0 in e and e[0][0] != old_endpoint, 30)
    server, generation = endpoints[0]
    return cluster.server_by_port(int(server.rpartition(":")[2])), generation


@pytest.mark.timeout(150)
def test_paused_owner_is_fenced_after_failover(cluster_factory: ClusterFactory) -> None:
    """The old owner cannot write once another server took its partition.

    Formulation (the old owner A does nothing at all while stopped, so the order of events is fixed):

    1. client 1 mounts on A (generation g) and appends 300 transactions, all acknowledged;
    2. client 1 sends a burst of 1000 appends to A and A is SIGSTOPped at once: some may have committed,
       the rest wait in A's queues and socket buffers;
    3. A's ZooKeeper session expires, server B gets the partition with generation g' > g; client 2 mounts on
       B and appends 300 transactions, acknowledged (B's store session has recovered, so every storage node
       has fenced A's store session);
    4. A is SIGCONTed with the rest of the burst to process, and client 1 sends 200 more appends to A;
    5. client 2 keeps appending through B until A owns nothing any more, and a little longer.

    Whichever of A's safeguards stops it (it sees its ZooKeeper connection suspended, or the storage nodes
    refuse its session, or ZooKeeper's partition metadata is at g'), the log must show: every record of
    client 1 *before* every record of client 2 (A wrote nothing after B took over), none of client 1's last
    200 appends, every acknowledged append of either client at its id with its data, identical replicas, and
    the partition metadata at g'.
    """
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=2)
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            a, generation = await _owner(cluster, watcher)
            old = RawClient(None, 1, endpoint=("127.0.0.1", a.port, generation), max_in_flight=5000)
            await old.start()
            new: RawClient | None = None
            try:
                await _all(await append_stream(old, 300))
                await append_stream(old, 1000)
                a.pause()
                b, new_generation = await _owner_change(cluster, watcher, a)
                assert new_generation > generation
                new = await RawClient(watcher, 2).start()
                assert new.server == b.address
                await _all(await append_stream(new, 300))
                a.resume()
                last = [await old.append(b"after-resume-%d" % i) for i in range(200)]
                await _all(await append_stream(new, 300))
                await wait_until(_no_partitions(a), 30, "the old owner to give up the partition")
                await _all(await append_stream(new, 100))

                assert new.violations == []
                assert old.violations == []
                assert not any(f.done() and not f.cancelled() and f.exception() is None for f in last)
                assert cluster.partition_metadata_generation() == new_generation
                logs = await settled_logs(cluster, cluster.storages, new.hwm)
                assert_identical(logs, new.hwm)
                log = logs[0]
                ids_1 = [r.transaction_id for r in log if r.req_id.client_id == 1]
                ids_2 = [r.transaction_id for r in log if r.req_id.client_id == 2]
                assert len(ids_2) == 700
                assert max(ids_1) < min(ids_2), "the old owner wrote after the new one took over"
                last_ids = {rid for rid in old.sent_data if old.sent_data[rid].startswith(b"after-resume-")}
                assert len(last_ids) == 200
                assert not [r for r in log if r.req_id in last_ids], "a fenced append reached the log"
                for client in (old, new):
                    for rid, txn in client.acked.items():
                        assert log[txn].req_id == rid
                        assert log[txn].data == client.sent_data[rid]
            finally:
                await old.aclose()
                if new is not None:
                    await new.aclose()

    asyncio.run(main())


def _no_partitions(server: ServerProcess) -> object:
    async def check() -> bool:
        try:
            return await _served_partitions(server) == ()
        except Exception:
            return False

    return check
