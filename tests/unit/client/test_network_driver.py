"""The network driver's session logic against a scripted in-process server (no ZooKeeper): feed sessions,
stale replies, feed windows, NOT_READY retries, gaps, reconnects with a new incarnation, RPC matching."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from waltz.client.builder import TransactionBuilder
from waltz.client.config import ClientConfig
from waltz.client.driver import AppendRequest, MountState
from waltz.client.network import Endpoints, NetworkDriver
from waltz.client.stream import INBOX_FEED_LIMIT
from waltz.errors import BrokenResourceError, ClientError, PartitionNotReadyError
from waltz.protocol import client_server as cs
from waltz.protocol.framing import FRAME_HEADER, FRAME_HEADER_BYTES, MAGIC_CLIENT
from waltz.protocol.records import ReqId, crc32
from waltz.transport import FramedConnection, FramedServer, serve

STEP_S = 5.0


class StaticDiscovery:
    """A Discovery with a fixed cluster and an assignment the test publishes."""

    def __init__(self, num_partitions: int = 1) -> None:
        self.num_partitions = num_partitions
        self.cluster_name = "fake"
        self.endpoints: Endpoints = {}
        self._changed = asyncio.Event()
        self.closed = False

    async def open(self) -> None:
        pass

    async def new_client_id(self) -> int:
        return 7

    def publish(self, endpoints: Endpoints) -> None:
        self.endpoints = dict(endpoints)
        self._changed.set()

    async def updates(self) -> AsyncIterator[Endpoints]:
        while True:
            await self._changed.wait()
            self._changed.clear()
            yield dict(self.endpoints)

    async def close(self) -> None:
        self.closed = True


class FakeServer:
    """Accepts client connections and queues what they send; the test answers through ``send``."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[tuple[FramedConnection, cs.Message]] = asyncio.Queue()
        self.server: FramedServer | None = None

    async def start(self) -> str:
        self.server = await serve(
            "127.0.0.1",
            0,
            self._handle,
            magic=MAGIC_CLIENT,
            versions=cs.SUPPORTED_VERSIONS,
            hello_text="fake",
        )
        return f"127.0.0.1:{self.server.port}"

    async def _handle(self, conn: FramedConnection) -> None:
        while True:
            msg = cs.decode(await conn.receive(), conn.negotiated_version)
            await self.received.put((conn, msg))

    async def expect(self, kind: type[cs.Message]) -> tuple[FramedConnection, cs.Message]:
        while True:
            conn, msg = await asyncio.wait_for(self.received.get(), STEP_S)
            if isinstance(msg, kind):
                return conn, msg

    @staticmethod
    def send(conn: FramedConnection, msg: cs.Message) -> None:
        conn.send(cs.encode(msg, conn.negotiated_version))

    async def aclose(self) -> None:
        if self.server is not None:
            await self.server.aclose()


