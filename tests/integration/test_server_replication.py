"""A Waltz server replicating through three real storage processes: dense commits, storage crashes,
quorum loss, replica-set changes and a storage node restored from an older copy.

Every test ends the same way: the writers stop, the cluster settles, and every replica must hold exactly
``0..hwm``, byte-identical, with every acknowledged append at the id it was acknowledged with (the records'
request ids and data are checked against what the client sent).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable

import pytest
from kazoo.client import KazooClient

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import NotCommitted, RawClient, append_stream
from tests.integration.server_process import Cluster, assert_identical, settled_logs, wait_until
from tests.integration.storage_process import StorageProcess
from waltz.cluster.membership import ClusterWatcher
from waltz.protocol.records import Record

pytestmark = [pytest.mark.integration]


async def _with_client(
    cluster: Cluster, body: Callable[[RawClient], Awaitable[None]], *, client_id: int = 1
) -> None:
    async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
        client = await RawClient(watcher, client_id).start()
        try:
            await body(client)
            assert client.violations == []
        finally:
            await client.aclose()


def _check_acknowledged(client: RawClient, records: list[Record]) -> None:
    """Every acknowledged append is in the log at its id, with the data the client sent."""
    by_id = {r.transaction_id: r for r in records}
    for rid, txn in client.acked.items():
        rec = by_id.get(txn)
        assert rec is not None, f"acknowledged {rid!r} at {txn} is missing"
        assert rec.req_id == rid, f"id {txn} holds {rec.req_id!r}, {rid!r} was acknowledged there"
        assert rec.data == client.sent_data[rid]


async def _check_final_log(
    cluster: Cluster, client: RawClient, storages: list[StorageProcess] | None = None
) -> list[list[Record]]:
    """Once the storages settle: they hold identical records up to the client's high-water mark, and every
    append the client saw acknowledged is there at its id with its data. Returns each storage's log."""
    logs = await settled_logs(cluster, cluster.storages if storages is None else storages, client.hwm)
    assert_identical(logs, client.hwm)
    _check_acknowledged(client, logs[0])
    return logs


async def _writer(client: RawClient, stop: asyncio.Event) -> None:
    """Append until ``stop``; appends a failover lost are simply not retried."""
    futures = await append_stream(client, None, stop=stop)
    for f in futures:
        try:
            await f
        except NotCommitted:
            pass


async def _acks_grow(client: RawClient, by: int, timeout_s: float) -> None:
    target = client.stats.acknowledged + by
    await wait_until(lambda: client.stats.acknowledged >= target, timeout_s, f"{target} acknowledged appends")


@pytest.mark.timeout(120)
def test_appends_commit_densely_on_three_replicas(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)

        async def body(client: RawClient) -> None:
            futures = await append_stream(client, 3000)
            ids = [await f for f in futures]
            # Appends of one client commit in the order it sent them, with dense ids.
            assert ids == list(range(3000))
            assert client.hwm == 2999
            await _check_final_log(cluster, client)

        await _with_client(cluster, body)

    asyncio.run(main())


@pytest.mark.timeout(150)
def test_storage_killed_mid_stream_writes_continue_and_it_catches_up(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        victim = cluster.storages[2]

        async def body(client: RawClient) -> None:
            stop = asyncio.Event()
            writer = asyncio.create_task(_writer(client, stop))
            await _acks_grow(client, 1000, 30)
            victim.kill()  # SIGKILL in the middle of the stream
            # Writes continue on the two others after a new store session.
            await _acks_grow(client, 2000, 30)
            await asyncio.to_thread(victim.start)
            # The node comes back, recovers, joins the writes: keep writing through it for a while.
            restarted_at = client.hwm
            await wait_until(
                lambda: _holds_at_least(cluster, victim, restarted_at + 500),
                60,
                "the restarted storage to take part in the writes again",
                0.3,
            )
            await _acks_grow(client, 1000, 30)
            stop.set()
            await writer
            await _check_final_log(cluster, client)

        await _with_client(cluster, body)

    asyncio.run(main())


@pytest.mark.timeout(150)
def test_two_storages_down_nothing_acknowledged_nothing_lost(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        a, b, c = cluster.storages

        async def body(client: RawClient) -> None:
            stop = asyncio.Event()
            writer = asyncio.create_task(_writer(client, stop))
            await _acks_grow(client, 1000, 30)
            b.kill()
            c.kill()
            # Give the server time to notice; whatever was committed before is acknowledged by now.
            await asyncio.sleep(1.0)
            acked_while_down = client.stats.acknowledged
            hwm_while_down = client.hwm
            await asyncio.sleep(3.0)
            assert client.stats.acknowledged == acked_while_down, "an append was acknowledged without quorum"
            assert client.hwm == hwm_while_down
            assert a.is_running
            await asyncio.gather(asyncio.to_thread(b.start), asyncio.to_thread(c.start))
            await _acks_grow(client, 1000, 60)
            stop.set()
            await writer
            await _check_final_log(cluster, client)

        await _with_client(cluster, body)

    asyncio.run(main())


@pytest.mark.timeout(180)
def test_fourth_storage_added_then_one_removed(cluster_factory: ClusterFactory, zk: KazooClient) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)

        async def body(client: RawClient) -> None:
            stop = asyncio.Event()
            writer = asyncio.create_task(_writer(client, stop))
            await _acks_grow(client, 1500, 30)
            fourth = await cluster.add_storage()
            # The new replica is brought up to date while writes go on, then takes part in them.
            await wait_until(
                lambda: _holds_at_least(cluster, fourth, client.hwm - 100),
                60,
                "the fourth storage to catch up",
                0.3,
            )
            await _acks_grow(client, 1500, 30)
            removed = cluster.storages[0]
            await cluster.unassign_storage(removed)
            await _acks_grow(client, 1500, 60)
            stop.set()
            await writer
            remaining = cluster.storages[1:]
            logs = await _check_final_log(cluster, client, remaining)
            # The removed node holds a prefix of the same log.
            old = await cluster.read_log(removed)
            assert old == logs[0][: len(old)]

        await _with_client(cluster, body)

    asyncio.run(main())


async def _holds_at_least(cluster: Cluster, sp: StorageProcess, transaction_id: int) -> bool:
    return await cluster.max_transaction_id(sp) >= transaction_id


@pytest.mark.timeout(180)
def test_storage_restored_from_an_older_copy_ends_identical(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        victim = cluster.storages[1]
        backup = cluster.base / "backup"

        async def body(client: RawClient) -> None:
            for f in await append_stream(client, 1000):
                await f
            # Take an offline copy of the node's directory (stopped cleanly), and restart it.
            await asyncio.to_thread(victim.terminate)
            await asyncio.to_thread(shutil.copytree, victim.directory, backup)
            await asyncio.to_thread(victim.start)
            stop = asyncio.Event()
            writer = asyncio.create_task(_writer(client, stop))
            await wait_until(
                lambda: _holds_at_least(cluster, victim, client.hwm),
                60,
                "the restarted storage to take part again",
                0.3,
            )
            await _acks_grow(client, 1500, 30)
            # Now roll it back: stop it, put the old copy in place, start it again.
            victim.kill()
            await _acks_grow(client, 500, 30)
            await asyncio.to_thread(cluster.replace_directory, victim, backup)
            await asyncio.to_thread(victim.start)
            await _acks_grow(client, 1500, 30)
            stop.set()
            await writer
            await _check_final_log(cluster, client)

        await _with_client(cluster, body)

    asyncio.run(main())
