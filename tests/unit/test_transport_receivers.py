"""``FramedConnection.serve_payloads``: payloads handed to a handler from the transport's data callback (the
storage node's data port, the server's client port); ``FramedConnection.deliver_payloads`` under
``RpcClient``: responses delivered from the callback (the server's storage connections). Over real loopback
sockets, on the standard event loop and on uvloop (the nodes run it)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
import uvloop

from waltz.errors import BrokenResourceError, BusyResourceError, ClosedResourceError, RemoteProtocolError
from waltz.protocol import storage as s
from waltz.protocol.framing import (
    MAGIC_STORAGE,
    NEED_DATA,
    KeepAlive,
    Payload,
    ProtocolConnection,
    encode_frame,
)
from waltz.transport import FramedConnection, RateLimitedLog, RpcClient, open_connection, serve
from waltz.transport import connection as transport_connection

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")
HOST = "127.0.0.1"
STORAGE: dict[str, Any] = {"magic": MAGIC_STORAGE, "versions": (0,)}


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Callable[[], Coroutine[Any, Any, T]]], T]:
    """Run one test body on a fresh loop of the kind the parameter names, bounded in time."""

    def runner(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(10):
                return await main()

        if request.param == "uvloop":
            result: T = uvloop.run(bounded())
            return result
        return asyncio.run(bounded())

    return runner


Handler = Callable[[bytes], Awaitable[None] | None]


@asynccontextmanager
async def serving(
    make_handler: Callable[[FramedConnection], Handler],
    ended: list[BaseException] | None = None,
    **kwargs: Any,
) -> AsyncIterator[int]:
    """A server whose connections serve ``make_handler(conn)``; how serving ended (the
    exception serve_payloads raised) is appended to ``ended``."""

    async def handler(conn: FramedConnection) -> None:
        try:
            await conn.serve_payloads(make_handler(conn))
        except BaseException as e:
            if ended is not None:
                ended.append(e)
            raise

    options = {**STORAGE, "hello_text": "Waltz Storage Server", **kwargs}
    async with await serve(HOST, 0, handler, **options) as server:
        yield server.port


def echo(conn: FramedConnection) -> Handler:
    def handle(payload: bytes) -> None:
        conn.send(payload)

    return handle


async def connect(port: int, **kwargs: Any) -> FramedConnection:
    options = {**STORAGE, "hello_text": "Waltz Storage Client", "connect_timeout_ms": 2000, **kwargs}
    return await open_connection(HOST, port, **options)


async def raw_connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A plain socket that has sent its hello (and so may send frames): to split frames as it likes."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.write(ProtocolConnection(MAGIC_STORAGE, [0], "raw").send_hello())
    await writer.drain()
    return reader, writer


async def send_and_drain(conn: FramedConnection, payload: bytes) -> None:
    conn.send(payload)
    await conn.drain()


def frame(payload: bytes) -> bytes:
    return encode_frame(MAGIC_STORAGE, 0, payload)


async def read_frames(reader: asyncio.StreamReader, count: int) -> list[bytes]:
    """The server's hello skipped, then ``count`` payloads."""
    proto = ProtocolConnection(MAGIC_STORAGE, [0], "raw")
    proto.send_hello()
    payloads: list[bytes] = []
    while len(payloads) < count:
        proto.receive_data(await reader.read(65536))
        while proto.negotiated_version is None:
            if proto.next_event() is not None and proto.negotiated_version is None:
                break
        if proto.negotiated_version is not None:
            proto.take_payloads(payloads)
    return payloads


def test_echo_of_many_frames_in_one_read_and_a_large_one_keeps_their_order(run: Any) -> None:
    async def main() -> None:
        async with serving(echo) as port, await connect(port) as conn:
            payloads = [bytes([i % 256]) * (1 + i * 97 % 5000) for i in range(300)] + [bytes(1 << 20)]
            for payload in payloads:  # queued before reading: many frames arrive in one socket read
                conn.send(payload)
            await conn.drain()
            for payload in payloads:
                assert await conn.receive() == payload

    run(main)