class Recorder:
    """A DriverListener that records every event as a tuple."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []
        self.changed = asyncio.Event()

    async def _add(self, *event: object) -> None:
        self.events.append(event)
        self.changed.set()

    async def on_feed_data(self, partition_id: int, transaction_id: int, req_id: ReqId, header: int) -> None:
        await self._add("feed", transaction_id)

    async def on_mount_state(self, partition_id: int, state: MountState) -> None:
        await self._add("state", state)

    async def on_lock_failure(self, partition_id: int, req_id: ReqId, transaction_id: int) -> None:
        await self._add("lock", req_id, transaction_id)

    async def on_flush_response(self, partition_id: int, req_id: ReqId, transaction_id: int) -> None:
        await self._add("flush", req_id, transaction_id)

    def on_driver_failure(self, error: ClientError) -> None:
        self.events.append(("failed", str(error)))
        self.changed.set()

    async def wait_for(self, *event: object) -> None:
        async with asyncio.timeout(STEP_S):
            while event not in self.events:
                self.changed.clear()
                await self.changed.wait()

    async def wait_for_count(self, *event_and_count: object) -> None:
        *event, count = event_and_count
        async with asyncio.timeout(STEP_S):
            while self.events.count(tuple(event)) < count:  # type: ignore[arg-type]
                self.changed.clear()
                await self.changed.wait()


def append_id(seq: int) -> ReqId:
    return ReqId.of(7, 1, 0, seq)


def x_builder(client_high_water_mark: int) -> TransactionBuilder:
    """A builder of the append with data ``b"x"``, as ``execute`` would fill it."""
    builder = TransactionBuilder(0, client_high_water_mark)
    builder.set_transaction_data(b"x")
    return builder


@contextlib.asynccontextmanager
async def _ready_driver(
    listener: Recorder,
) -> AsyncIterator[tuple[FakeServer, NetworkDriver, FramedConnection]]:
    """A driver opened with ``listener``, partition 0 mounted READY on a fake server: yields the server, the
    driver and the server's side of the connection, and closes both on exit."""
    server = FakeServer()
    endpoint = await server.start()
    discovery = StaticDiscovery()
    driver = NetworkDriver(ClientConfig(), discovery=discovery)
    await driver.open(listener)
    try:
        await driver.mount(0, -1)
        discovery.publish({0: (endpoint, 1)})
        conn, mount = await server.expect(cs.MountRequest)
        server.send(conn, cs.MountResponse(mount.req_id, cs.PartitionState.READY))
        await listener.wait_for("state", MountState.READY)
        yield server, driver, conn
    finally:
        await driver.close()
        await server.aclose()


