"""Idle probing of replicas with many partitions on the same storage nodes (memory storages, virtual time):
an idle partition's per-partition check backs off, a lost link is noticed at once by every partition on it,
a node that stops answering within the old bound, and a lost record on an idle replica is still found."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable

import pytest

from waltz.protocol.records import ReqId, crc32
from waltz.server.store import StoreConfig, StoreSession
from waltz.server.store.store_partition import StorePartition
from waltz.testing import run_virtual
from waltz.testing.store import (
    MemoryConnection,
    MemoryConnector,
    MemoryMetadataStore,
    MemoryNetwork,
    MemoryStorage,
)

NAMES = ["s0:1", "s1:1", "s2:1"]
PARTITIONS = 16


class _Req:
    def __init__(self, seq: int) -> None:
        payload = f"txn-{seq}".encode()
        self.req_id = ReqId.of(7, 1, 0, seq)
        self.header = seq
        self.data = payload
        self.checksum = crc32(payload)


class Cluster:
    """Three memory storage nodes holding ``PARTITIONS`` partitions, all written by one server."""

    def __init__(self, **config: int) -> None:
        self.network = MemoryNetwork(random.Random(1), min_delay_ms=0.1, max_delay_ms=2.0)
        self.storages = {
            n: MemoryStorage(n, PARTITIONS, self.network, fsync_ms=(0.1, 1.0), rng=random.Random(i))
            for i, n in enumerate(NAMES)
        }
        self.config = StoreConfig(**config)
        self.metadata = MemoryMetadataStore()
        self.connector = MemoryConnector(self.network)

    @contextlib.asynccontextmanager
    async def partitions(self) -> AsyncIterator[list[StorePartition]]:
        async with contextlib.AsyncExitStack() as stack:
            parts = [
                await stack.enter_async_context(
                    StorePartition(
                        p,
                        1,
                        NAMES,
                        connector=self.connector,
                        metadata_store=self.metadata,
                        rng=random.Random(p),
                        config=self.config,
                    )
                )
                for p in range(PARTITIONS)
            ]
            yield parts


def _count_probes(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the loop time of every max id request (the idle probe; recovery asks once per replica)."""
    times: list[float] = []
    original = MemoryConnection.max_transaction_id

    async def counted(self: MemoryConnection) -> int:
        times.append(asyncio.get_running_loop().time())
        return await original(self)

    monkeypatch.setattr(MemoryConnection, "max_transaction_id", counted)
    return times


async def _open_and_write(parts: list[StorePartition]) -> list[StoreSession]:
    sessions = []
    for p in parts:
        await p.wait_open()
        assert await p.append(_Req(0)) == 0
        assert p.session is not None
        sessions.append(p.session)
    return sessions


async def _wait(predicate: Callable[[], bool], timeout_s: float) -> float:
    """Wait until ``predicate()``; returns how long that took (virtual time)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls state on virtual time
            await asyncio.sleep(0.005)
    return loop.time() - start


def test_an_idle_partitions_per_partition_check_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 16 idle partitions of 3 replicas, the old code sent 48 probes a second for good; now the checks
    back off to one per replica per ``idle_probe_max_interval_ms``, plus the liveness probes of links that
    nothing else kept busy (about one per node a second)."""
    probes = _count_probes(monkeypatch)

    async def main() -> None:
        cluster = Cluster()
        async with cluster.partitions() as parts:
            await _open_and_write(parts)
            loop = asyncio.get_running_loop()
            start = loop.time()
            await asyncio.sleep(5)
            early = [t for t in probes if t >= start]
            await asyncio.sleep(115)
            late = [t for t in probes if t >= start + 60]
            replicas = PARTITIONS * len(NAMES)
            # The first seconds: each replica is still checked about once a second.
            assert len(early) >= replicas
            # After a minute of idleness: at most one check per replica per 30 s, and about one liveness
            # probe per node per second (the old code: one probe per replica per second, 2,880 in 60 s).
            per_s = len(late) / 60
            assert per_s <= replicas / 30 + 2 * len(NAMES), per_s
            assert all(p.is_healthy for p in parts)

    run_virtual(main())