def test_a_frame_split_across_reads_is_handed_over_whole_once_complete(run: Any) -> None:
    async def main() -> None:
        seen: list[bytes] = []

        def record(conn: FramedConnection) -> Handler:
            def handle(payload: bytes) -> None:
                seen.append(payload)
                conn.send(b"ok %d" % len(seen))

            return handle

        async with serving(record) as port:
            reader, writer = await raw_connect(port)
            data = frame(b"first") + frame(b"x" * 3000) + frame(b"third")
            # One byte, then pieces that end inside the header and inside the payload of the next frame.
            for piece in (data[:1], data[1:6], data[6:15], data[15:1000], data[1000:]):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.02)  # separate socket reads
            assert await read_frames(reader, 3) == [b"ok 1", b"ok 2", b"ok 3"]
            assert seen == [b"first", b"x" * 3000, b"third"]
            writer.close()

    run(main)


def test_an_oversized_frame_is_refused_with_a_logged_reason_and_others_are_served(
    run: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        ended: list[BaseException] = []
        async with serving(echo, ended, max_frame_bytes=1024) as port:
            good = await connect(port, max_frame_bytes=1024)
            bad = await connect(port, max_frame_bytes=1 << 20)
            async with good, bad:
                await send_and_drain(bad, bytes(2048))
                with pytest.raises(BrokenResourceError):
                    await bad.receive()
                await send_and_drain(good, bytes(1024))
                assert await good.receive() == bytes(1024)
        assert any(isinstance(e, RemoteProtocolError) for e in ended), ended

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main)
    reasons = [r.getMessage() for r in caplog.records if r.name == "waltz.transport"]
    assert any("2048 bytes exceeds the limit of 1024" in m for m in reasons), reasons


def test_a_peer_closing_mid_frame_ends_serving_with_a_broken_resource_error(run: Any) -> None:
    async def main() -> None:
        ended: list[BaseException] = []
        seen: list[bytes] = []

        def record(conn: FramedConnection) -> Handler:
            return seen.append

        async with serving(record, ended) as port:
            reader, writer = await raw_connect(port)
            writer.write(frame(b"whole") + frame(b"cut short")[:9])
            await writer.drain()
            await reader.readexactly(10)  # of the server's hello: nothing unread, so closing sends a FIN
            writer.close()
            await writer.wait_closed()
            for _ in range(200):
                if ended:
                    break
                await asyncio.sleep(0.01)
        assert seen == [b"whole"]
        assert len(ended) == 1, ended
        assert isinstance(ended[0], BrokenResourceError), ended
        assert "closed the connection" in str(ended[0])

    run(main)


def test_a_handler_that_has_to_wait_pauses_the_payloads_after_it_which_keep_their_order(run: Any) -> None:
    async def main() -> None:
        seen: list[bytes] = []
        release = asyncio.Event()

        def waiting(conn: FramedConnection) -> Handler:
            async def wait_then(payload: bytes) -> None:
                await release.wait()
                seen.append(payload)
                conn.send(payload)

            def handle(payload: bytes) -> Awaitable[None] | None:
                if payload.startswith(b"wait"):
                    return wait_then(payload)
                seen.append(payload)
                conn.send(payload)
                return None

            return handle

        async with serving(waiting) as port, await connect(port) as conn:
            for payload in (b"a", b"wait 1", b"b", b"c"):
                conn.send(payload)
            await conn.drain()
            assert await conn.receive() == b"a"
            await asyncio.sleep(0.1)
            conn.send(b"d")  # arrives while the task waits: buffered, not handled
            await conn.drain()
            await asyncio.sleep(0.1)
            assert seen == [b"a"]
            release.set()
            assert [await conn.receive() for _ in range(4)] == [b"wait 1", b"b", b"c", b"d"]
            assert seen == [b"a", b"wait 1", b"b", b"c", b"d"]
            conn.send(b"e")  # and the callback serves again
            assert await conn.receive() == b"e"

    run(main)


