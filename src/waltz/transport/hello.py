"""The asyncio protocol under every Waltz connection: it runs the hello exchange, then hands every read
straight to the :class:`~waltz.transport.connection.FramedConnection` from the transport's data callback.

There is one read path: no StreamReader and no task woken per read. Until the peer's hello has arrived the
protocol decodes it itself (:attr:`FrameProtocol.hello` resolves, reading pauses, and any bytes after the
hello stay buffered in the decoder); once the connecting or accepting side built the connection, every read
goes to :meth:`FramedConnection._data_received`. Writing, write flow control and closing are those of
asyncio's stream protocol, so the connection's StreamWriter (``drain``, ``wait_closed``) works as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl as ssl_
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

from waltz.errors import BrokenResourceError, ProtocolError, RemoteProtocolError
from waltz.protocol.framing import NEED_DATA, HelloReceived, ProtocolConnection
from waltz.transport.limits import CLOSE_TIMEOUT_S


class ReadsHandedOver(Protocol):
    """What the protocol hands a connection once the hello is done (a ``FramedConnection``): every read and
    the end of the connection. A Protocol, so that this module need not import the connection's."""

    def _data_received(self, data: bytes) -> None: ...

    def _connection_ended(self, exc: BaseException | None) -> None: ...


__all__ = ["FrameProtocol", "close_writer", "configure_socket", "source_of", "ssl_reason"]

_TLS_RECORD_TYPES: Final = frozenset({0x15, 0x16})
"""TLS record content types a peer sends first: alert (21) and handshake (22)."""


def source_of(writer: asyncio.StreamWriter) -> str:
    """The peer's address without its port: what one host's many connections share."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return str(peer)


def configure_socket(writer: asyncio.StreamWriter, write_buffer_high_bytes: int) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        # Requests are small and latency-bound; never let Nagle hold a frame back. Not every socket is TCP.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.transport.set_write_buffer_limits(high=write_buffer_high_bytes)


def close_writer(writer: asyncio.StreamWriter, *, abort: bool = False) -> Awaitable[None]:
    """Close (or abort) ``writer`` now; the returned awaitable waits, briefly, for the socket to be released.

    The close itself happens synchronously, so it is done even if the caller is cancelled before awaiting.
    """
    if abort:
        writer.transport.abort()
    else:
        writer.close()
    return _wait_closed(writer)


async def _wait_closed(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await writer.wait_closed()


def looks_like_tls(data: bytes) -> bool:
    """True if ``data`` starts like a TLS record (handshake or alert, major version 3).

    A Waltz hello starts with 0x48, so this never matches a Waltz peer; it turns "bad magic 0x16" into "the
    peer speaks TLS" when only one side is configured for TLS.
    """
    return len(data) >= 2 and data[0] in _TLS_RECORD_TYPES and data[1] == 0x03


def _hint(tls: bool) -> str:
    # A TLS listener that refuses a client certificate (TLS 1.3) or a plain connection just hangs up.
    if tls:
        return " (with TLS: does the peer require a client certificate, or not trust this one?)"
    return " (a TLS-only peer does this to a plain connection: is TLS set up on this side?)"


def ssl_reason(e: ssl_.SSLError) -> str:
    return str(e.reason or e.strerror or e)


def _hello_broken(exc: BaseException | None, tls: bool) -> BrokenResourceError:
    """Why the connection ended before the peer's hello, as the error the connecting side reports."""
    if exc is None:
        return BrokenResourceError(f"peer closed the connection during the hello exchange{_hint(tls)}")
    if isinstance(exc, ssl_.SSLError):
        # With TLS 1.3 a refused client certificate shows up here, after our side's handshake completed.
        return BrokenResourceError(
            f"TLS error during the hello exchange: {ssl_reason(exc)} (is this side's certificate one the "
            "peer trusts?)"
        )
    if isinstance(exc, ConnectionResetError):
        # A listener that refuses the TLS handshake (or a plain connection) may reset rather than close.
        return BrokenResourceError(f"connection broken during the hello exchange: {exc}{_hint(tls)}")
    return BrokenResourceError(f"connection broken during the hello exchange: {exc}")


class FrameProtocol(asyncio.StreamReaderProtocol):
    """The protocol of one connection, accepted by :func:`~waltz.transport.serve` or opened by
    :func:`~waltz.transport.open_connection`: the peer's hello first (:attr:`hello` resolves), then every
    read straight to :attr:`conn`."""

    def __init__(
        self,
        on_connect: Callable[[FrameProtocol, asyncio.StreamWriter], None] | None,
        proto: ProtocolConnection,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(None, loop=loop)  # type: ignore[arg-type]  # no reader: see data_received
        self._on_connect = on_connect
        self._event_loop = loop
        self.proto = proto
        self.hello: asyncio.Future[HelloReceived] = loop.create_future()
        # Its failure is read by the serving task, unless that task refused the connection before the hello.
        self.hello.add_done_callback(_retrieve)
        self.conn: ReadsHandedOver | None = None
        """Receives every read once the connecting or accepting side built it (after the hello)."""
        self.writer: asyncio.StreamWriter | None = None
        self._tls = False
        self._first = True
        self._transport_: asyncio.BaseTransport | None = None
        self.ended: tuple[BaseException | None] | None = None
        """``(exc,)`` once the transport reported end of file (None) or loss, for a connection built later."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._transport_ = transport
        self._tls = transport.get_extra_info("sslcontext") is not None
        writer = self.writer = asyncio.StreamWriter(transport, self, None, self._event_loop)  # type: ignore[arg-type]
        if self._on_connect is not None:
            self._on_connect(self, writer)

    def attach(self, conn: ReadsHandedOver) -> None:
        """Hand every read from now on to ``conn`` (reading stays paused until ``conn`` has a receiver)."""
        self.conn = conn
        if self.ended is not None:
            conn._connection_ended(self.ended[0])

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is not None:
            conn._data_received(data)
            return
        self.proto.receive_data(data)
        hello = self.hello
        if hello.done():
            return  # After the hello (reading is paused): the connection takes it when it reads.
        if self._first and not self._tls and looks_like_tls(data):
            self._hello_failed(
                RemoteProtocolError(
                    "the peer speaks TLS but this side of the connection is plain: configure TLS on both "
                    "sides"
                )
            )
            return
        self._first = False
        try:
            event = self.proto.next_event()
        except ProtocolError as e:
            self._hello_failed(e)
            return
        if isinstance(event, HelloReceived):
            # Nothing more is read until the connection has a receiver: what came with the hello stays
            # buffered in the decoder, bounded by this one read.
            self._pause()
            hello.set_result(event)
        elif event is not NEED_DATA:  # pragma: no cover - the decoder refuses anything but a hello here
            self._hello_failed(RemoteProtocolError(f"unexpected {event!r} before the hello"))

    def eof_received(self) -> bool | None:
        self._ended(None)
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._ended(exc)

    def _ended(self, exc: BaseException | None) -> None:
        if self.ended is None:
            self.ended = (exc,)
        if self.conn is not None:
            self.conn._connection_ended(exc)
        else:
            self._hello_failed(_hello_broken(exc, self._tls))

    def _hello_failed(self, error: Exception) -> None:
        self._pause()
        if not self.hello.done():
            self.hello.set_exception(error)

    def _pause(self) -> None:
        transport: Any = self._transport_
        if transport is not None and not transport.is_closing():
            transport.pause_reading()


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
