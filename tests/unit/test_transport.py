"""Framed connections, the server and the RPC multiplexer over real loopback sockets (127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest

from waltz.errors import (
    BrokenResourceError,
    BusyResourceError,
    ClientTimeoutError,
    ClosedResourceError,
    LocalProtocolError,
    PartitionNotAssignedError,
    RemoteProtocolError,
)
from waltz.protocol import storage as s
from waltz.protocol import storage_multi as sm
from waltz.protocol.framing import (
    FRAME_HEADER,
    MAGIC_STORAGE,
    NEED_DATA,
    KeepAlive,
    ProtocolConnection,
    encode_frame,
)
from waltz.transport import FramedConnection, FramedServer, RpcClient, open_connection, serve

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")
HOST = "127.0.0.1"
STORAGE: dict[str, Any] = {"magic": MAGIC_STORAGE, "versions": (0,)}


def run(main: Callable[[], Coroutine[Any, Any, T]], timeout_s: float = 10.0) -> T:
    """Run one test body on a fresh loop, bounded in time."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout_s):
            return await main()

    return asyncio.run(bounded())


async def send_and_drain(conn: FramedConnection, payload: bytes) -> None:
    conn.send(payload)
    await conn.drain()


async def echo(conn: FramedConnection) -> None:
    while True:
        conn.send(await conn.receive())
        await conn.drain()


@asynccontextmanager
async def serving(
    handler: Callable[[FramedConnection], Awaitable[None]], **kwargs: Any
) -> AsyncIterator[int]:
    options = {**STORAGE, "hello_text": "Waltz Storage Server", **kwargs}
    async with await serve(HOST, 0, handler, **options) as server:
        yield server.port


async def connect(port: int, **kwargs: Any) -> FramedConnection:
    options = {**STORAGE, "hello_text": "Waltz Storage Client", "connect_timeout_ms": 2000, **kwargs}
    return await open_connection(HOST, port, **options)