def test_a_peer_that_does_not_read_is_read_no_more_until_our_answers_drain(run: Any) -> None:
    """Back pressure: above the write buffer's high-water mark the server handles no more requests."""

    async def main() -> None:
        handled = 0
        answer = bytes(256 * 1024)

        def big_answers(conn: FramedConnection) -> Handler:
            def handle(payload: bytes) -> None:
                nonlocal handled
                handled += 1
                conn.send(answer)

            return handle

        async with serving(big_answers, write_buffer_high_bytes=512 * 1024) as port:
            reader, writer = await raw_connect(port)
            for _ in range(200):
                writer.write(frame(b"give"))
            await writer.drain()
            await asyncio.sleep(0.3)
            stalled_at = handled
            # Our kernel buffers plus the high-water mark hold a few answers; far from all 200.
            assert 0 < stalled_at < 100, stalled_at
            await asyncio.sleep(0.2)
            assert handled == stalled_at  # nothing more while the peer does not read
            got = 0
            while got < 200 * len(answer):  # reading lets the server go on, to the last request
                got += len(await reader.read(1 << 20))
            assert handled == 200
            writer.close()

    run(main)


def test_a_silent_peer_is_closed_after_the_idle_timeout(run: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        ended: list[BaseException] = []
        async with serving(echo, ended, idle_timeout_s=0.2) as port, await connect(port) as conn:
            await send_and_drain(conn, b"hi")
            assert await conn.receive() == b"hi"
            with pytest.raises(BrokenResourceError):
                await conn.receive()  # the server closes us, idle
        assert len(ended) == 1, ended
        assert "idle timeout" in str(ended[0]), ended

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main)
    assert any("idle timeout" in r.getMessage() for r in caplog.records)


def test_garbage_instead_of_a_hello_is_refused_with_a_logged_reason(
    run: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with serving(echo) as port:
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(b"\x16\x03\x01 looks like TLS")
            await writer.drain()
            data = await reader.read()  # our hello, then EOF
            assert data[:1] == b"H"
            writer.close()
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(frame(b"no hello first"))
            await writer.drain()
            await reader.read()
            writer.close()

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main)
    reasons = [r.getMessage() for r in caplog.records if r.name == "waltz.transport"]
    assert any("the peer speaks TLS" in m for m in reasons), reasons
    assert sum("hello exchange failed" in m for m in reasons) == 2, reasons


def test_a_second_receiver_is_refused_with_a_busy_resource_error(run: Any) -> None:
    async def main() -> None:
        errors: list[BaseException] = []

        async def handler(conn: FramedConnection) -> None:
            serving = asyncio.create_task(conn.serve_payloads(lambda payload: None))
            await asyncio.sleep(0)
            try:
                await conn.receive()
            except BusyResourceError as e:
                errors.append(e)
            serving.cancel()

        options = {**STORAGE, "hello_text": "Waltz Storage Server"}
        async with await serve(HOST, 0, handler, **options) as server, await connect(server.port) as conn:
            conn.deliver_payloads(lambda payloads: None, lambda reason: None)
            with pytest.raises(BusyResourceError, match="already receiving"):
                await conn.serve_payloads(lambda payload: None)
            for _ in range(100):
                if errors:
                    break
                await asyncio.sleep(0.01)
        assert errors
        assert "already receiving" in str(errors[0])

    run(main)