@pytest.mark.timeout(60)
def test_mount_feed_windows_stale_replies_gap_not_ready_and_reconnect() -> None:
    async def main() -> None:
        server = FakeServer()
        endpoint = await server.start()
        discovery = StaticDiscovery()
        driver = NetworkDriver(ClientConfig(), discovery=discovery)
        listener = Recorder()
        await driver.open(listener)
        try:
            assert driver.client_id == 7
            await driver.mount(0, -1)
            discovery.publish({0: (endpoint, 1)})

            conn, mount = await server.expect(cs.MountRequest)
            assert isinstance(mount, cs.MountRequest)
            assert mount.client_high_water_mark == -1
            assert mount.req_id.generation == 1
            first_incarnation = mount.seq_num
            session = mount.req_id
            # A reply to some other (stale) mount is ignored; FeedData carries the appends' own ids.
            server.send(conn, cs.MountResponse(ReqId.of(7, 1, 0, 999), cs.PartitionState.NOT_READY))
            server.send(conn, cs.FeedData(append_id(1), 0, 10))
            server.send(conn, cs.FeedData(append_id(2), 1, 11))
            server.send(conn, cs.MountResponse(session, cs.PartitionState.READY))
            await listener.wait_for("state", MountState.READY)
            # NOT_READY first: the partition was mounted before any assignment named its server.
            assert listener.events == [
                ("state", MountState.NOT_READY),
                ("feed", 0),
                ("feed", 1),
                ("state", MountState.READY),
            ]
            _, feed = await server.expect(cs.FeedRequest)
            assert feed == cs.FeedRequest(session, 1)

            # Appends and flushes go out in call order on the stream connection.
            driver.send_append(0, append_id(3), x_builder(1), False)
            driver.send_flush(0, append_id(3))
            _, append = await server.expect(cs.AppendRequest)
            assert append.req_id == append_id(3)
            _, flush = await server.expect(cs.FlushRequest)
            assert flush.req_id == append_id(3)
            server.send(conn, cs.FlushResponse(append_id(3), 1))
            await listener.wait_for("flush", append_id(3), 1)

            # A repeat is dropped; a used-up window is re-opened from the last id delivered.
            server.send(conn, cs.FeedData(append_id(1), 1, 11))
            server.send(conn, cs.FeedData(append_id(4), 2, 12))
            server.send(conn, cs.FeedSuspended(session))
            _, feed = await server.expect(cs.FeedRequest)
            assert feed == cs.FeedRequest(session, 2)
            assert [e for e in listener.events if e[0] == "feed"] == [("feed", t) for t in range(3)]

            # A gap: the driver starts a new session from the last id delivered.
            server.send(conn, cs.FeedData(append_id(5), 5, 15))
            _, remount = await server.expect(cs.MountRequest)
            assert remount.client_high_water_mark == 2
            assert remount.req_id != session
            await listener.wait_for("state", MountState.NOT_READY)
            with pytest.raises(BrokenResourceError):
                driver.send_append(0, append_id(3), x_builder(1), False)

            # NOT_READY: the driver mounts again by itself, shortly after.
            server.send(conn, cs.MountResponse(remount.req_id, cs.PartitionState.NOT_READY))
            _, again = await server.expect(cs.MountRequest)
            assert again.client_high_water_mark == 2
            assert again.req_id != remount.req_id

            # The connection dies: a new one, with a newer incarnation, re-mounts from the same place.
            await conn.aclose()
            conn2, after_loss = await server.expect(cs.MountRequest)
            assert conn2 is not conn
            assert after_loss.seq_num > first_incarnation
            assert after_loss.client_high_water_mark == 2
            server.send(conn2, cs.FeedData(append_id(6), 3, 16))
            server.send(conn2, cs.MountResponse(after_loss.req_id, cs.PartitionState.READY))
            await listener.wait_for("feed", 3)
            feeds = [e[1] for e in listener.events if e[0] == "feed"]
            assert feeds == [0, 1, 2, 3]
        finally:
            await driver.close()
            await server.aclose()
        assert discovery.closed

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_rpcs_match_responses_by_request_and_follow_the_assignment() -> None:
    async def main() -> None:
        server = FakeServer()
        endpoint = await server.start()
        discovery = StaticDiscovery(num_partitions=2)
        driver = NetworkDriver(ClientConfig(), discovery=discovery)
        await driver.open(Recorder())
        discovery.publish({0: (endpoint, 3), 1: (endpoint, 4)})
        await asyncio.sleep(0.05)
        try:

            async def answer() -> None:
                # Answer in reverse order: the driver matches by the request's ReqId, not by arrival.
                pending = [await server.expect(cs.TransactionDataRequest) for _ in range(2)]
                for conn, request in reversed(pending):
                    assert isinstance(request, cs.TransactionDataRequest)
                    data = f"p{request.req_id.partition_id}t{request.transaction_id}".encode()
                    server.send(
                        conn, cs.TransactionDataResponse.success(request.req_id, request.transaction_id, data)
                    )
                conn, hwm = await server.expect(cs.HighWaterMarkRequest)
                assert hwm.req_id.generation == 4
                server.send(conn, cs.HighWaterMarkResponse(hwm.req_id, 41))

            answering = asyncio.create_task(answer())
            a, b = await asyncio.gather(
                driver.fetch_transaction_data(0, 5), driver.fetch_transaction_data(1, 6)
            )
            assert a[0] == b"p0t5"
            assert b[0] == b"p1t6"
            assert await driver.high_water_mark(1) == 41
            await answering
        finally:
            await driver.close()
            await server.aclose()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_partition_its_owner_does_not_serve_is_an_error_not_an_empty_log() -> None:
    async def main() -> None:
        server = FakeServer()
        endpoint = await server.start()
        discovery = StaticDiscovery(num_partitions=1)
        driver = NetworkDriver(ClientConfig(), discovery=discovery)
        await driver.open(Recorder())
        discovery.publish({0: (endpoint, 3)})
        await asyncio.sleep(0.05)
        try:

            async def answer() -> None:
                conn, hwm = await server.expect(cs.HighWaterMarkRequest)
                server.send(conn, cs.HighWaterMarkResponse(hwm.req_id, cs.HWM_NOT_SERVED))

            answering = asyncio.create_task(answer())
            with pytest.raises(PartitionNotReadyError, match="partition 0 is not served") as caught:
                await driver.high_water_mark(0)
            assert caught.value.retriable
            await answering
        finally:
            await driver.close()
            await server.aclose()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_an_unanswered_mount_and_a_resync_reconnect_and_mount_again() -> None:
    async def main() -> None:
        server = FakeServer()
        endpoint = await server.start()
        discovery = StaticDiscovery()
        driver = NetworkDriver(ClientConfig(answer_timeout_ms=300), discovery=discovery)
        listener = Recorder()
        await driver.open(listener)
        try:
            await driver.mount(0, -1)
            discovery.publish({0: (endpoint, 1)})
            conn, first = await server.expect(cs.MountRequest)
            # No answer: after client.answerTimeout the driver drops the connection and mounts on a new one.
            conn2, second = await server.expect(cs.MountRequest)
            assert conn2 is not conn
            assert second.seq_num > first.seq_num  # A newer incarnation.
            assert second.client_high_water_mark == -1
            server.send(conn2, cs.FeedData(append_id(1), 0, 10))
            server.send(conn2, cs.MountResponse(second.req_id, cs.PartitionState.READY))
            await listener.wait_for("state", MountState.READY)
            await asyncio.sleep(0.5)  # Answered: no more reconnects.
            while not server.received.empty():
                _, msg = server.received.get_nowait()
                assert not isinstance(msg, cs.MountRequest), msg
            # The core's resync (appends unresolved for too long): the same, from the last id delivered.
            driver.resync(0)
            conn3, third = await server.expect(cs.MountRequest)
            assert conn3 is not conn2
            assert third.client_high_water_mark == 0
            await listener.wait_for("state", MountState.NOT_READY)
        finally:
            await driver.close()
            await server.aclose()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_mount_streaming_a_long_backlog_is_answering_and_is_not_timed_out() -> None:
    """The server answers a mount with the backlog the client lacks, then the MountResponse: a catch-up
    that streams for several answer timeouts is not a silent server, and the driver keeps its connection."""

    async def main() -> None:
        server = FakeServer()
        endpoint = await server.start()
        discovery = StaticDiscovery()
        driver = NetworkDriver(ClientConfig(answer_timeout_ms=200), discovery=discovery)
        listener = Recorder()
        await driver.open(listener)
        try:
            await driver.mount(0, -1)
            discovery.publish({0: (endpoint, 1)})
            conn, mount = await server.expect(cs.MountRequest)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 1.0  # Five answer timeouts of backlog.
            sent = 0
            while loop.time() < deadline:
                server.send(conn, cs.FeedData(append_id(sent + 1), sent, 10))
                sent += 1
                await listener.wait_for("feed", sent - 1)  # Delivered: the client reads as it comes.
                await asyncio.sleep(0.05)
            server.send(conn, cs.MountResponse(mount.req_id, cs.PartitionState.READY))
            await listener.wait_for("state", MountState.READY)
            assert [e for e in listener.events if e[0] == "feed"] == [("feed", i) for i in range(sent)]
            while not server.received.empty():
                again, msg = server.received.get_nowait()
                assert not isinstance(msg, cs.MountRequest), msg  # No reconnect, no second mount.
                assert again is conn
            # Silence after the backlog is still a timeout: a mount left without feed or answer reconnects.
            driver.resync(0)
            conn2, _ = await server.expect(cs.MountRequest)
            conn3, third = await server.expect(cs.MountRequest)
            assert conn3 is not conn2
            assert third.client_high_water_mark == sent - 1
        finally:
            await driver.close()
            await server.aclose()

    asyncio.run(main())