@asynccontextmanager
async def raw_server(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[int]:
    """A plain asyncio server, to play a misbehaving or observing peer."""
    tasks: list[asyncio.Task[Any]] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.append(task)
        try:
            await handler(reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    server = await asyncio.start_server(on_connect, HOST, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        await server.wait_closed()


def test_echo_round_trip_negotiates_the_highest_common_version() -> None:
    async def main() -> None:
        async with serving(echo, versions=(0, 1, 2)) as port:
            conn = await connect(port, versions=(1, 2, 3))
            async with conn:
                assert conn.negotiated_version == 2
                assert conn.peer_hello_text == "Waltz Storage Server"
                payloads = [bytes([i % 256]) * (1 + i * 97 % 5000) for i in range(300)] + [bytes(1 << 20)]
                # Queue everything before reading, so many frames arrive in one socket read.
                for payload in payloads:
                    conn.send(payload)
                await conn.drain()
                for payload in payloads:
                    assert await conn.receive() == payload
            with pytest.raises(ClosedResourceError):
                await conn.receive()
            with pytest.raises(ClosedResourceError):
                conn.send(b"x")

    run(main)


def test_receive_takes_the_payloads_before_a_broken_frame_then_raises() -> None:
    async def sender(conn: FramedConnection) -> None:
        conn.send(b"a")
        conn.send(b"bb")
        conn.send(bytes(2000))  # more than the receiver's max_frame_bytes
        await conn.drain()
        await asyncio.sleep(5)

    async def main() -> None:
        async with serving(sender) as port:
            conn = await connect(port, max_frame_bytes=1024)
            async with conn:
                assert await conn.receive() == b"a"
                assert await conn.receive() == b"bb"
                with pytest.raises(RemoteProtocolError):
                    await conn.receive()
                with pytest.raises(RemoteProtocolError):
                    await conn.receive()  # the connection stays failed

    run(main)


def test_a_second_receiver_is_a_busy_resource_error() -> None:
    async def main() -> None:
        async with serving(echo) as port:
            conn = await connect(port)
            async with conn:
                first = asyncio.create_task(conn.receive())
                await asyncio.sleep(0)
                with pytest.raises(BusyResourceError, match="already receiving"):
                    await conn.receive()
                with pytest.raises(BusyResourceError):
                    conn.deliver_payloads(lambda payloads: None, lambda reason: None)
                conn.send(b"one")
                assert await first == b"one"
                conn.send(b"two")
                assert await conn.receive() == b"two"  # the first receiver is done: the next one may come

    run(main)


def test_send_now_writes_at_once_after_the_frames_queued_before_it() -> None:
    async def main() -> None:
        async with serving(echo) as port:
            conn = await connect(port)
            async with conn:
                writes: list[bytes] = []
                transport = conn._transport  # what the connection writes to
                plain_write = transport.write

                def recording_write(data: bytes | bytearray | memoryview) -> None:
                    writes.append(bytes(data))
                    plain_write(data)

                transport.write = recording_write  # type: ignore[method-assign]
                conn.send(b"queued")
                assert writes == []  # send() waits for the end of the loop iteration
                conn.send(b"now", now=True)
                assert len(writes) == 1  # at once, with what was queued before it, in one write
                conn.send(b"alone", now=True)
                assert len(writes) == 2
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                assert len(writes) == 2  # the iteration's flush found nothing left to write
                for expected in (b"queued", b"now", b"alone"):
                    assert await conn.receive() == expected
                with pytest.raises(LocalProtocolError):
                    conn.send(b"", now=True)
            with pytest.raises(ClosedResourceError):
                conn.send(b"x", now=True)

    run(main)


def test_send_framed_takes_frames_framed_by_the_caller_in_order() -> None:
    async def main() -> None:
        async with serving(echo) as port:
            conn = await connect(port)
            async with conn:
                writes: list[bytes] = []
                transport = conn._transport
                plain_write = transport.write

                def recording_write(data: bytes | bytearray | memoryview) -> None:
                    writes.append(bytes(data))
                    plain_write(data)

                transport.write = recording_write  # type: ignore[method-assign]
                version = conn.negotiated_version

                def framed(*payloads: bytes) -> bytes:
                    return b"".join(FRAME_HEADER.pack(MAGIC_STORAGE, version, len(p)) + p for p in payloads)

                conn.send(framed(b"alone"), framed=True, now=True)
                assert len(writes) == 1  # handed over at once
                conn.send(b"queued")
                conn.send(framed(b"a", b"bb"), framed=True)
                assert len(writes) == 1  # joins the frame queued before it, in that iteration's write
                conn.send(b"last")
                await conn.drain()
                assert len(writes) == 2
                conn.send(b"queued")
                conn.send(framed(b"c"), framed=True, now=True)
                assert len(writes) == 3  # now: with the frame queued before it, in one write
                for expected in (b"alone", b"queued", b"a", b"bb", b"last", b"queued", b"c"):
                    assert await conn.receive() == expected
            with pytest.raises(ClosedResourceError):
                conn.send(framed(b"x"), framed=True)

    run(main)


def test_send_with_a_body_frames_head_and_body_as_one_payload_without_joining_the_body() -> None:
    async def main() -> None:
        async with serving(echo) as port:
            conn = await connect(port)
            async with conn:
                pieces: list[bytes | bytearray | memoryview] = []
                writer = conn._writer
                plain_writelines = writer.writelines

                def recording_writelines(data: Iterable[bytes | bytearray | memoryview]) -> None:
                    data = list(data)
                    pieces.extend(data)
                    plain_writelines(data)

                writer.writelines = recording_writelines  # type: ignore[method-assign]
                body = bytes(range(256)) * 8192  # 2 MiB: a range read's run
                conn.send(b"queued")
                conn.send(b"head", body)
                conn.send(b"after")
                await conn.drain()
                # The body is handed to the transport as the object it is: not copied into a payload or frame.
                assert pieces[-1] is body
                for expected in (b"queued", b"head" + body, b"after"):
                    assert await conn.receive() == expected
                with pytest.raises(LocalProtocolError):
                    conn.send(b"", b"")  # an empty payload would read as a keep-alive
            with pytest.raises(ClosedResourceError):
                conn.send(b"x", b"y")

    run(main)


def test_a_large_frame_leaves_after_the_small_ones_queued_before_it_and_before_later_ones() -> None:
    # A frame of 1 MiB or more is written as it is, not copied into the coalescing buffer: the frames queued
    # before it in the same loop iteration must still go first.
    large = bytes(range(256)) * (5 * 4096 + 1)  # 5 MiB and a bit, not a multiple of the read size

    async def main() -> None:
        async with serving(echo, max_frame_bytes=8 << 20) as port:
            conn = await connect(port, max_frame_bytes=8 << 20)
            async with conn:
                conn.send(b"before")
                conn.send(large)
                conn.send(b"after")
                await conn.drain()
                for expected in (b"before", large, b"after"):
                    assert await conn.receive() == expected

    run(main)


def test_oversized_frame_closes_that_connection_with_a_logged_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        async with serving(echo, max_frame_bytes=1024) as port:
            good = await connect(port, max_frame_bytes=1024)
            bad = await connect(port, max_frame_bytes=1 << 20)
            async with good, bad:
                await send_and_drain(good, b"before")
                assert await good.receive() == b"before"
                await send_and_drain(bad, bytes(2048))
                with pytest.raises(BrokenResourceError):
                    await bad.receive()
                # The server keeps serving the other connection.
                await send_and_drain(good, bytes(1024))
                assert await good.receive() == bytes(1024)
                with pytest.raises(LocalProtocolError):
                    good.send(bytes(1025))

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main)
    reasons = [r.getMessage() for r in caplog.records if r.name == "waltz.transport"]
    assert any("closing connection" in m and "2048 bytes exceeds the limit of 1024" in m for m in reasons), (
        reasons
    )


def test_no_common_version_fails_the_connect_on_both_sides(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with serving(echo, versions=(1,)) as port:
            # Each side names both lists: the connecting side raises, the serving side logs why it closed.
            with pytest.raises(
                RemoteProtocolError, match=r"no common version .* supports \[1\], we support \[0\]"
            ):
                await connect(port, versions=(0,))

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main)
    assert any(
        "hello exchange failed" in r.getMessage() and "it supports [0], we support [1]" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_connect_refused_and_silent_peer_are_broken_resource_errors() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(60)

    async def main() -> None:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            free_port = sock.getsockname()[1]
        with pytest.raises(BrokenResourceError, match="cannot connect"):
            await connect(free_port)
        async with raw_server(silent) as port:
            with pytest.raises(BrokenResourceError, match="timed out after 200 ms"):
                await connect(port, connect_timeout_ms=200)

    run(main)


def test_server_drops_a_peer_that_sends_no_hello(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with serving(echo, handshake_timeout_ms=100) as port:
            reader, writer = await asyncio.open_connection(HOST, port)
            try:
                data = await reader.read()  # the server's hello, then EOF once it gives up on us
                assert data[:1] == b"H"
            finally:
                writer.close()
                await writer.wait_closed()

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main)
    assert any("no hello within 100 ms" in r.getMessage() for r in caplog.records)


def test_garbage_from_the_peer_is_a_remote_protocol_error(caplog: pytest.LogCaptureFixture) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(ProtocolConnection(MAGIC_STORAGE, [0], "liar").send_hello())
        writer.write(encode_frame(0x4C, 0, b"not storage"))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with raw_server(garbage) as port, await connect(port) as conn:
            with pytest.raises(RemoteProtocolError, match="negotiated"):
                await conn.receive()
            with pytest.raises(RemoteProtocolError):
                await conn.receive()  # stays failed
            with pytest.raises(BrokenResourceError):
                conn.send(b"x")

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main)
    assert any("closing connection with" in r.getMessage() for r in caplog.records)


def test_connecting_side_sends_keep_alives_when_idle() -> None:
    async def main() -> None:
        keep_alives = 0
        two_seen = asyncio.Event()

        async def observe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal keep_alives
            proto = ProtocolConnection(MAGIC_STORAGE, [0], "observer")
            writer.write(proto.send_hello())
            while data := await reader.read(4096):
                proto.receive_data(data)
                while (event := proto.next_event()) is not NEED_DATA:
                    if isinstance(event, KeepAlive):
                        keep_alives += 1
                        if keep_alives == 2:
                            two_seen.set()

        async with raw_server(observe) as port, await connect(port, keep_alive_interval_s=0.05):
            await asyncio.wait_for(two_seen.wait(), 2)

    run(main)


def test_closing_the_server_closes_its_connections_and_limits_connections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        server: FramedServer = await serve(HOST, 0, echo, hello_text="s", max_connections=1, **STORAGE)
        conn = await connect(server.port)
        await send_and_drain(conn, b"ping")
        assert await conn.receive() == b"ping"
        assert server.connection_count == 1
        with pytest.raises(BrokenResourceError):
            await connect(server.port)  # over max_connections: closed right after accept
        await server.aclose()
        assert server.connection_count == 0
        assert not server.is_serving()
        with pytest.raises(BrokenResourceError):
            await conn.receive()
        await conn.aclose()

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main)
    assert any("refusing connection" in r.getMessage() for r in caplog.records)


def storage_rpc(conn: FramedConnection, **kwargs: Any) -> RpcClient[s.StorageMessage, s.StorageMessage]:
    return RpcClient(
        conn,
        encode=s.encode,
        decode=s.decode,
        request_seq=s.seq_num_of,
        response_seq=s.seq_num_of,
        **kwargs,
    )


def test_rpc_client_matches_out_of_order_replies_and_bounds_in_flight() -> None:
    outstanding = 0
    max_outstanding = 0

    async def replier(conn: FramedConnection) -> None:
        async def reply_later(req: s.StorageMessage) -> None:
            nonlocal outstanding
            await asyncio.sleep(random.random() * 0.005)
            outstanding -= 1
            conn.send(
                s.encode(
                    s.MaxTransactionIdResponse(
                        req.session_id, req.seq_num, req.partition_id, 10 * req.seq_num
                    )
                )
            )

        nonlocal outstanding, max_outstanding
        async with asyncio.TaskGroup() as tg:
            try:
                while True:
                    req = s.decode(await conn.receive())
                    outstanding += 1
                    max_outstanding = max(max_outstanding, outstanding)
                    tg.create_task(reply_later(req))
            except BrokenResourceError:
                pass

    async def main() -> None:
        async with serving(replier) as port, storage_rpc(await connect(port), max_in_flight=8) as rpc:

            async def one(seq: int) -> int:
                response = await rpc.call(s.MaxTransactionIdRequest(1, seq, seq % 4, False), timeout_ms=5000)
                assert isinstance(response, s.MaxTransactionIdResponse)
                assert response.partition_id == seq % 4
                return response.transaction_id

            results = await asyncio.gather(*(one(rpc.next_seq()) for _ in range(300)))
            assert results == [10 * seq for seq in range(300)]
            assert rpc.in_flight == 0

    random.seed(7)
    run(main)
    assert 2 <= max_outstanding <= 8


def test_rpc_client_fails_every_pending_and_waiting_call_when_the_connection_dies() -> None:
    async def take_two_then_hang_up(conn: FramedConnection) -> None:
        await conn.receive()
        await conn.receive()

    async def main() -> None:
        async with (
            serving(take_two_then_hang_up) as port,
            storage_rpc(await connect(port), max_in_flight=2) as rpc,
        ):
            calls = [rpc.call(s.RecordRequest(1, rpc.next_seq(), 0, 5), timeout_ms=5000) for _ in range(5)]
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(r, BrokenResourceError) for r in results), results
            assert not rpc.is_usable
            with pytest.raises(BrokenResourceError, match="lost"):
                await rpc.call(s.RecordRequest(1, rpc.next_seq(), 0, 5), timeout_ms=5000)
            assert rpc.connection.is_closed

    run(main)