def test_payloads_before_garbage_in_one_read_are_all_handled_in_order_even_after_a_wait(run: Any) -> None:
    """The callback decodes a whole read at once: when a handler has to wait on the first payload, the ones
    after it (already decoded) are handled by the serving task in order, and only then is the garbage that
    followed them in the same read refused."""

    async def main() -> None:
        seen: list[bytes] = []
        ended: list[BaseException] = []

        def waiting(conn: FramedConnection) -> Handler:
            async def later(payload: bytes) -> None:
                await asyncio.sleep(0.05)
                seen.append(payload)

            def handle(payload: bytes) -> Awaitable[None] | None:
                if payload == b"wait":
                    return later(payload)
                seen.append(payload)
                return None

            return handle

        async with serving(waiting, ended) as port:
            _reader, writer = await raw_connect(port)
            await asyncio.sleep(0.05)  # the hello exchange done: what follows is one read
            garbage = encode_frame(MAGIC_STORAGE + 1, 0, b"x")
            writer.write(frame(b"a") + frame(b"wait") + frame(b"b") + frame(b"c") + garbage)
            await writer.drain()
            for _ in range(100):
                if ended:
                    break
                await asyncio.sleep(0.01)
            writer.close()
        assert seen == [b"a", b"wait", b"b", b"c"]
        assert len(ended) == 1
        assert isinstance(ended[0], RemoteProtocolError), ended

    run(main)


def test_an_awaitable_handed_over_is_closed_if_serving_is_cancelled_before_it_runs(run: Any) -> None:
    """The callback hands a handler's awaitable to the serving task, which is cancelled (its server closing)
    before it wakes up: the awaitable never runs, and is closed rather than left unawaited (a "never
    awaited" warning at garbage collection, and whatever it held never released)."""

    async def main() -> None:
        made: list[Coroutine[Any, Any, None]] = []
        ended: list[BaseException] = []

        def cancelled_meanwhile(conn: FramedConnection) -> Handler:
            task = asyncio.current_task()
            assert task is not None

            async def wait_then() -> None:
                conn.send(b"never")

            def handle(payload: bytes) -> Awaitable[None] | None:
                # Runs before the wake-up the hand-over schedules: the task is cancelled with its awaitable
                # handed over but not started.
                asyncio.get_running_loop().call_soon(task.cancel)
                made.append(wait_then())
                return made[-1]

            return handle

        async with serving(cancelled_meanwhile, ended) as port, await connect(port) as conn:
            await send_and_drain(conn, b"wait")
            for _ in range(200):
                if ended:
                    break
                await asyncio.sleep(0.01)
        assert len(ended) == 1, ended
        assert isinstance(ended[0], asyncio.CancelledError), ended
        assert len(made) == 1
        state = inspect.getcoroutinestate(made[0])
        made[0].close()  # so that a failing run does not warn as well
        assert state == inspect.CORO_CLOSED

    run(main)


def test_read_ahead_says_more_payloads_of_the_same_read_follow(run: Any) -> None:
    """``read_ahead`` (what lets a storage node batch appends into one fsync) is True for every payload of a
    read but the last, also once the callback decoded the whole read at once."""

    async def main() -> None:
        ahead: list[bool] = []

        def recording(conn: FramedConnection) -> Handler:
            def handle(payload: bytes) -> None:
                ahead.append(conn.read_ahead)
                conn.send(payload)

            return handle

        async with serving(recording) as port:
            reader, writer = await raw_connect(port)
            await asyncio.sleep(0.05)  # the hello exchange done: what follows is one read
            writer.write(b"".join(frame(bytes([i + 1])) for i in range(4)))
            await writer.drain()
            assert await read_frames(reader, 4) == [b"\x01", b"\x02", b"\x03", b"\x04"]
            writer.close()
        assert ahead == [True, True, True, False]

    run(main)


# ------------------------------------------------- the connecting side: RpcClient answered from the callback

Play = Callable[[asyncio.StreamReader, asyncio.StreamWriter, ProtocolConnection], Awaitable[None]]


@asynccontextmanager
async def storage_peer(play: Play) -> AsyncIterator[int]:
    """A plain asyncio server that exchanges hellos, then lets ``play`` act as the storage node: to answer
    in pieces, in bursts, with garbage, or not at all."""
    tasks: list[asyncio.Task[Any]] = []

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A task of ours, not asyncio's: Python 3.11's stream protocol logs a spurious error when the task it
        # made for a coroutine callback is cancelled (as these are, at the end).
        tasks.append(asyncio.get_running_loop().create_task(peer(reader, writer)))

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        proto = ProtocolConnection(MAGIC_STORAGE, [0], "raw storage")
        writer.write(proto.send_hello())
        try:
            while proto.negotiated_version is None:
                data = await reader.read(65536)
                if not data:
                    return
                proto.receive_data(data)
                proto.next_event()
            await play(reader, writer, proto)
        except OSError:
            pass
        finally:
            writer.close()

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