class NowaitRecorder(Recorder):
    """A listener that takes feed entries without a coroutine while it has room (as the core does)."""

    def __init__(self) -> None:
        super().__init__()
        self.room = True
        self.direct: list[int] = []

    def feed_run_nowait(self, partition_id: int, entries: list[tuple[int, ReqId, int]]) -> int:
        if not self.room:
            return 0
        for transaction_id, _, _ in entries:
            self.direct.append(transaction_id)
            self.events.append(("feed", transaction_id))
        self.changed.set()
        return len(entries)


@pytest.mark.timeout(60)
def test_feed_entries_go_straight_to_a_listener_with_room_and_keep_their_order_without() -> None:
    async def main() -> None:
        listener = NowaitRecorder()
        async with _ready_driver(listener) as (server, _driver, conn):
            for t in range(3):
                server.send(conn, cs.FeedData(append_id(t + 1), t, 0))
            await listener.wait_for("feed", 2)
            assert listener.direct == [0, 1, 2]  # No event object, no delivery task.
            # No room: entries wait in the inbox, and a flush response behind them is not delivered first.
            listener.room = False
            server.send(conn, cs.FeedData(append_id(4), 3, 0))
            server.send(conn, cs.FeedData(append_id(5), 4, 0))
            server.send(conn, cs.FlushResponse(append_id(5), 4))
            await listener.wait_for("feed", 4)  # Through on_feed_data, awaited by the delivery task.
            await listener.wait_for("flush", append_id(5), 4)
            feeds = [e for e in listener.events if e[0] in ("feed", "flush")]
            assert feeds == [
                ("feed", 0),
                ("feed", 1),
                ("feed", 2),
                ("feed", 3),
                ("feed", 4),
                ("flush", append_id(5), 4),
            ]
            # A repeat after the inbox drained is dropped; the next id goes straight through again.
            listener.room = True
            server.send(conn, cs.FeedData(append_id(5), 4, 0))
            server.send(conn, cs.FeedData(append_id(6), 5, 0))
            await listener.wait_for("feed", 5)
            assert listener.direct == [0, 1, 2, 5]
            assert [e[1] for e in listener.events if e[0] == "feed"] == [0, 1, 2, 3, 4, 5]

    asyncio.run(main())


