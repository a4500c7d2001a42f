"""``serve(..., callback_reads=True)`` and ``FramedConnection.serve_payloads``: payloads handed to a handler
from the transport's data callback (the storage node's data port), over real loopback sockets, on the
standard event loop and on uvloop (which the nodes run on)."""

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

from waltz.errors import BrokenResourceError, RemoteProtocolError
from waltz.protocol.framing import MAGIC_STORAGE, ProtocolConnection, encode_frame
from waltz.transport import FramedConnection, open_connection, serve

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
    """A callback_reads server whose connections serve ``make_handler(conn)``; how serving ended (the
    exception serve_payloads raised) is appended to ``ended``."""

    async def handler(conn: FramedConnection) -> None:
        try:
            await conn.serve_payloads(make_handler(conn))
        except BaseException as e:
            if ended is not None:
                ended.append(e)
            raise

    options = {**STORAGE, "hello_text": "Waltz Storage Server", "callback_reads": True, **kwargs}
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
                await bad.send_and_drain(bytes(2048))
                with pytest.raises(BrokenResourceError):
                    await bad.receive()
                await good.send_and_drain(bytes(1024))
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
            await conn.send_and_drain(b"hi")
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


def test_receive_on_a_callback_connection_and_serve_payloads_elsewhere_are_refused(run: Any) -> None:
    async def main() -> None:
        errors: list[BaseException] = []

        async def handler(conn: FramedConnection) -> None:
            try:
                await conn.receive()
            except RuntimeError as e:
                errors.append(e)

        options = {**STORAGE, "hello_text": "Waltz Storage Server", "callback_reads": True}
        async with await serve(HOST, 0, handler, **options) as server, await connect(server.port) as conn:
            with pytest.raises(RuntimeError, match="callback_reads"):
                await conn.serve_payloads(lambda payload: None)
            for _ in range(100):
                if errors:
                    break
                await asyncio.sleep(0.01)
        assert errors
        assert "serve_payloads" in str(errors[0])

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
            await conn.send_and_drain(b"wait")
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