async def requests(reader: asyncio.StreamReader, proto: ProtocolConnection, n: int) -> list[s.StorageMessage]:
    """The next ``n`` requests the client sent."""
    payloads: list[bytes] = []
    proto.take_payloads(payloads)
    while len(payloads) < n:
        data = await reader.read(65536)
        assert data, "the client hung up"
        proto.receive_data(data)
        proto.take_payloads(payloads)
    assert len(payloads) == n
    return [s.decode(p) for p in payloads]


def success(req: s.StorageMessage) -> bytes:
    return frame(s.encode(s.SuccessResponse(req.session_id, req.seq_num, req.partition_id)))


async def rpc_to(port: int, **kwargs: Any) -> RpcClient[s.StorageMessage, s.StorageMessage]:
    conn = await connect(port, **kwargs)
    return RpcClient(
        conn, encode=s.encode, decode=s.decode, request_seq=s.seq_num_of, response_seq=s.seq_num_of
    )


def request(seq: int) -> s.StorageMessage:
    return s.MaxTransactionIdRequest(1, seq, seq % 4, False)


def test_rpc_responses_are_delivered_from_the_callback_without_a_reader_task(run: Any) -> None:
    async def main() -> None:
        async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: Any) -> None:
            while True:
                (req,) = await requests(reader, proto, 1)
                if req.partition_id != 3:  # partition 3's requests stay unanswered
                    writer.write(success(req))

        async with storage_peer(answer_each) as port:
            conn = await connect(port)
            tasks_before = asyncio.all_tasks()
            rpc = RpcClient(
                conn, encode=s.encode, decode=s.decode, request_seq=s.seq_num_of, response_seq=s.seq_num_of
            )
            assert asyncio.all_tasks() == tasks_before  # no reader task
            assert await rpc.start_call(request(0)) == s.SuccessResponse(1, 0, 0)
            assert await rpc.call(request(1), timeout_ms=2000) == s.SuccessResponse(1, 1, 1)
            assert rpc.in_flight == 0
            with pytest.raises(BusyResourceError, match="already receiving"):
                await conn.receive()  # the callback takes the payloads; nothing else may
            unanswered = rpc.start_call(request(3))
            await asyncio.sleep(0.05)
            await rpc.aclose()
            with pytest.raises(ClosedResourceError):
                await unanswered
            assert conn.is_closed

    run(main)


def test_many_responses_in_one_read_resolve_their_calls_out_of_order(run: Any) -> None:
    async def main() -> None:
        async def answer_all_at_once(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: Any
        ) -> None:
            reqs = await requests(reader, proto, 50)
            writer.write(b"".join(success(req) for req in reversed(reqs)))  # one write, last request first
            await reader.read()

        async with storage_peer(answer_all_at_once) as port, await rpc_to(port) as rpc:
            reads: list[int] = []
            deliver = rpc.connection._sink
            assert deliver is not None

            def counting(payloads: list[bytes]) -> None:
                reads.append(len(payloads))
                deliver(payloads)

            rpc.connection._sink = counting
            futures = [rpc.start_call(request(seq)) for seq in range(50)]
            results = await asyncio.gather(*futures)
            assert results == [s.SuccessResponse(1, seq, seq % 4) for seq in range(50)]
            assert sum(reads) == 50
            assert max(reads) > 1, reads  # several responses handed over from one socket read
            assert rpc.in_flight == 0

    run(main)