class RunRecorder(Recorder):
    """A listener that takes a run of feed entries in one call (as the core does), up to ``room`` of them."""

    def __init__(self) -> None:
        super().__init__()
        self.room = 1000
        self.runs: list[list[int]] = []

    def feed_run_nowait(self, partition_id: int, entries: list[tuple[int, ReqId, int]]) -> int:
        taken = entries[: self.room]
        if taken:
            self.runs.append([tid for tid, _, _ in taken])
            self.events.extend(("feed", tid) for tid, _, _ in taken)
            self.changed.set()
        return len(taken)


@pytest.mark.timeout(60)
def test_the_feed_entries_of_one_read_reach_a_run_listener_in_one_call_and_the_rest_keep_their_order() -> (
    None
):
    async def main() -> None:
        listener = RunRecorder()
        async with _ready_driver(listener) as (server, _driver, conn):
            for t in range(5):  # One loop iteration: one write, so one read on the client.
                server.send(conn, cs.FeedData(append_id(t + 1), t, 0))
            await listener.wait_for("feed", 4)
            assert listener.runs == [[0, 1, 2, 3, 4]]
            # Room for two: the rest of the read waits in the inbox for the delivery task (entry by entry),
            # in order, with the flush response behind it.
            listener.room = 2
            for t in range(5, 9):
                server.send(conn, cs.FeedData(append_id(t + 1), t, 0))
            server.send(conn, cs.FlushResponse(append_id(9), 8))
            await listener.wait_for("flush", append_id(9), 8)
            assert listener.runs[1:] == [[5, 6], [7], [8]]  # The delivery task's, one entry each.
            assert [e[1] for e in listener.events if e[0] == "feed"] == list(range(9))
            # Repeats at the head of a read are dropped; what follows the position goes straight through.
            listener.room = 1000
            for t in (7, 8, 9, 10):
                server.send(conn, cs.FeedData(append_id(t + 1), t, 0))
            await listener.wait_for("feed", 10)
            assert listener.runs[4:] == [[9, 10]]
            assert [e[1] for e in listener.events if e[0] == "feed"] == list(range(11))

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_the_appends_of_one_loop_iteration_leave_in_one_write_before_anything_sent_after_them() -> None:
    async def main() -> None:
        listener = Recorder()
        async with _ready_driver(listener) as (server, driver, _conn):
            link = driver.mounts[0].link
            assert link is not None
            assert link.conn is not None
            calls: list[tuple[str, int]] = []
            client_conn = link.conn

            def append(seq: int) -> AppendRequest:
                return AppendRequest(append_id(seq), -1, (), (), (), 0, b"x", crc32(b"x"))

            frame_bytes = FRAME_HEADER_BYTES + len(cs.encode(append(1), client_conn.negotiated_version))
            send = client_conn.send

            def recording_send(payload: bytes, body: bytes | None = None, **options: bool) -> None:
                calls.append(
                    ("send_framed", len(payload) // frame_bytes) if options.get("framed") else ("send", 1)
                )
                send(payload, body, **options)

            client_conn.send = recording_send  # type: ignore[method-assign,assignment]

            for seq in (1, 2, 3):
                driver.send_append(0, append_id(seq), x_builder(-1), False)
            driver.send_flush(0, append_id(3))  # Writes the three appends first.
            driver.send_append(0, append_id(4), x_builder(-1), False)
            await asyncio.sleep(0)  # The loop's callbacks: the fourth append's write.
            assert calls == [("send_framed", 3), ("send", 1), ("send_framed", 1)]
            received = []
            while len(received) < 5:
                _, msg = await server.expect(cs.Message)
                if isinstance(msg, cs.AppendRequest | cs.FlushRequest):  # Not the FeedRequest after READY.
                    received.append((type(msg).__name__, msg.req_id.seq_num))
            assert received == [
                ("AppendRequest", 1),
                ("AppendRequest", 2),
                ("AppendRequest", 3),
                ("FlushRequest", 3),
                ("AppendRequest", 4),
            ]
            # Appends queued for a connection that is gone by the write are dropped, not raised.
            driver.send_append(0, append_id(5), x_builder(-1), False)
            link.conn = None
            link.flush_appends()
            link.conn = client_conn
            assert calls[-1] == ("send_framed", 1)

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("garbage", ["message", "frame"])
def test_garbage_from_the_server_ends_the_stream_connection_and_the_partition_mounts_again(
    garbage: str,
) -> None:
    """The stream connection's payloads come from the transport's callback: a message that cannot be
    decoded (or a frame that breaks the framing) after good ones ends the connection once those were
    delivered, NOT_READY is reported, and a new connection mounts again from the last id delivered."""

    async def main() -> None:
        listener = Recorder()
        async with _ready_driver(listener) as (server, _driver, conn):
            server.send(conn, cs.FeedData(append_id(1), 0, 0))
            await listener.wait_for("feed", 0)
            server.send(conn, cs.FeedData(append_id(2), 1, 0))
            if garbage == "message":
                conn.send(b"\xfe not a message")  # No such message type.
            else:
                conn.send(
                    FRAME_HEADER.pack(0x20, conn.negotiated_version, 1) + b"x", framed=True
                )  # Wrong magic.
            server.send(conn, cs.FeedData(append_id(3), 2, 0))  # After the garbage: never delivered.
            await listener.wait_for("state", MountState.NOT_READY)
            conn2, remount = await server.expect(cs.MountRequest)
            assert conn2 is not conn
            assert remount.client_high_water_mark == 1
            server.send(conn2, cs.MountResponse(remount.req_id, cs.PartitionState.READY))
            server.send(conn2, cs.FeedData(append_id(3), 2, 0))
            await listener.wait_for("feed", 2)
            assert [e[1] for e in listener.events if e[0] == "feed"] == [0, 1, 2]

    asyncio.run(main())


class BlockedRecorder(Recorder):
    """A listener whose ``on_feed_data`` waits until ``open`` is set (an application that applies slowly)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = asyncio.Event()

    async def on_feed_data(self, partition_id: int, transaction_id: int, req_id: ReqId, header: int) -> None:
        await self.open.wait()
        await super().on_feed_data(partition_id, transaction_id, req_id, header)


@pytest.mark.timeout(60)
def test_a_full_inbox_stops_reading_from_the_server_until_it_has_room_again() -> None:
    """Back pressure on the callback-read stream connection: once a partition's inbox holds
    INBOX_FEED_LIMIT entries the link reads nothing more (TCP pushes back on the server), and reading
    resumes once the listener took enough of them; every entry arrives, in order."""

    async def main() -> None:
        listener = BlockedRecorder()
        async with _ready_driver(listener) as (_server, driver, conn):
            link = driver.mounts[0].link
            assert link is not None
            assert link.conn is not None
            client_conn = link.conn
            total = INBOX_FEED_LIMIT * 3
            payloads = [
                cs.encode(cs.FeedData(append_id(t + 1), t, 0), conn.negotiated_version) for t in range(total)
            ]
            for payload in payloads:
                conn.send(payload)
            for _ in range(int(STEP_S / 0.01)):  # The inbox fills up (bounded wait).
                if driver.mounts[0].feed_queued >= INBOX_FEED_LIMIT:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert client_conn._reading_paused  # Paused with the inbox full...
            queued = driver.mounts[0].feed_queued
            assert queued < total  # ...before the whole feed was read.
            listener.open.set()
            await listener.wait_for("feed", total - 1)
            assert [e[1] for e in listener.events if e[0] == "feed"] == list(range(total))
            assert not client_conn._reading_paused

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_connection_lost_while_reading_is_paused_for_a_full_inbox_reconnects_and_delivers_each_once() -> (
    None
):
    """The server goes away while the link reads nothing (an inbox full): once the listener takes the
    entries, the link reads on, sees the loss, mounts again on a new connection from the last id delivered,
    and every entry reaches the listener once, in order (a server that feeds again from the start of the log
    repeats nothing)."""

    async def main() -> None:
        listener = BlockedRecorder()
        async with _ready_driver(listener) as (server, driver, conn):
            link = driver.mounts[0].link
            assert link is not None
            first = link.conn
            assert first is not None
            total = INBOX_FEED_LIMIT * 3
            feed = [
                cs.encode(cs.FeedData(append_id(t + 1), t, 0), conn.negotiated_version) for t in range(total)
            ]
            for payload in feed:
                conn.send(payload)
            for _ in range(int(STEP_S / 0.01)):  # The inbox fills up (bounded wait).
                if driver.mounts[0].feed_queued >= INBOX_FEED_LIMIT and first._reading_paused:
                    break
                await asyncio.sleep(0.01)
            assert first._reading_paused
            await conn.aclose()  # The server leaves while the client reads nothing.
            await asyncio.sleep(0.1)
            assert link.conn is first  # Not noticed yet: nothing is read.
            listener.open.set()
            conn2, remount = await server.expect(cs.MountRequest)
            assert conn2 is not conn
            assert link.conn is not first
            assert remount.client_high_water_mark == total - 1  # What the first connection still carried.
            server.send(conn2, cs.MountResponse(remount.req_id, cs.PartitionState.READY))
            for payload in feed:
                conn2.send(payload)
            conn2.send(cs.encode(cs.FeedData(append_id(total + 1), total, 0), conn2.negotiated_version))
            await listener.wait_for("feed", total)
            assert [e[1] for e in listener.events if e[0] == "feed"] == list(range(total + 1))

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_client_ahead_is_asked_again_when_the_owner_or_the_generation_changes() -> None:
    """CLIENT_AHEAD is final only against the incarnation that answered it: a fenced, stale incarnation may
    answer a newer generation's mount, so a new owner or generation mounts the partition again."""

    async def main() -> None:
        first, second = FakeServer(), FakeServer()
        endpoint_a, endpoint_b = await first.start(), await second.start()
        discovery = StaticDiscovery()
        driver = NetworkDriver(ClientConfig(), discovery=discovery)
        listener = Recorder()
        await driver.open(listener)
        try:
            await driver.mount(0, 10)
            discovery.publish({0: (endpoint_a, 3)})
            conn_a, mount = await first.expect(cs.MountRequest)
            first.send(conn_a, cs.MountResponse(mount.req_id, cs.PartitionState.CLIENT_AHEAD))
            await listener.wait_for("state", MountState.CLIENT_AHEAD)

            # The same owner and generation published again: the answer stands (no mount). The next mount
            # the server sees is the one for the new generation, so none was sent in between.
            discovery.publish({0: (endpoint_a, 3)})
            await asyncio.sleep(0)
            discovery.publish({0: (endpoint_a, 4)})
            _, again = await first.expect(cs.MountRequest)
            assert again.req_id.generation == 4
            assert again.client_high_water_mark == 10
            await listener.wait_for("state", MountState.NOT_READY)
            first.send(conn_a, cs.MountResponse(again.req_id, cs.PartitionState.CLIENT_AHEAD))
            await listener.wait_for_count("state", MountState.CLIENT_AHEAD, 2)

            # Another owner: asked again, and its READY gives the partition back.
            discovery.publish({0: (endpoint_b, 5)})
            conn_b, moved = await second.expect(cs.MountRequest)
            assert moved.req_id.generation == 5
            assert moved.client_high_water_mark == 10
            second.send(conn_b, cs.FeedData(append_id(1), 11, 0))
            second.send(conn_b, cs.MountResponse(moved.req_id, cs.PartitionState.READY))
            await listener.wait_for("state", MountState.READY)
            assert listener.events == [
                ("state", MountState.NOT_READY),
                ("state", MountState.CLIENT_AHEAD),
                ("state", MountState.NOT_READY),
                ("state", MountState.CLIENT_AHEAD),
                ("state", MountState.NOT_READY),
                ("feed", 11),
                ("state", MountState.READY),
            ]
            driver.send_append(0, append_id(2), x_builder(11), False)
            _, append = await second.expect(cs.AppendRequest)
            assert append.req_id == append_id(2)
        finally:
            await driver.close()
            await first.aclose()
            await second.aclose()

    asyncio.run(main())


class BrokenDiscovery(StaticDiscovery):
    """A StaticDiscovery whose updates fail at the first publish (ZooKeeper's watch broke, say)."""

    async def updates(self) -> AsyncIterator[Endpoints]:
        await self._changed.wait()
        raise RuntimeError("watch exploded")
        yield {}  # A generator.


async def _driver_failure(listener: Recorder) -> str:
    """The message of the driver failure ``listener`` hears (its only event)."""
    async with asyncio.timeout(STEP_S):
        while not listener.events:
            listener.changed.clear()
            await listener.changed.wait()
    [(kind, message)] = listener.events
    assert kind == "failed"
    return str(message)


def test_a_failed_assignment_task_reaches_the_listener_not_only_the_log() -> None:
    async def main() -> None:
        listener = Recorder()
        discovery = BrokenDiscovery()
        driver = NetworkDriver(ClientConfig(), discovery=discovery)
        await driver.open(listener)
        try:
            discovery.publish({})
            message = await _driver_failure(listener)
            assert "following the partition assignment failed with RuntimeError: watch exploded" in message
        finally:
            await driver.close()

    asyncio.run(main())


def test_a_failed_delivery_task_stops_the_driver_and_the_listener_hears_why() -> None:
    # A partition's delivery task (like its link's connection loop and its next mount) is one the driver
    # cannot serve without: were its failure only logged (or not even that), the partition would stall
    # while submits time out with a message about the mount.
    async def main() -> None:
        listener = Recorder()
        driver = NetworkDriver(ClientConfig(), discovery=StaticDiscovery())

        async def broken(_mount: object) -> None:
            raise RuntimeError("delivery exploded")

        driver._deliver = broken  # type: ignore[method-assign,assignment]
        await driver.open(listener)
        try:
            await driver.mount(0, -1)
            message = await _driver_failure(listener)
            assert "its task 'waltz-deliver-p0' failed with RuntimeError: delivery exploded" in message
        finally:
            await driver.close()

    asyncio.run(main())
