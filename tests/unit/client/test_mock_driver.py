"""MockCluster / MockDriver: exact lock semantics, shared partitions, and the fault-injection controls."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from waltz import PartitionLocalLock, WaltzClient
from waltz.client.builder import TransactionBuilder
from waltz.client.driver import AppendRequest, MountState
from waltz.errors import BrokenResourceError, ClientError
from waltz.protocol.records import ReqId
from waltz.testing import MockCluster, MockDriver

from .helpers import FAST, Ctx, RecordingCallbacks

L1, L2 = PartitionLocalLock("account", 1), PartitionLocalLock("account", 2)


def built(
    seq: int,
    hwm: int,
    *,
    write: tuple[PartitionLocalLock, ...] = (),
    read: tuple[PartitionLocalLock, ...] = (),
    append: tuple[PartitionLocalLock, ...] = (),
) -> tuple[ReqId, TransactionBuilder]:
    """The request id and the filled builder of append ``seq`` (what the core hands a driver)."""
    b = TransactionBuilder(0, hwm)
    b.set_transaction_data(b"%d" % seq)
    b.set_write_locks(write)
    b.set_read_locks(read)
    b.set_append_locks(append)
    return ReqId.of(1, 0, 0, seq), b


def request(
    seq: int,
    hwm: int,
    *,
    write: tuple[PartitionLocalLock, ...] = (),
    read: tuple[PartitionLocalLock, ...] = (),
    append: tuple[PartitionLocalLock, ...] = (),
) -> AppendRequest:
    req_id, b = built(seq, hwm, write=write, read=read, append=append)
    return b.build(req_id)


def test_write_locks_conflict_with_later_writers_only() -> None:
    c = MockCluster()
    assert c.append(0, request(1, -1, write=(L1,))).kind == "committed"  # id 0 takes L1
    assert c.append(0, request(2, -1, write=(L1,))).transaction_id == 0  # saw -1 < 0: conflict
    assert c.append(0, request(2, -1, write=(L1,))).kind == "lock_failure"
    assert c.append(0, request(3, 0, write=(L1,))).kind == "committed"  # saw id 0: fine, takes L1 at 1
    assert c.append(0, request(4, -1, write=(L2,))).kind == "committed"  # another lock: no conflict


def test_read_locks_are_checked_but_not_taken() -> None:
    c = MockCluster()
    c.append(0, request(1, -1, write=(L1,)))  # id 0
    assert c.append(0, request(2, -1, read=(L1,))).kind == "lock_failure"
    assert c.append(0, request(3, 0, read=(L1,))).kind == "committed"  # id 1, does not take L1
    assert c.append(0, request(4, 0, write=(L1,))).kind == "committed"  # so a writer at hwm 0 still passes


def test_append_locks_are_taken_but_never_checked() -> None:
    c = MockCluster()
    c.append(0, request(1, -1, write=(L1,)))  # id 0
    assert c.append(0, request(2, -1, append=(L1,))).kind == "committed"  # stale, but never fails: id 1
    result = c.append(0, request(3, 0, read=(L1,)))  # saw id 0 only, but L1 was taken again at id 1
    assert (result.kind, result.transaction_id) == ("lock_failure", 1)


def test_forced_lock_failure_names_the_current_high_water_mark() -> None:
    c = MockCluster()
    c.append(0, request(1, -1))
    assert c.append(0, request(2, 0), force_lock_failure=True).transaction_id == 0
    assert c.high_water_mark(0) == 0


def test_cluster_hands_out_distinct_client_ids_and_checks_partitions() -> None:
    c = MockCluster(num_partitions=2, cluster_name="bank")
    drivers = [MockDriver(cluster=c) for _ in range(3)]
    assert [d.client_id for d in drivers] == [0, 1, 2]
    assert drivers[0].cluster_name == "bank"
    assert MockDriver(client_id=42, cluster=c).client_id == 42
    with pytest.raises(ClientError, match="outside"):
        c.high_water_mark(2)
    with pytest.raises(ValueError, match="at least 1"):
        MockCluster(num_partitions=0)


def test_fault_controls_validate_their_arguments() -> None:
    d = MockDriver()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        d.set_fault_rate(1.5)
    with pytest.raises(ValueError, match="negative"):
        d.set_max_delay(-1)


class Events:
    """A DriverListener that records every event."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    async def on_feed_data(self, partition_id: int, transaction_id: int, req_id: ReqId, header: int) -> None:
        self.events.append(("feed", partition_id, transaction_id))

    async def on_mount_state(self, partition_id: int, state: MountState) -> None:
        self.events.append(("mount", partition_id, state))

    async def on_lock_failure(self, partition_id: int, req_id: ReqId, transaction_id: int) -> None:
        self.events.append(("lock", partition_id, req_id.seq_num, transaction_id))

    async def on_flush_response(self, partition_id: int, req_id: ReqId, transaction_id: int) -> None:
        self.events.append(("flush", partition_id, req_id.seq_num, transaction_id))