def test_rpc_client_tells_loss_listeners_once_and_records_when_the_peer_last_answered() -> None:
    """A storage link shared by many partitions: every partition hears of its loss at once (a listener each),
    and when the node last answered tells an idle partition it is alive without a probe of its own."""

    async def answer_one_then_hang_up(conn: FramedConnection) -> None:
        req = s.decode(await conn.receive())
        await send_and_drain(conn, s.encode(s.RecordResponse(1, s.seq_num_of(req), 0, None)))
        release = s.decode(await conn.receive())
        assert isinstance(release, s.RecordRequest)

    async def main() -> None:
        async with serving(answer_one_then_hang_up) as port, storage_rpc(await connect(port)) as rpc:
            assert rpc.last_answer_s == float("-inf")
            heard: list[tuple[str, BaseException]] = []
            rpc.add_loss_listener(lambda e: heard.append(("a", e)))
            rpc.add_loss_listener(lambda e: heard.append(("b", e)))
            removed = lambda e: heard.append(("removed", e))  # noqa: E731
            rpc.add_loss_listener(removed)
            rpc.remove_loss_listener(removed)
            before = asyncio.get_running_loop().time()
            await rpc.call(s.RecordRequest(1, rpc.next_seq(), 0, 5), timeout_ms=5000)
            assert rpc.last_answer_s >= before
            with pytest.raises(BrokenResourceError):
                await rpc.call(s.RecordRequest(1, rpc.next_seq(), 0, 5), timeout_ms=5000)
            assert [who for who, _ in heard] == ["a", "b"]
            assert all(isinstance(e, BrokenResourceError) for _, e in heard)
            late: list[BaseException] = []
            rpc.add_loss_listener(late.append)  # lost already: told at once
            assert len(late) == 1

    run(main)