@pytest.mark.parametrize("fault", ["crash", "break"])
def test_a_lost_link_is_noticed_at_once_by_every_idle_partition_on_it(fault: str) -> None:
    """A storage node's link is shared by every partition: losing it fails every replica session on it as it
    is reported (``on_lost``), long idle or not, instead of at each one's next probe."""

    async def main() -> None:
        cluster = Cluster()
        async with cluster.partitions() as parts:
            sessions = await _open_and_write(parts)
            await asyncio.sleep(100)  # long idle: the per-partition checks backed off to 30 s
            node = cluster.storages["s0:1"]
            if fault == "crash":
                node.crash()
            else:
                node.break_connections()
            took = await _wait(lambda: all(s.ended for s in sessions), 10)
            # Reported after failure_detection_ms (50): well within the old bound of one probe interval.
            assert took <= cluster.network.failure_detection_ms / 1000 + 0.1, took
            for p in parts:  # each partition opens a new session with the other two
                assert await p.append(_Req(1)) == 1

    run_virtual(main())


def test_a_node_that_stops_answering_is_noticed_within_the_old_bound_by_every_partition() -> None:
    """A node that hangs (its link stays up, nothing is answered) is found by the liveness probe: every
    partition within one probe interval plus the request timeout, as when each probed every interval."""

    async def main() -> None:
        cluster = Cluster(rpc_timeout_ms=2_000)
        async with cluster.partitions() as parts:
            sessions = await _open_and_write(parts)
            await asyncio.sleep(100)
            cluster.network.isolate("s0:1")
            bound_s = (cluster.config.idle_probe_interval_ms + cluster.config.rpc_timeout_ms) / 1000
            took = await _wait(lambda: all(s.ended for s in sessions), 60)
            assert took <= bound_s + 0.1, took

    run_virtual(main())


@pytest.mark.parametrize("change", ["lost", "extra"])
def test_a_lost_or_extra_record_on_a_long_idle_replica_is_still_found(change: str) -> None:
    """Backing off must not stop the per-partition check: a replica that lost its last record (or gained one)
    while the partition stayed idle is failed within ``idle_probe_max_interval_ms``, even while its link is
    kept alive by the other partitions' writes."""

    async def main() -> None:
        cluster = Cluster()
        async with cluster.partitions() as parts:
            sessions = await _open_and_write(parts)
            await asyncio.sleep(200)
            records = cluster.storages["s1:1"].partitions[3].records
            if change == "lost":
                records.pop()
            else:
                records.append(records[-1])

            async def keep_busy() -> None:
                seq = 1
                while True:
                    for p in parts[4:]:
                        await p.append(_Req(seq))
                    seq += 1
                    await asyncio.sleep(0.2)

            busy = asyncio.create_task(keep_busy())
            try:
                bound_s = (
                    cluster.config.idle_probe_max_interval_ms + cluster.config.idle_probe_interval_ms
                ) / 1000
                await _wait(lambda: sessions[3].ended, bound_s)
            finally:
                busy.cancel()
            held = -1 if change == "lost" else 1
            assert [str(e) for e in parts[3].internal_errors] == [f"s1:1 holds {held}, expected 0"]
            assert not any(s.ended for s in sessions[:3])

    run_virtual(main())


def test_the_tcp_connection_watches_the_shared_link_until_it_is_closed() -> None:
    """The production adapter registers one loss listener per replica connection on the node's shared
    client and removes it on close: a closed session is not told, and listeners do not pile up."""
    from waltz.server.adapters import TcpReplicaConnection

    class _Client:
        last_answer_s = 12.5

        def __init__(self) -> None:
            self.listeners: list[Callable[[BaseException], None]] = []

        def add_loss_listener(self, listener: Callable[[BaseException], None]) -> None:
            self.listeners.append(listener)

        def remove_loss_listener(self, listener: Callable[[BaseException], None]) -> None:
            self.listeners.remove(listener)

    async def main() -> None:
        client = _Client()
        conn = TcpReplicaConnection(client, "s0:1", 3, 9)  # type: ignore[arg-type]
        heard: list[BaseException] = []
        conn.on_lost(heard.append)
        assert client.listeners == [heard.append]
        assert conn.last_answer_s() == 12.5
        await conn.aclose()
        assert client.listeners == []

    run_virtual(main())