def test_a_response_split_across_reads_resolves_once_whole(run: Any) -> None:
    async def main() -> None:
        futures: list[asyncio.Future[s.StorageMessage]] = []
        done_before_whole: list[bool] = []

        async def answer_in_pieces(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: Any
        ) -> None:
            first, second, third = await requests(reader, proto, 3)
            data = success(first) + success(second) + success(third)
            cut = len(success(first)) + 9  # inside the second frame's payload
            for piece in (data[:1], data[1:5], data[5:12], data[12:cut]):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.02)  # separate socket reads
                done_before_whole.append(futures[0].done())
            done_before_whole.append(futures[1].done())  # its last bytes are still to come
            writer.write(data[cut:])
            await reader.read()

        async with storage_peer(answer_in_pieces) as port, await rpc_to(port) as rpc:
            futures.extend(rpc.start_call(request(seq)) for seq in range(3))
            assert await asyncio.gather(*futures) == [s.SuccessResponse(1, seq, seq % 4) for seq in range(3)]
            assert done_before_whole == [False, False, False, True, False]

    run(main)


@pytest.mark.parametrize(
    ("garbage", "reason"),
    [
        (frame(b"\x7f" * 21), "unknown storage message type 127"),
        (encode_frame(MAGIC_STORAGE + 1, 0, b"x"), "magic"),
        (frame(bytes(2048)), "2048 bytes exceeds the limit of 1024"),
    ],
    ids=["undecodable-response", "bad-frame", "oversized-frame"],
)
def test_garbage_fails_every_pending_call_closes_the_connection_and_is_logged(
    run: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, garbage: bytes, reason: str
) -> None:
    # A connecting side's warnings share one rate limiter per process: a fresh one, so this run logs.
    fresh = RateLimitedLog(logging.getLogger("waltz.transport"))
    monkeypatch.setattr(transport_connection, "peer_warnings", fresh)

    async def main() -> None:
        peer_saw_eof: list[bool] = []

        async def answer_garbage(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: Any
        ) -> None:
            await requests(reader, proto, 3)
            writer.write(garbage)
            peer_saw_eof.append(await reader.read() == b"")  # the client closes its end

        async with storage_peer(answer_garbage) as port, await rpc_to(port, max_frame_bytes=1024) as rpc:
            started = [rpc.start_call(request(0)), rpc.start_call(request(1))]
            called = asyncio.ensure_future(rpc.call(request(2), timeout_ms=5000))
            results = await asyncio.gather(*started, called, return_exceptions=True)
            for result in results:
                assert isinstance(result, BrokenResourceError), results
                assert reason in str(result), result
            assert not rpc.is_usable
            assert rpc.connection.is_closed
            with pytest.raises(BrokenResourceError, match="lost"):
                rpc.start_call(request(3))
            for _ in range(100):
                if peer_saw_eof:
                    break
                await asyncio.sleep(0.01)
            assert peer_saw_eof == [True]

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main)
    warnings = [r.getMessage() for r in caplog.records if r.name == "waltz.transport"]
    assert any("closing connection with" in m and reason in m for m in warnings), warnings


def test_the_peer_closing_fails_every_pending_call(run: Any) -> None:
    async def main() -> None:
        async def take_two_then_hang_up(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: Any
        ) -> None:
            first, _second = await requests(reader, proto, 2)
            writer.write(success(first))
            await writer.drain()

        async with storage_peer(take_two_then_hang_up) as port, await rpc_to(port) as rpc:
            answered = rpc.start_call(request(0))
            pending = rpc.start_call(request(1))
            assert await answered == s.SuccessResponse(1, 0, 0)
            with pytest.raises(BrokenResourceError, match="closed the connection"):
                await pending
            assert not rpc.is_usable
            assert rpc.connection.is_closed
            with pytest.raises(BrokenResourceError, match="lost"):
                await rpc.call(request(2), timeout_ms=2000)

    run(main)