def test_rpc_client_timeout_drops_the_late_reply_and_keeps_working() -> None:
    async def slow_for_seq_zero(conn: FramedConnection) -> None:
        async def reply(req: s.StorageMessage, delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            conn.send(s.encode(s.SuccessResponse(req.session_id, req.seq_num, req.partition_id)))

        async with asyncio.TaskGroup() as tg:
            try:
                while True:
                    req = s.decode(await conn.receive())
                    tg.create_task(reply(req, 0.3 if req.seq_num == 0 else 0))
            except BrokenResourceError:
                pass

    async def main() -> None:
        async with serving(slow_for_seq_zero) as port, storage_rpc(await connect(port)) as rpc:
            with pytest.raises(ClientTimeoutError, match="within 50 ms"):
                await rpc.call(s.MaxTransactionIdRequest(1, 0, 0, False), timeout_ms=50)
            assert rpc.in_flight == 0
            assert await rpc.call(s.MaxTransactionIdRequest(1, 1, 0, False), 2000) == s.SuccessResponse(
                1, 1, 0
            )
            await asyncio.sleep(0.4)  # the late reply to seq 0 arrives and is dropped
            assert await rpc.call(s.MaxTransactionIdRequest(1, 2, 0, False), 2000) == s.SuccessResponse(
                1, 2, 0
            )
            assert rpc.is_usable

    run(main)


def test_rpc_client_maps_failures_refuses_duplicate_seq_and_closes() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        async def failing(conn: FramedConnection) -> None:
            while True:
                req = s.decode(await conn.receive())
                if req.partition_id == 99:
                    error = PartitionNotAssignedError("Partition:99 is not assigned.")
                    conn.send(s.encode(s.failure_from_error(req.session_id, req.seq_num, 99, error)))
                else:
                    await gate.wait()  # never answered: the caller is left pending

        def error_of(response: s.StorageMessage) -> BaseException | None:
            return s.failure_to_error(response) if isinstance(response, s.FailureResponse) else None

        async with serving(failing) as port:
            rpc = storage_rpc(await connect(port), error_of=error_of)
            with pytest.raises(PartitionNotAssignedError, match="Partition:99"):
                await rpc.call(s.RecordRequest(1, 0, 99, 5), timeout_ms=2000)
            pending = asyncio.create_task(rpc.call(s.RecordRequest(1, 1, 0, 5), timeout_ms=5000))
            await asyncio.sleep(0.05)
            assert rpc.in_flight == 1
            with pytest.raises(LocalProtocolError, match="already in flight"):
                await rpc.call(s.RecordRequest(1, 1, 0, 6), timeout_ms=2000)
            await rpc.aclose()
            with pytest.raises(ClosedResourceError):
                await pending
            with pytest.raises(ClosedResourceError):
                await rpc.call(s.RecordRequest(1, 2, 0, 5), timeout_ms=2000)
            await rpc.aclose()  # idempotent
            gate.set()

    run(main)


def test_rpc_client_start_call_sends_at_once_and_resolves_maps_fails_and_forgets() -> None:
    """The server's replica appends: sent in the caller's iteration (no task), the future gets the response,
    a failure response's error or the lost connection's; an answered request is forgotten."""

    async def main() -> None:
        received: list[int] = []

        async def replier(conn: FramedConnection) -> None:
            while True:
                req = s.decode(await conn.receive())
                received.append(req.seq_num)
                if req.partition_id == 99:
                    error = PartitionNotAssignedError("Partition:99 is not assigned.")
                    conn.send(s.encode(s.failure_from_error(req.session_id, req.seq_num, 99, error)))
                elif req.partition_id == 7:
                    return  # hangs up
                else:
                    conn.send(s.encode(s.SuccessResponse(req.session_id, req.seq_num, req.partition_id)))

        def error_of(response: s.StorageMessage) -> BaseException | None:
            return s.failure_to_error(response) if isinstance(response, s.FailureResponse) else None

        async with serving(replier) as port, storage_rpc(await connect(port), error_of=error_of) as rpc:
            writes: list[int] = []
            transport = rpc.connection._transport  # what the connection writes to
            plain_write = transport.write

            def recording_write(data: bytes | bytearray | memoryview) -> None:
                writes.append(len(data))
                plain_write(data)

            transport.write = recording_write  # type: ignore[method-assign]
            ok = rpc.start_call(s.MaxTransactionIdRequest(1, 0, 0, False))
            assert len(writes) == 1  # nothing else in flight: written at once
            failed = rpc.start_call(s.MaxTransactionIdRequest(1, 1, 99, False))
            assert len(writes) == 1  # pipelined behind it: joins the iteration's write
            assert rpc.in_flight == 2
            assert not ok.done()
            with pytest.raises(LocalProtocolError, match="already in flight"):
                rpc.start_call(s.MaxTransactionIdRequest(1, 1, 0, False))
            assert await ok == s.SuccessResponse(1, 0, 0)
            with pytest.raises(PartitionNotAssignedError, match="Partition:99"):
                await failed
            assert received == [0, 1]
            assert rpc.in_flight == 0  # answered: forgotten without a caller's cleanup
            lost = rpc.start_call(s.MaxTransactionIdRequest(1, 2, 7, False))
            with pytest.raises(BrokenResourceError, match="lost"):
                await lost

    run(main)


def test_rpc_client_expect_answers_requests_the_caller_sent_in_one_payload() -> None:
    """A storage MultiAppendRequest: requests registered with ``expect`` and sent in one payload each get
    their own answer; if the payload cannot be sent, every pending request fails with the lost connection."""

    async def main() -> None:
        async def replier(conn: FramedConnection) -> None:
            while True:
                msg = sm.decode(await conn.receive())
                assert isinstance(msg, sm.MultiAppendRequest)
                for a in msg.appends:
                    conn.send(s.encode(s.SuccessResponse(a.session_id, a.seq_num, a.partition_id)))

        async with serving(replier) as port, storage_rpc(await connect(port)) as rpc:
            answered: list[int] = []
            futures = [
                rpc.expect(seq, lambda f: answered.append(f.result().seq_num))
                for seq in (rpc.next_seq(), rpc.next_seq())
            ]
            assert rpc.in_flight == 2
            with pytest.raises(LocalProtocolError, match="already in flight"):
                rpc.expect(1)
            body = s.append_request_body(())
            rpc.send_payload(sm.encode_multi_append([s.encode_append_request(1, q, q, body) for q in (0, 1)]))
            assert [await f for f in futures] == [s.SuccessResponse(1, 0, 0), s.SuccessResponse(1, 1, 1)]
            assert answered == [0, 1]
            assert rpc.in_flight == 0

            pending = rpc.expect(rpc.next_seq())
            rpc.connection._transport.close()  # the next write cannot go out
            rpc.connection._closed = True
            rpc.send_payload(b"\x06")
            with pytest.raises(BrokenResourceError, match="lost"):
                await pending
            assert not rpc.is_usable
            rpc.send_payload(b"\x06")  # nothing to do once lost: its requests failed already

    run(main)


def test_a_failing_handler_is_logged_and_the_server_keeps_serving(caplog: pytest.LogCaptureFixture) -> None:
    async def picky(conn: FramedConnection) -> None:
        payload = await conn.receive()
        if payload == b"bad":
            raise ValueError("handler bug")
        await send_and_drain(conn, payload)

    async def main() -> None:
        async with serving(picky) as port:
            async with await connect(port) as first:
                await send_and_drain(first, b"bad")
                with pytest.raises(BrokenResourceError):
                    await first.receive()
            async with await connect(port) as second:
                await send_and_drain(second, b"good")
                assert await second.receive() == b"good"

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main)
    failures = [r for r in caplog.records if "connection handler" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].exc_info is not None