def test_driver_streams_catch_up_then_ready_then_responses_in_order() -> None:
    cluster = MockCluster()
    for i in range(3):
        cluster.append(0, request(i + 1, -1))

    async def main() -> None:
        driver = MockDriver(cluster=cluster)
        events = Events()
        await driver.open(events)
        with pytest.raises(BrokenResourceError):
            driver.send_flush(0, ReqId.of(0, 0, 0, 1))
        await driver.mount(0, 0)
        driver.force_next_append_fail()  # Consumed by the next append processed: seq 10.
        driver.send_append(0, *built(10, 2, write=(L1,)), False)
        driver.force_next_lock_fail()  # Then seq 11.
        driver.send_append(0, *built(11, 2), False)
        driver.send_append(0, *built(12, 2), False)
        driver.send_flush(0, ReqId.of(1, 0, 0, 12))
        async with asyncio.timeout(5):
            while len(events.events) < 6:  # noqa: ASYNC110 - polling a plain list
                await asyncio.sleep(0.001)
        await driver.close()
        # Catch-up first, READY only once the feed reached the log's end at mount time.
        assert events.events[:3] == [("feed", 0, 1), ("feed", 0, 2), ("mount", 0, MountState.READY)]
        rest = events.events[3:]
        assert set(rest) == {("lock", 0, 11, 2), ("feed", 0, 3), ("flush", 0, 12, 3)}
        assert rest.index(("lock", 0, 11, 2)) < rest.index(("flush", 0, 12, 3))
        assert driver.cluster.records(0)[3].req_id.seq_num == 12
        assert (driver.appends_received, driver.appends_dropped, driver.lock_failures) == (3, 1, 1)
        assert await driver.high_water_mark(0) == 3

    asyncio.run(main())


def test_driver_reports_client_ahead() -> None:
    async def main() -> None:
        driver = MockDriver()
        events = Events()
        await driver.open(events)
        await driver.mount(0, 4)
        async with asyncio.timeout(5):
            while not events.events:  # noqa: ASYNC110 - polling a plain list
                await asyncio.sleep(0.001)
        assert events.events == [("mount", 0, MountState.CLIENT_AHEAD)]
        await driver.close()

    asyncio.run(main())


def test_one_driver_serves_one_client() -> None:
    async def main() -> None:
        driver = MockDriver()
        await driver.open(Events())
        with pytest.raises(ClientError, match="one MockDriver per client"):
            await driver.open(Events())

    asyncio.run(main())


def test_feed_suspension_stops_delivery_until_resumed() -> None:
    driver = MockDriver()
    callbacks = RecordingCallbacks()
    with WaltzClient(callbacks, FAST, driver=driver) as client:
        client.submit(Ctx(b"a"))
        client.flush_transactions(timeout=5)
        driver.suspend_feed()
        ctx = Ctx(b"b")
        client.submit(ctx)
        assert not ctx.finished.wait(0.2)
        assert driver.cluster.high_water_mark(0) == 1  # Committed, but not streamed.
        assert callbacks.data(0) == [b"a"]
        driver.resume_feed()
        client.flush_transactions(timeout=5)
        assert callbacks.data(0) == [b"a", b"b"]
        assert ctx.executions == 1


def test_several_clients_share_a_cluster_and_all_see_every_transaction() -> None:
    cluster = MockCluster(num_partitions=2)
    callbacks = [RecordingCallbacks() for _ in range(3)]
    clients = [
        WaltzClient(cb, FAST, driver=MockDriver(cluster=cluster, seed=i)) for i, cb in enumerate(callbacks)
    ]
    try:

        def produce(n: int, client: WaltzClient) -> None:
            for i in range(20):
                client.submit(
                    Ctx(b"c%d-%d" % (n, i), partition=i % 2, write=(PartitionLocalLock("k", i % 4),))
                )
            client.flush_transactions(timeout=10)

        threads = [threading.Thread(target=produce, args=(n, c)) for n, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for client in clients:
            client.flush_transactions(timeout=10)
        total = cluster.high_water_mark(0) + cluster.high_water_mark(1) + 2
        assert total == 60
        for cb in callbacks:
            for p in (0, 1):
                deadline = 100
                while len(cb.data(p)) < cluster.high_water_mark(p) + 1 and deadline:
                    threading.Event().wait(0.05)
                    deadline -= 1
                assert cb.data(p) == [r.data for r in cluster.records(p)]
        assert {r.req_id.client_id for r in cluster.records(0)} == {0, 1, 2}
    finally:
        for client in clients:
            client.close()