def test_an_idle_rpc_connection_sends_keep_alives_and_still_answers(run: Any) -> None:
    async def main() -> None:
        keep_alives = 0

        async def count_keep_alives(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: Any
        ) -> None:
            nonlocal keep_alives
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                proto.receive_data(data)
                while (event := proto.next_event()) is not NEED_DATA:
                    if isinstance(event, KeepAlive):
                        keep_alives += 1
                    elif isinstance(event, Payload):
                        writer.write(success(s.decode(event.data)))

        async with (
            storage_peer(count_keep_alives) as port,
            await rpc_to(port, keep_alive_interval_s=0.02) as rpc,
        ):
            await asyncio.sleep(0.2)  # about ten keep-alives
            assert keep_alives >= 3
            assert await rpc.call(request(0), timeout_ms=2000) == s.SuccessResponse(1, 0, 0)

    run(main)


def test_a_request_encoded_as_parts_is_one_frame_in_order_with_the_others(run: Any) -> None:
    """An encoder may return ``(head, body)``: the body is written after the head, not joined to it, and the
    peer reads one frame, in order with the requests sent before and after it, by start_call and call."""

    async def main() -> None:
        async def answer_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: Any) -> None:
            payloads: list[bytes] = []
            while data := await reader.read(65536):
                proto.receive_data(data)
                proto.take_payloads(payloads)
                for payload in payloads:
                    req = s.decode(payload)
                    seen.append(req)
                    writer.write(success(req))
                payloads.clear()

        seen: list[s.StorageMessage] = []
        written: list[object] = []

        def encode(msg: s.StorageMessage) -> bytes | tuple[bytes, bytes]:
            payload = s.encode(msg)
            if msg.seq_num % 2:
                return payload
            body = payload[9:]
            bodies.append(body)
            return payload[:9], body

        bodies: list[bytes] = []
        async with storage_peer(answer_all) as port:
            conn = await connect(port)
            writelines = conn._writer.writelines

            def recording(parts: Any) -> None:
                parts = list(parts)
                written.extend(parts)
                writelines(parts)

            conn._writer.writelines = recording  # type: ignore[method-assign]
            async with RpcClient(
                conn, encode=encode, decode=s.decode, request_seq=s.seq_num_of, response_seq=s.seq_num_of
            ) as rpc:
                # Several in one loop pass (the later ones join a pending write), then one by one.
                futures = [rpc.start_call(request(seq)) for seq in range(5)]
                assert await asyncio.gather(*futures) == [s.SuccessResponse(1, q, q % 4) for q in range(5)]
                assert await rpc.call(request(6), timeout_ms=2000) == s.SuccessResponse(1, 6, 2)
                assert await rpc.call(request(7), timeout_ms=2000) == s.SuccessResponse(1, 7, 3)
        assert seen == [request(seq) for seq in (0, 1, 2, 3, 4, 6, 7)]
        assert len(bodies) == 4
        for body in bodies:
            assert any(part is body for part in written)  # handed to the transport as it is

    run(main)