def test_a_failing_background_task_ends_the_connection_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The connection owns its keep-alive and idle-watch tasks: a bug in one must reach the receiver (the
    # connection ends) and the log, not leave the connection running without it.
    async def main() -> None:
        async with serving(echo) as port:
            conn = await connect(port, keep_alive_interval_s=0.05)
            async with conn:

                def broken_write(data: bytes | bytearray | memoryview) -> None:
                    raise ValueError("a bug in the keep-alive")

                conn._transport.write = broken_write  # type: ignore[method-assign]  # only keep-alives write
                ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
                conn.deliver_payloads(lambda payloads: None, ended.set_result)
                reason = await ended
                assert isinstance(reason, BrokenResourceError)
                assert "keep-alive" in str(reason)
                assert "a bug in the keep-alive" in str(reason)
                assert conn.is_closed

    with caplog.at_level(logging.ERROR, logger="waltz.transport"):
        run(main)
    assert any("keep-alive" in r.getMessage() and r.exc_info for r in caplog.records)


def test_what_the_peer_sent_before_it_left_is_received_before_its_end() -> None:
    # The transport may report a read and the end of file in one go (TLS records, uvloop): the payloads of
    # that read are still received, and the end is raised after them.
    async def main() -> None:
        async with serving(echo) as port:
            conn = await connect(port)
            async with conn:
                last = FRAME_HEADER.pack(MAGIC_STORAGE, conn.negotiated_version, 4) + b"last"
                conn._data_received(last + last[:5])  # a whole frame, then part of one
                conn._connection_ended(None)
                assert await conn.receive() == b"last"
                with pytest.raises(BrokenResourceError, match="closed the connection"):
                    await conn.receive()
                with pytest.raises(BrokenResourceError):
                    await conn.receive()

    run(main)