def test_on_answer_runs_where_the_response_resolves_the_call_and_on_the_connection_loss(
    run: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``start_call(..., on_answer)``: called in the data callback that resolved the future (before any done
    callback, which runs a loop pass later), with the future; not for a call cancelled before its response;
    for every call still pending when the connection ends; an exception from it is logged, and the
    connection goes on."""

    async def main() -> None:
        async def answer_three_then_hang_up(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: Any
        ) -> None:
            reqs = await requests(reader, proto, 4)
            writer.write(b"".join(success(req) for req in reqs[:3]))  # one read: three answers
            await writer.drain()
            await requests(reader, proto, 1)  # the fifth request: then the peer hangs up

        seen: list[tuple[int, bool, bool]] = []
        done_callbacks: set[int] = set()  # the futures whose done callbacks ran

        def on_answer(future: asyncio.Future[s.StorageMessage]) -> None:
            failed = future.exception() is not None
            seen.append((len(seen), failed, id(future) in done_callbacks))
            if len(seen) == 2:
                raise RuntimeError("a failing answer callback")

        async with storage_peer(answer_three_then_hang_up) as port, await rpc_to(port) as rpc:
            calls = [rpc.start_call(request(seq), on_answer) for seq in range(4)]
            calls[1].cancel()  # before its answer: on_answer is not called for it
            for call in (calls[0], calls[2], calls[3]):
                call.add_done_callback(lambda f: done_callbacks.add(id(f)))
            assert await calls[0] == s.SuccessResponse(1, 0, 0)
            assert await calls[2] == s.SuccessResponse(1, 2, 2)
            # Each told before its done callback ran; the second callback raised, and that was logged.
            assert seen == [(0, False, False), (1, False, False)]
            assert "answer callback of a request" in caplog.text
            assert rpc.is_usable
            last = rpc.start_call(request(4), on_answer)
            with pytest.raises(BrokenResourceError):
                await last
            with pytest.raises(BrokenResourceError):
                await calls[3]
            # Calls 3 and 4 failed with the connection, each told once.
            assert seen[2:] == [(2, True, False), (3, True, False)]


def test_a_deliver_payloads_receiver_may_pause_resume_and_reject(run: Any) -> None:
    """``pause_delivery`` stops reading (nothing delivered) until ``resume_delivery``; ``reject`` ends the
    connection at once with the receiver's RemoteProtocolError, told through ``on_end``, and nothing more
    is delivered."""

    async def main() -> None:
        async with serving(echo) as port:
            conn = await connect(port)
            got: list[bytes] = []
            ended: list[BaseException] = []

            def on_payloads(payloads: list[bytes]) -> None:
                for payload in payloads:
                    got.append(payload)
                    if payload == b"pause":
                        conn.pause_delivery()
                    elif payload == b"garbage":
                        conn.reject(RemoteProtocolError("a payload the receiver cannot decode"))
                        return

            async def until(check: Callable[[], bool]) -> None:
                for _ in range(500):
                    if check():
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError("timed out")

            conn.deliver_payloads(on_payloads, ended.append)
            conn.send(b"pause")
            await until(lambda: got == [b"pause"])
            conn.send(b"after")
            await asyncio.sleep(0.1)
            assert got == [b"pause"]  # The echo is in the socket, unread.
            conn.resume_delivery()
            await until(lambda: got == [b"pause", b"after"])
            conn.send(b"garbage")
            conn.send(b"never")
            await until(lambda: bool(ended))
            assert len(ended) == 1
            assert isinstance(ended[0], RemoteProtocolError)
            assert conn.is_closed
            await asyncio.sleep(0.05)
            assert got == [b"pause", b"after", b"garbage"]
            conn.resume_delivery()  # Nothing once ended.
            await conn.aclose()
            assert len(ended) == 1

    run(main)


def test_a_pause_asked_for_while_the_payloads_that_came_with_the_hello_are_delivered_holds(run: Any) -> None:
    """``deliver_payloads`` hands over what came in the same read as the peer's hello before it returns; a
    receiver that pauses then (its inbox full already) reads nothing more until it resumes: the pause is not
    undone by ``deliver_payloads`` starting to read."""

    async def main() -> None:
        writers: list[asyncio.StreamWriter] = []

        def hello_and_a_frame_at_once(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            proto = ProtocolConnection(MAGIC_STORAGE, [0], "raw storage")
            writer.write(proto.send_hello() + frame(b"pause"))  # one write: read with the hello

        server = await asyncio.start_server(hello_and_a_frame_at_once, HOST, 0)
        try:
            conn = await connect(server.sockets[0].getsockname()[1])
            async with conn:
                got: list[bytes] = []

                def on_payloads(payloads: list[bytes]) -> None:
                    got.extend(payloads)
                    if b"pause" in payloads:
                        conn.pause_delivery()

                conn.deliver_payloads(on_payloads, lambda reason: None)
                assert got == [b"pause"]
                writers[0].write(frame(b"after"))
                await asyncio.sleep(0.2)
                assert got == [b"pause"]  # "after" waits in the socket, unread
                conn.resume_delivery()
                for _ in range(200):
                    if len(got) == 2:
                        break
                    await asyncio.sleep(0.01)
                assert got == [b"pause", b"after"]
        finally:
            for writer in writers:
                writer.close()
            server.close()
            await server.wait_closed()

    run(main)
