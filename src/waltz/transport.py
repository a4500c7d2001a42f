"""The thin asyncio layer under every Waltz connection: framed streams, a server, and an RPC multiplexer.

All protocol decisions live in :mod:`waltz.protocol.framing`; this module only moves bytes between sockets
and a :class:`~waltz.protocol.framing.ProtocolConnection`:

* :func:`open_connection` connects, exchanges hellos within ``connect_timeout_ms`` and returns a
  :class:`FramedConnection`. The connecting side sends a keep-alive after ``keep_alive_interval_s`` without
  writes (as the original Waltz did), so idle connections survive middleboxes and a dead peer is noticed.
* :func:`serve` listens and runs ``handler(conn)`` for each connection once its hello exchange completed. The
  returned :class:`FramedServer` owns those handler tasks: closing it cancels them and closes their sockets.
* :class:`RpcClient` multiplexes concurrent request/response calls over one connection, matching replies by
  sequence number, with a bounded number of requests in flight.
* ``serve(..., callback_reads=True)`` hands a connection's payloads to a handler from the transport's data
  callback (:meth:`FramedConnection.serve_payloads`) instead of through a StreamReader and a task woken per
  read: for a peer whose requests should be answered in the loop pass that read them (a storage node's
  data port). The same bounds hold.

The accepting side bounds what one peer can hold (see :func:`serve`): at most ``max_connections`` in all and
``max_connections_per_source`` per source address; a connection whose peer sends nothing (not even a
keep-alive) for ``idle_timeout_s``, or reads none of our bytes for that long while our write buffer is full,
is closed; and it stops reading from a peer whose responses are piling up unsent (above the write buffer's
high-water mark) until they drain, so a peer that sends requests and never reads the answers is pushed back by
TCP instead of growing our memory. :class:`ByteBudget` bounds the bytes of responses a handler produces per
connection; :class:`RateLimitedLog` keeps a misbehaving peer from flooding the log with one warning.

Errors follow :mod:`waltz.errors`: :class:`~waltz.errors.BrokenResourceError` when the peer or the network
ended the connection (retriable with a new connection), :class:`~waltz.errors.ClosedResourceError` when we
closed it, :class:`~waltz.errors.RemoteProtocolError` when the peer sent garbage (the connection is aborted
and the reason logged at WARNING).

The library never installs an event loop policy; entry points may call :func:`run`, which uses uvloop when it
is installed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import re
import socket
import ssl as ssl_
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from types import TracebackType
from typing import Any, Final, Generic, Self, TypeVar

from waltz.errors import (
    BrokenResourceError,
    ClientTimeoutError,
    ClosedResourceError,
    ConfigError,
    ConnectionError_,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from waltz.protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    NEED_DATA,
    HelloReceived,
    ProtocolConnection,
)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_MS",
    "DEFAULT_HANDSHAKE_TIMEOUT_MS",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_KEEP_ALIVE_INTERVAL_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_SOURCE",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_READ_BYTES",
    "DEFAULT_WRITE_BUFFER_HIGH_BYTES",
    "ByteBudget",
    "FramedConnection",
    "FramedServer",
    "RateLimitedLog",
    "RpcClient",
    "open_connection",
    "reason_kind",
    "run",
    "serve",
]

log = logging.getLogger(__name__)

DEFAULT_READ_BYTES: Final = 256 * 1024
"""Bytes asked of the socket per read; every complete frame in one read is decoded before reading again."""
DEFAULT_WRITE_BUFFER_HIGH_BYTES: Final = 4 * 1024 * 1024
"""``drain()`` waits while more than this is queued for the socket (asyncio's default of 64 KiB is below one
replication batch and would stall every append)."""
DEFAULT_KEEP_ALIVE_INTERVAL_S: Final = 60.0
DEFAULT_CONNECT_TIMEOUT_MS: Final = 10_000
DEFAULT_HANDSHAKE_TIMEOUT_MS: Final = 10_000
DEFAULT_MAX_CONNECTIONS: Final = 1024
DEFAULT_MAX_CONNECTIONS_PER_SOURCE: Final = 256
"""Connections one source address may hold on a listener, so one host cannot take every slot."""
DEFAULT_IDLE_TIMEOUT_S: Final = 3 * DEFAULT_KEEP_ALIVE_INTERVAL_S
"""A served connection silent this long is closed: three keep-alive intervals of a healthy connecting side."""
DEFAULT_MAX_IN_FLIGHT: Final = 1024
_COALESCE_MAX_BYTES: Final = 1024 * 1024
"""Frames sent in one loop iteration are written together, up to this many bytes per write."""
_HEADER_CACHE_SIZE: Final = 256
"""Payload sizes whose frame header a connection remembers (7 bytes each)."""
_CLOSE_TIMEOUT_S: Final = 1.0
_TLS_RECORD_TYPES: Final = frozenset({0x15, 0x16})
"""TLS record content types a peer sends first: alert (21) and handshake (22)."""

PEER_WARNING_INTERVAL_S: Final = 10.0
"""One WARNING per peer address and reason per this many seconds; the next one counts those left out."""


class RateLimitedLog:
    """WARNINGs about peers, at most one per ``(source, kind)`` per ``interval_s``.

    A peer that repeats a fault (reconnecting with garbage, flooding connections) would otherwise write a line
    per attempt: ~500 KiB/s from one peer was measured. The first occurrence is logged at once; repeats within
    the interval are counted and the next line logged for that key says how many were left out. At most
    ``max_keys`` keys are remembered (the oldest are forgotten), so the bookkeeping is bounded too.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = PEER_WARNING_INTERVAL_S,
        *,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._seen: collections.OrderedDict[tuple[str, str], list[float]] = collections.OrderedDict()
        """``(source, kind) -> [time of the last line logged, repeats left out since]``."""

    def warning(self, source: str, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``(source, kind)`` was logged within the interval; True if logged."""
        key = (source, kind)
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self._interval_s:
            seen[1] += 1
            return False
        left_out = int(seen[1]) if seen is not None else 0
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > self._max_keys:
            self._seen.popitem(last=False)
        if left_out:
            msg += " (%d more like this from %s in the last %g s not logged)"
            args = (*args, left_out, source, self._interval_s)
        self._logger.warning(msg, *args)
        return True


_peer_warnings = RateLimitedLog(log)
_DIGITS = re.compile(r"\d+")


def reason_kind(prefix: str, error: BaseException) -> str:
    """A rate-limiting kind for ``error``: its type and message with numbers blanked (so "type 98" and
    "type 99" are one reason, while "unknown type" and "truncated" stay two), at most 100 characters."""
    return f"{prefix}:{type(error).__name__}:{_DIGITS.sub('#', str(error))[:100]}"


def _source(writer: asyncio.StreamWriter) -> str:
    """The peer's address without its port: what one host's many connections share."""
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return str(peer)


class ByteBudget:
    """The bytes of responses one connection's handler may hold at once (being read, or unsent).

    :meth:`acquire` waits while the reservations already granted plus the new one exceed ``capacity_bytes``;
    a reservation larger than the whole budget is granted once nothing else is reserved, so one oversized
    response still goes, alone. Waiting here is back pressure: the handler that waits reads no more requests.
    Single event loop; no locking.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._used = 0
        self._freed = asyncio.Event()

    @property
    def reserved_bytes(self) -> int:
        return self._used

    def try_acquire(self, n: int) -> bool:
        """:meth:`acquire` if it would not wait (True), else nothing (False)."""
        if self._used and self._used + n > self.capacity_bytes:
            return False
        self._used += n
        return True

    async def acquire(self, n: int) -> None:
        while self._used and self._used + n > self.capacity_bytes:
            self._freed.clear()
            await self._freed.wait()
        self._used += n

    def release(self, n: int) -> None:
        self._used -= n
        self._freed.set()


PayloadHandler = Callable[[bytes], Awaitable[None] | None]
"""What :meth:`FramedConnection.serve_payloads` calls per payload: None when done with it, or an awaitable
to run (in the serving task, reading paused) before the next payload."""

ReqT = TypeVar("ReqT")
RespT = TypeVar("RespT")
T = TypeVar("T")


def _configure_socket(writer: asyncio.StreamWriter, write_buffer_high_bytes: int) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        # Requests are small and latency-bound; never let Nagle hold a frame back. Not every socket is TCP.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.transport.set_write_buffer_limits(high=write_buffer_high_bytes)


def _close_writer(writer: asyncio.StreamWriter, *, abort: bool = False) -> Awaitable[None]:
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
        async with asyncio.timeout(_CLOSE_TIMEOUT_S):
            await writer.wait_closed()


def _looks_like_tls(data: bytes) -> bool:
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


def _ssl_reason(e: ssl_.SSLError) -> str:
    return str(e.reason or e.strerror or e)


async def _exchange_hellos(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proto: ProtocolConnection, read_bytes: int
) -> HelloReceived:
    """Send our hello and wait for the peer's; bytes after its hello stay buffered in ``proto``."""
    tls = writer.get_extra_info("sslcontext") is not None
    writer.write(proto.send_hello())
    first = True
    while True:
        event = proto.next_event()
        if isinstance(event, HelloReceived):
            return event
        if event is not NEED_DATA:  # pragma: no cover - the decoder refuses anything but a hello here
            raise RemoteProtocolError(f"unexpected {event!r} before the hello")
        try:
            data = await reader.read(read_bytes)
        except ssl_.SSLError as e:
            # With TLS 1.3 a refused client certificate shows up here, after our side's handshake completed.
            raise BrokenResourceError(
                f"TLS error during the hello exchange: {_ssl_reason(e)} (is this side's certificate one the "
                "peer trusts?)"
            ) from None
        except ConnectionResetError as e:
            # A listener that refuses the TLS handshake (or a plain connection) may reset rather than close.
            raise BrokenResourceError(
                f"connection broken during the hello exchange: {e}{_hint(tls)}"
            ) from None
        except OSError as e:
            raise BrokenResourceError(f"connection broken during the hello exchange: {e}") from None
        if not data:
            raise BrokenResourceError(f"peer closed the connection during the hello exchange{_hint(tls)}")
        if first and not tls and _looks_like_tls(data):
            raise RemoteProtocolError(
                "the peer speaks TLS but this side of the connection is plain: configure TLS on both sides"
            )
        first = False
        proto.receive_data(data)


class FramedConnection:
    """A connection after its hello exchange: whole payloads in and out.

    Guarantees: :meth:`receive` returns payloads in the order the peer framed them, skipping keep-alives;
    :meth:`send` queues whole frames in call order (it never interleaves two frames). One task may call
    :meth:`receive` at a time; :meth:`send` may be called from any task of the loop. A protocol violation by
    the peer aborts the connection and is logged once, with the peer's address, at WARNING.

    Created by :func:`open_connection` and :func:`serve`, not directly.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader | None,
        writer: asyncio.StreamWriter,
        proto: ProtocolConnection,
        *,
        read_bytes: int = DEFAULT_READ_BYTES,
        keep_alive_interval_s: float | None = None,
        idle_timeout_s: float | None = None,
        write_buffer_high_bytes: int | None = None,
        peer_warnings: RateLimitedLog | None = None,
    ) -> None:
        if proto.negotiated_version is None:
            raise LocalProtocolError("a FramedConnection needs a completed hello exchange")
        self._reader = reader
        self._writer = writer
        self._transport = writer.transport
        """What ``writer.write`` and ``writer.is_closing`` call: used directly on the send path (two Python
        calls fewer per frame)."""
        self._proto = proto
        self._read_bytes = read_bytes
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._receiving = False
        self._error: ConnectionError_ | RemoteProtocolError | None = None
        self._last_write_s = self._loop.time()
        self._out: bytearray | None = None
        self._max_payload_bytes = proto.max_frame_bytes
        self._headers: dict[int, bytes] = {}
        """Frame headers by payload size (see :meth:`_header`)."""
        self._dispatching = False
        """True while :meth:`_data_received` hands payloads to a handler: frames sent meanwhile leave in one
        write at its end instead of in a callback of the next loop iteration."""
        self._handle: PayloadHandler | None = None
        """The handler of :meth:`serve_payloads` while the transport's callback may call it (None while the
        serving task is busy: payloads then stay buffered and reading is paused)."""
        self._wake: asyncio.Future[Awaitable[None] | None] | None = None
        """What the serving task waits on while the callback delivers: the handler's awaitable to run, None to
        drain, or an exception (the connection ended)."""
        self._reading_paused = False
        self._taken: list[bytes] = []
        """The payloads :meth:`_data_received` decoded from one read, handed to the handler in order."""
        self._ahead = 0
        """Payloads :meth:`_data_received` decoded after the one its handler is handling (for read_ahead)."""
        self._sink: Callable[[list[bytes]], None] | None = None
        """The receiver of :meth:`deliver_payloads` (a connecting side's RpcClient): each read's payloads go
        to it from the transport's callback, with no task in between."""
        self._on_end: Callable[[BaseException], None] | None = None
        """Told once, with the reason, when the connection ends while :attr:`_sink` receives."""
        self._delivery_paused = False
        """:meth:`pause_delivery` in force (kept apart from _reading_paused, which is also True before
        :meth:`deliver_payloads` starts reading: a pause asked for then must outlive that start)."""
        self._left: collections.deque[bytes] = collections.deque()
        """Payloads decoded but not yet handed over when the callback stopped (a handler had to wait, our
        frames piled up): the serving task hands them over first, before any still in the decoder. At most
        one read's worth, since reading pauses then."""
        self._keep_alive_interval_s = keep_alive_interval_s
        self._keep_alive_task: asyncio.Task[None] | None = None
        if keep_alive_interval_s is not None:
            if keep_alive_interval_s <= 0:
                raise ValueError(f"keep_alive_interval_s must be positive, got {keep_alive_interval_s}")
            self._keep_alive_task = self._loop.create_task(
                self._keep_alive_loop(keep_alive_interval_s), name=f"keep-alive {self.peername}"
            )
        # The accepting side's bounds (see serve()): while more than this is unsent, receive() reads nothing.
        self._pause_reading_above_bytes = write_buffer_high_bytes
        self._warnings = peer_warnings if peer_warnings is not None else _peer_warnings
        self._idle_timeout_s = idle_timeout_s
        self._read_started_s: float | None = None
        """When the pending socket read began (None while not waiting for the peer): the idle clock."""
        self._idle_task: asyncio.Task[None] | None = None
        if idle_timeout_s is not None:
            if idle_timeout_s <= 0:
                raise ValueError(f"idle_timeout_s must be positive, got {idle_timeout_s}")
            self._idle_task = self._loop.create_task(
                self._idle_watch(idle_timeout_s), name=f"idle-watch {self.peername}"
            )

    @property
    def negotiated_version(self) -> int:
        """The codec version both ends agreed on."""
        version = self._proto.negotiated_version
        assert version is not None  # checked in __init__; never reset
        return version

    @property
    def peer_hello_text(self) -> str:
        """The text of the peer's hello, e.g. "Waltz Storage Server"."""
        hello = self._proto.peer_hello
        return hello.text if hello is not None else ""

    @property
    def peername(self) -> str:
        """``host:port`` of the peer (for logs)."""
        peer = self._writer.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            return f"{peer[0]}:{peer[1]}"
        return str(peer)

    @property
    def source(self) -> str:
        """The peer's address without its port (what rate-limited warnings and per-source limits key on)."""
        return _source(self._writer)

    @property
    def peercert(self) -> dict[str, Any] | None:
        """The peer's verified TLS certificate (``ssl.SSLSocket.getpeercert`` form), None without one."""
        cert = self._writer.get_extra_info("peercert")
        return cert if isinstance(cert, dict) and cert else None

    @property
    def max_frame_bytes(self) -> int:
        return self._proto.max_frame_bytes

    @property
    def is_closed(self) -> bool:
        """True once :meth:`aclose` was called or the connection failed."""
        return self._closed or self._error is not None

    @property
    def read_ahead(self) -> bool:
        """True if bytes the peer sent after the payload just received are read already: more requests are
        right behind it (a handler may leave this one to be batched with them)."""
        # Payloads of the same read decoded already (by serve_payloads' callback) count as much as bytes.
        return self._ahead > 0 or bool(self._left) or self._proto.buffered_bytes > 0

    async def receive(self) -> bytes:
        """The next payload. Raises BrokenResourceError at EOF or reset, RemoteProtocolError on garbage,
        ClosedResourceError after :meth:`aclose`."""
        if self._receiving:
            raise RuntimeError("another task is already receiving on this connection")
        self._receiving = True
        try:
            proto = self._proto
            while True:
                self._check_open()
                try:
                    # The payload alone (keep-alives skipped), without a Frame and a Payload event around it.
                    payload = proto.next_payload()
                except RemoteProtocolError as e:
                    self._protocol_failure(e)
                    raise
                if payload is not None:
                    return payload
                high = self._pause_reading_above_bytes
                if high is not None and self._transport.get_write_buffer_size() > high:
                    # Our answers to this peer are piling up unsent: read no more requests until they
                    # drain (TCP then pushes back on a peer that sends but does not read).
                    await self.drain()
                proto.receive_data(await self._read())
        finally:
            self._receiving = False

    async def receive_many(self, out: list[bytes]) -> None:
        """Wait for at least one payload, then append every whole payload buffered to ``out``, in order: one
        coroutine per socket read for a reader that handles a burst at a time (a server's client connection,
        a storage RPC reader). Raises as :meth:`receive` does; a protocol error found after some payloads
        returns those first and raises on the next call."""
        if self._receiving:
            raise RuntimeError("another task is already receiving on this connection")
        self._receiving = True
        try:
            proto = self._proto
            start = len(out)
            while True:
                self._check_open()
                try:
                    proto.take_payloads(out)
                except RemoteProtocolError as e:
                    self._protocol_failure(e)  # remembered: the next call raises it
                    if len(out) > start:
                        return
                    raise
                if len(out) > start:
                    return
                high = self._pause_reading_above_bytes
                if high is not None and self._transport.get_write_buffer_size() > high:
                    # As in receive(): read no more requests while our answers pile up unsent.
                    await self.drain()
                proto.receive_data(await self._read())
        finally:
            self._receiving = False

    def receive_nowait(self) -> bytes | None:
        """The next payload if a whole one is already buffered, else None (no socket read, no coroutine).

        A reader that drains a burst with it after one :meth:`receive` pays one coroutine per socket read
        instead of one per message. Raises as :meth:`receive` does. Not while another task is in receive.
        """
        self._check_buffered_read()
        try:
            return self._proto.next_payload()
        except RemoteProtocolError as e:
            self._protocol_failure(e)
            raise

    def receive_buffered(self, out: list[bytes]) -> None:
        """Append every whole payload already buffered to ``out`` (no socket read, no coroutine): a burst
        drained with one call instead of one :meth:`receive_nowait` per payload. Raises as
        :meth:`receive_nowait` does, after appending the payloads before a protocol error."""
        self._check_buffered_read()
        try:
            self._proto.take_payloads(out)
        except RemoteProtocolError as e:
            self._protocol_failure(e)
            raise

    def _check_buffered_read(self) -> None:
        """Raise why a buffered read (:meth:`receive_nowait`, :meth:`receive_buffered`) cannot be made."""
        if self._receiving:
            raise RuntimeError("another task is already receiving on this connection")
        self._check_open()

    def _check_open(self) -> None:
        """Raise why nothing more can be received: the connection failed (its error) or was closed."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ClosedResourceError("connection closed")

    async def serve_payloads(self, handle: PayloadHandler) -> None:
        """Hand every payload the peer sends to ``handle``, in order, from the transport's data callback: no
        task wakes up and no coroutine resumes per socket read (a storage node's data connections, where a
        request and its answer then take one pass of the event loop). Only on a connection accepted by
        ``serve(..., callback_reads=True)``, whose bytes reach it without a StreamReader.

        ``handle(payload)`` returns None once it dealt with the payload, or an awaitable when it has to wait
        (for room in a queue, for a lookup): reading then pauses, the awaitable runs in this task, and the
        payloads after it are handed over once it finished, so they keep their order. An exception from
        ``handle`` or its awaitable ends serving and propagates from here. Frames :meth:`send` queues while
        the callback runs ``handle`` leave in one write when it returns, not one loop iteration later.

        Bounds as :meth:`receive`: while more of our frames than the high-water mark are unsent, nothing more
        is read until they drain (within the idle timeout); the idle timeout counts while waiting for the
        peer. Never returns: raises BrokenResourceError when the peer leaves or the connection breaks,
        RemoteProtocolError on garbage (logged and aborted as :meth:`receive` does), ClosedResourceError after
        :meth:`aclose`.
        """
        if self._reader is not None:
            raise RuntimeError(
                "serve_payloads() needs a connection of a serve(..., callback_reads=True) server"
            )
        if self._receiving:
            raise RuntimeError("another task is already receiving on this connection")
        self._receiving = True
        proto = self._proto
        loop = self._loop
        left = self._left
        try:
            while True:
                self._check_open()
                # Payloads that arrived while this task was busy (or with the peer's hello) are handed over
                # here, in order, before the callback takes over again: those the callback decoded already
                # first, then those still in the decoder.
                payload: bytes | None
                if left:
                    payload = left.popleft()
                else:
                    try:
                        payload = proto.next_payload()
                    except RemoteProtocolError as e:
                        self._protocol_failure(e)
                        raise
                if payload is not None:
                    pending = handle(payload)
                    if pending is not None:
                        await pending
                    if self._write_backlogged():
                        await self.drain()
                    continue
                if self._write_backlogged():
                    await self.drain()
                    continue
                wake: asyncio.Future[Awaitable[None] | None] = loop.create_future()
                self._wake = wake
                self._handle = handle
                self._read_started_s = loop.time()
                self._resume_reading()
                try:
                    pending = await wake
                except asyncio.CancelledError:
                    # Cancelled after the callback handed over a handler's awaitable and before this task
                    # woke up: it never runs; closed, so it is not reported as never awaited.
                    if wake.done() and not wake.cancelled() and wake.exception() is None:
                        handed = wake.result()
                        if inspect.iscoroutine(handed):
                            handed.close()
                    raise
                finally:
                    self._handle = self._wake = self._read_started_s = None
                if pending is not None:
                    await pending
                # None: our frames pile up unsent; the top of the loop drains them before reading on.
        finally:
            self._receiving = False

    def deliver_payloads(
        self, on_payloads: Callable[[list[bytes]], None], on_end: Callable[[BaseException], None]
    ) -> None:
        """From now on hand every payload the peer sends to ``on_payloads``, from the transport's data
        callback: one call per socket read with that read's whole payloads, in order (the list is reused:
        take what you need before returning). No task wakes up and no coroutine resumes per read: a storage
        node's answers reach the server's waiting replica sessions in the pass of the loop that read them.
        Only on a connection of ``open_connection(..., callback_reads=True)``.

        ``on_payloads`` must not block and should not raise (an exception is logged and ends the connection).
        ``on_end(reason)`` is called once when the connection ends: BrokenResourceError when the peer left
        or the network broke it, RemoteProtocolError on garbage (logged and aborted as :meth:`receive`
        does), ClosedResourceError after :meth:`aclose`; nothing is delivered after it. Payloads that came
        with the peer's hello are delivered before this returns."""
        if self._reader is not None:
            raise RuntimeError(
                "deliver_payloads() needs a connection of open_connection(..., callback_reads=True)"
            )
        if self._receiving or self._sink is not None:
            raise RuntimeError("another receiver already takes this connection's payloads")
        self._receiving = True  # for good: receive() and serve_payloads() are refused from now on
        self._sink = on_payloads
        self._on_end = on_end
        self._deliver_read(None)
        if self._sink is not None:  # (None if it ended while delivering what came with the hello)
            if self._error is not None or self._closed:
                self._end_delivery()
            elif not self._delivery_paused:  # The receiver may have paused on what came with the hello.
                self._resume_reading()

    def pause_delivery(self) -> None:
        """For :meth:`deliver_payloads`' receiver that has no room for more (e.g. from ``on_payloads``):
        read nothing more from the peer (TCP then pushes back) until :meth:`resume_delivery`. The payloads of
        the read being delivered are all handed over first."""
        if self._sink is not None:
            self._delivery_paused = True
            self._pause_reading()

    def resume_delivery(self) -> None:
        """Read and deliver again after :meth:`pause_delivery` (nothing if the connection ended)."""
        if self._sink is not None and not self.is_closed:
            self._delivery_paused = False
            self._resume_reading()

    def reject(self, error: RemoteProtocolError) -> None:
        """For :meth:`deliver_payloads`' receiver: the peer sent a payload it cannot decode (garbage in a
        well-formed frame). Logged and aborted as bad framing is, and ``on_end(error)`` told at once; nothing
        more is delivered."""
        if self._sink is None:
            return
        self._protocol_failure(error)
        self._end_delivery()

    def _deliver_read(self, data: bytes | None) -> None:
        """:meth:`deliver_payloads`' share of the data callback: decode this read, hand its payloads over."""
        proto = self._proto
        if data is not None:
            proto.receive_data(data)
        if self._idle_task is not None:
            self._read_started_s = self._loop.time()  # always waiting for the peer: every read restarts it
        taken = self._taken
        error: RemoteProtocolError | None = None
        try:
            proto.take_payloads(taken)
        except RemoteProtocolError as e:
            error = e  # after the payloads before it, as if they had been decoded one by one
        sink = self._sink
        try:
            if taken and sink is not None:
                sink(taken)
        except Exception as e:  # the receiver's bug: logged, and the connection ends
            log.exception("receiver of the payloads from %s failed", self.peername)
            self._abort(BrokenResourceError(f"connection with {self.peername} ended: receiver failed: {e}"))
            return
        finally:
            taken.clear()
        if error is not None and self._sink is not None:
            self._protocol_failure(error)
            self._end_delivery()

    def _end_delivery(self) -> None:
        """Tell :meth:`deliver_payloads`' receiver, once, why the connection ended."""
        on_end = self._on_end
        self._sink = self._on_end = None
        if on_end is not None:
            on_end(self._error if self._error is not None else ClosedResourceError("connection closed"))

    def _abort(self, error: ConnectionError_ | RemoteProtocolError) -> None:
        """End the connection now, from a callback (no await): unsent frames are dropped, the keep-alive and
        idle tasks cancelled, a :meth:`deliver_payloads` receiver told; :meth:`aclose` still releases it."""
        if self._error is None and not self._closed:
            self._error = error
        self._out = None
        self._transport.abort()
        for task in (self._keep_alive_task, self._idle_task):
            if task is not None:
                task.cancel()
        self._end_delivery()

    def _data_received(self, data: bytes) -> None:
        """The transport's data callback on a ``callback_reads`` connection (see :meth:`serve_payloads`)."""
        if self._sink is not None:
            self._deliver_read(data)
            return
        proto = self._proto
        proto.receive_data(data)
        handle = self._handle
        if handle is None:
            # The serving task is busy (a handler's awaitable, a drain) or not serving yet: it takes these
            # payloads itself, and nothing more is read until then (the buffer stays bounded).
            self._pause_reading()
            return
        self._read_started_s = self._loop.time()
        # Every whole payload of this read in one decoder call (not two Python calls per payload). A protocol
        # error after some of them is raised again by the decoder when the serving task next asks it, once
        # the payloads before it were handled, as if they had been decoded one by one.
        taken = self._taken
        error: RemoteProtocolError | None = None
        try:
            proto.take_payloads(taken)
        except RemoteProtocolError as e:
            error = e
        self._dispatching = True
        i = 0
        n = len(taken)
        try:
            while i < n:
                self._ahead = n - i - 1
                pending = handle(taken[i])
                i += 1
                if pending is not None:
                    self._left.extend(taken[i:])
                    self._hand_over(pending)
                    return
                if self._write_backlogged():
                    # Our answers pile up unsent: the serving task drains them before the next payload.
                    self._left.extend(taken[i:])
                    self._hand_over(None)
                    return
            if error is not None:
                self._protocol_failure(error)
                self._hand_over(error)
        except Exception as e:  # noqa: BLE001 - the handler's: raised by serve_payloads, in its task
            self._hand_over(e)
            return
        finally:
            taken.clear()
            self._ahead = 0
            self._dispatching = False
            if self._out is not None:
                self._flush_out()

    def _hand_over(self, what: Awaitable[None] | Exception | None) -> None:
        """Stop the callback's deliveries and wake the serving task with ``what`` (see serve_payloads)."""
        self._handle = None
        self._pause_reading()
        wake = self._wake
        if wake is None or wake.done():  # the serving task was cancelled meanwhile
            if inspect.iscoroutine(what):
                what.close()  # never to run: closed, so it is not reported as never awaited
            return
        if isinstance(what, Exception):
            wake.set_exception(what)
        else:
            wake.set_result(what)

    def _connection_ended(self, exc: BaseException | None) -> None:
        """The transport reported end of file or loss (``callback_reads`` connections)."""
        if self._error is None and not self._closed:
            if exc is None:
                self._error = BrokenResourceError(f"{self.peername} closed the connection")
            else:
                self._error = BrokenResourceError(f"connection with {self.peername} broken: {exc}")
        if self._handle is not None:
            self._hand_over(
                self._error if self._error is not None else ClosedResourceError("connection closed")
            )
        if self._sink is not None:
            self._end_delivery()

    def _write_backlogged(self) -> bool:
        """More of our frames unsent than the accepting side's high-water mark (never on connecting sides)."""
        high = self._pause_reading_above_bytes
        if high is None:
            return False
        out = self._out
        return self._transport.get_write_buffer_size() + (len(out) if out is not None else 0) > high

    def _pause_reading(self) -> None:
        if not self._reading_paused:
            self._reading_paused = True
            # Any: a uvloop or an SSL transport is a read transport without saying so to the type checker.
            transport: Any = self._transport
            if not transport.is_closing():
                transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            transport: Any = self._transport
            if not transport.is_closing():
                transport.resume_reading()

    def _protocol_failure(self, error: RemoteProtocolError) -> None:
        """The peer broke the protocol: log it (once per peer and reason), remember it, abort."""
        self._warnings.warning(
            _source(self._writer),
            reason_kind("protocol", error),
            "closing connection with %s: %s",
            self.peername,
            error,
        )
        self._error = error
        self._transport.abort()

    async def _read(self) -> bytes:
        if self._reader is None:
            raise RuntimeError("this connection hands its payloads to serve_payloads(); it has no reader")
        self._read_started_s = self._loop.time()
        try:
            data = await self._reader.read(self._read_bytes)
        except OSError as e:
            if self._closed:
                raise ClosedResourceError("connection closed") from None
            if self._error is None:
                self._error = BrokenResourceError(f"connection with {self.peername} broken: {e}")
            raise self._error from None
        finally:
            self._read_started_s = None
        if not data:
            if self._closed:
                raise ClosedResourceError("connection closed")
            if self._error is None:
                self._error = BrokenResourceError(f"{self.peername} closed the connection")
            raise self._error
        return data

    async def _idle_watch(self, timeout_s: float) -> None:
        # Closes the connection once the peer sent nothing for timeout_s while we waited for it. Time spent
        # not reading (our handler busy, or pushing back) does not count: the peer cannot be heard then.
        while not self.is_closed:
            started = self._read_started_s
            now = self._loop.time()
            if started is not None and now - started >= timeout_s:
                self._fail(f"no data for {timeout_s:g} s (idle timeout)", "idle")
                return
            await asyncio.sleep(timeout_s if started is None else started + timeout_s - now)

    def _fail(self, reason: str, kind: str) -> None:
        """Abort the connection for a local reason (a bound was hit), logged once per peer and kind."""
        if self.is_closed:
            return
        self._warnings.warning(
            _source(self._writer), kind, "closing connection with %s: %s", self.peername, reason
        )
        self._error = BrokenResourceError(f"connection with {self.peername} closed: {reason}")
        self._transport.abort()

    def send(self, payload: bytes | bytearray | memoryview) -> None:
        """Queue one framed payload for writing (no wait; see :meth:`drain`).

        Raises LocalProtocolError if the payload is empty or larger than ``max_frame_bytes``,
        ClosedResourceError after :meth:`aclose`, BrokenResourceError if the connection is gone.
        """
        if self._closed or self._error is not None or self._transport.is_closing():
            self._check_writable()  # Raises the error that says why.
        n = len(payload)
        if not 0 < n <= self._max_payload_bytes:
            self._proto.frame(payload)  # Raises the LocalProtocolError that says why.
        # Framed here, not by ProtocolConnection.frame: the header is looked up, and the payload is copied
        # once, into the coalescing buffer (frame() built header + payload, copied again into the buffer).
        header = self._headers.get(n) or self._header(n)
        if n >= _COALESCE_MAX_BYTES:
            # A large frame (a range read's run) is written as it is, after the frames queued before it:
            # copying megabytes into the coalescing buffer cost more than the write (a fresh buffer that
            # size page-faults all the way).
            self._flush_out()
            self._transport.write(header + payload)
            self._last_write_s = self._loop.time()
            return
        out = self._out
        if out is None:
            # The first frame of this loop iteration: every frame sent until the loop runs its callbacks joins
            # it, and they leave in one socket write. One write per frame was the largest cost of the server
            # (feeds, storage requests) and the storage node (responses) under load. The keep-alive clock is
            # read here only: the frames that join this one leave in the same write.
            out = self._out = bytearray(header)
            out += payload
            if not self._dispatching:  # else _data_received writes it when its handler returns
                self._loop.call_soon(self._flush_out)
            self._last_write_s = self._loop.time()
        else:
            out += header
            out += payload
            if len(out) >= _COALESCE_MAX_BYTES:
                self._flush_out()

    def _header(self, n: int) -> bytes:
        """The frame header of an ``n``-byte payload, remembered for the next one of that size (messages of
        one kind mostly have one size); at most ``_HEADER_CACHE_SIZE`` sizes are remembered."""
        header = self._proto.frame_header(n)
        if len(self._headers) < _HEADER_CACHE_SIZE:
            self._headers[n] = header
        return header

    def send_parts(self, head: bytes, body: bytes | bytearray | memoryview) -> None:
        """:meth:`send` of the payload ``head + body``, written as two pieces after the frames queued before
        it, never joined: for a large body (a range read's record run, megabytes) that the transport can
        write from where it is. Joining copied the whole body twice per response (the payload, then the
        frame), each into a fresh buffer that page-faults all the way: the largest CPU cost of a storage node
        serving a bulk read, and a third of the server's relaying one. Raises as :meth:`send`."""
        if self._closed or self._error is not None or self._writer.is_closing():
            self._check_writable()  # Raises the error that says why.
        header = self._proto.frame_header(len(head) + len(body))
        self._flush_out()
        self._writer.writelines((header + head, body))
        self._last_write_s = self._loop.time()

    def send_now(self, payload: bytes | bytearray | memoryview) -> None:
        """:meth:`send`, handed to the transport at once instead of at the end of the loop iteration (after
        the frames queued before it, in one write): for a lone message that nothing would join, such as a
        client's one append at a time, which then leaves one loop pass sooner and schedules no flush."""
        if self._closed or self._error is not None or self._transport.is_closing():
            self._check_writable()  # Raises the error that says why.
        n = len(payload)
        if not 0 < n <= self._max_payload_bytes:
            self._proto.frame(payload)  # Raises the LocalProtocolError that says why.
        header = self._headers.get(n) or self._header(n)
        out = self._out
        if out is None:
            self._transport.write(header + payload)
        else:
            # Frames queued earlier in this iteration go first; their scheduled flush then finds nothing.
            self._out = None
            out += header
            out += payload
            self._transport.write(out)
        self._last_write_s = self._loop.time()

    def send_many(self, payloads: Iterable[bytes | bytearray | memoryview]) -> None:
        """:meth:`send` of each of ``payloads``, in order (checked once: for many small frames at a time)."""
        self._check_writable()
        frames = self._proto.frame_many(payloads)
        out = self._out
        if out is None:
            out = self._out = bytearray()
            if not self._dispatching:
                self._loop.call_soon(self._flush_out)
        out += frames
        if len(out) >= _COALESCE_MAX_BYTES:
            self._flush_out()
        self._last_write_s = self._loop.time()

    def send_framed(self, frames: bytes) -> None:
        """Write ``frames``: whole frames the caller framed itself, with this connection's magic and
        negotiated version and each within ``max_frame_bytes`` (unchecked here), after the frames queued
        before them. For a sender that encodes its frames' headers and payloads in one pass (the client's
        appends): :meth:`send_many` would frame and copy them once more. Handed to the transport at once
        unless frames of this iteration are queued (then they join them). Raises as :meth:`send`."""
        if self._closed or self._error is not None or self._transport.is_closing():
            self._check_writable()  # Raises the error that says why.
        out = self._out
        if out is None:
            self._transport.write(frames)
        else:
            out += frames
            if len(out) >= _COALESCE_MAX_BYTES:
                self._flush_out()
        self._last_write_s = self._loop.time()

    def _flush_out(self) -> None:
        """Hand the frames queued in this loop iteration to the transport, in order."""
        out, self._out = self._out, None
        if out and not self._transport.is_closing():
            self._transport.write(out)

    @property
    def drain_needed(self) -> bool:
        """True if more is unsent than the accepting side's high-water mark (see :func:`serve`), i.e. if
        :meth:`drain` may have to wait; always True on a connecting side. A handler answering many small
        requests skips the drain coroutine per request with it."""
        return self._pause_reading_above_bytes is None or self._write_backlogged()

    async def drain(self) -> None:
        """Wait until the write buffer is below its high-water mark (back pressure)."""
        self._check_writable()
        self._flush_out()  # so the transport's buffer accounts for everything sent so far
        try:
            timeout_s = self._idle_timeout_s
            high = self._pause_reading_above_bytes
            if timeout_s is None or high is None or self._transport.get_write_buffer_size() <= high:
                await self._writer.drain()
            else:
                # The peer is not reading: give it the idle timeout to start again, then let it go.
                try:
                    async with asyncio.timeout(timeout_s):
                        await self._writer.drain()
                except TimeoutError:
                    self._fail(f"read none of our data for {timeout_s:g} s (idle timeout)", "stalled")
                    raise BrokenResourceError(f"{self.peername} does not read") from None
        except OSError as e:
            if self._closed:
                raise ClosedResourceError("connection closed") from None
            raise BrokenResourceError(f"connection with {self.peername} broken: {e}") from None

    async def send_and_drain(self, payload: bytes | bytearray | memoryview) -> None:
        """:meth:`send` then :meth:`drain`."""
        self.send(payload)
        await self.drain()

    def _check_writable(self) -> None:
        if self._closed:
            raise ClosedResourceError("connection closed")
        if self._error is not None:
            raise BrokenResourceError(f"connection with {self.peername} is gone: {self._error}")
        if self._transport.is_closing():
            raise BrokenResourceError(f"connection with {self.peername} is closing")

    async def _keep_alive_loop(self, interval_s: float) -> None:
        # Emits a keep-alive whenever nothing was written for interval_s; ends when the connection does.
        while not self._closed and self._error is None and not self._transport.is_closing():
            idle_s = self._loop.time() - self._last_write_s
            if idle_s >= interval_s:
                self._flush_out()
                self._transport.write(self._proto.keep_alive())
                self._last_write_s = self._loop.time()
                idle_s = 0.0
            await asyncio.sleep(interval_s - idle_s)

    async def aclose(self) -> None:
        """Close the connection (idempotent). Queued frames are flushed if the peer still reads."""
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            self._flush_out()  # frames sent just before closing still leave, as a plain write() would
        # Release the socket and stop the keep-alives before the first await: if this task is cancelled while
        # waiting below, nothing is left open.
        close = _close_writer(self._writer, abort=self._error is not None)
        tasks = [t for t in (self._keep_alive_task, self._idle_task) if t is not None]
        self._keep_alive_task = self._idle_task = None
        for task in tasks:
            task.cancel()
        try:
            if tasks:
                # wait() does not re-raise the task's CancelledError, but does propagate our own cancellation.
                await asyncio.wait(tasks)
        finally:
            await close

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


async def open_connection(
    host: str,
    port: int,
    *,
    magic: int,
    versions: Iterable[int],
    hello_text: str,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS,
    keep_alive_interval_s: float | None = DEFAULT_KEEP_ALIVE_INTERVAL_S,
    read_bytes: int = DEFAULT_READ_BYTES,
    write_buffer_high_bytes: int = DEFAULT_WRITE_BUFFER_HIGH_BYTES,
    ssl: ssl_.SSLContext | None = None,
    callback_reads: bool = False,
) -> FramedConnection:
    """Connect and exchange hellos, all within ``connect_timeout_ms``.

    Raises BrokenResourceError if the connection cannot be made, is lost or times out (all retriable), and
    RemoteProtocolError if the peer's hello is malformed or shares no version with ``versions``. Nothing is
    left open on failure.

    With ``ssl`` the TLS handshake is part of the connect (and of its time limit); the peer's certificate is
    checked against ``host`` when the context checks hostnames. A failed handshake (untrusted certificate, a
    plain peer) is a BrokenResourceError whose message says so.

    With ``callback_reads`` the bytes the peer sends go straight from the transport's callback to the frame
    decoder (no StreamReader), and the payloads to the receiver given to
    :meth:`FramedConnection.deliver_payloads` (``receive`` and its kin are not available): for a reader that
    must not cost a task wake-up per read, such as :class:`RpcClient` on the server's storage connections.
    The hello exchange, its errors and the time limit are the same.
    """
    proto = ProtocolConnection(magic, versions, hello_text, max_frame_bytes)
    writer: asyncio.StreamWriter | None = None
    reader: asyncio.StreamReader | None = None
    pushed: _CallbackStreamProtocol | None = None
    hello_refused = False
    try:
        async with asyncio.timeout(connect_timeout_ms / 1000):
            if callback_reads:
                loop = asyncio.get_running_loop()
                _, pushed = await loop.create_connection(
                    lambda: _CallbackStreamProtocol(None, proto, loop), host, port, ssl=ssl
                )
                writer = pushed.writer
                assert writer is not None  # set by connection_made, before create_connection returns
            else:
                reader, writer = await asyncio.open_connection(host, port, limit=read_bytes, ssl=ssl)
            _configure_socket(writer, write_buffer_high_bytes)
            try:
                if pushed is None:
                    assert reader is not None
                    await _exchange_hellos(reader, writer, proto, read_bytes)
                else:
                    writer.write(proto.send_hello())
                    await asyncio.shield(pushed.hello)
            except BrokenResourceError:
                hello_refused = True
                raise
    except BaseException as e:
        if writer is not None:
            await _close_writer(writer, abort=True)
        if hello_refused and ssl is None and await _speaks_tls(host, port):
            # Retrying cannot help, and the caller's time limit would turn this into a vague timeout.
            raise ConfigError(
                f"{host}:{port} wants TLS and this side has no TLS settings: give it the ssl.* keys "
                "(client.ssl.* for a client) with a CA that trusts the server"
            ) from None
        if isinstance(e, TimeoutError):
            raise BrokenResourceError(
                f"connecting to {host}:{port} timed out after {connect_timeout_ms} ms"
            ) from None
        if isinstance(e, ssl_.SSLCertVerificationError):
            raise BrokenResourceError(
                f"TLS: the certificate of {host}:{port} is not trusted: {e.verify_message or e}"
            ) from None
        if isinstance(e, ssl_.SSLError):
            raise BrokenResourceError(
                f"TLS handshake with {host}:{port} failed: {_ssl_reason(e)} (does the peer serve TLS?)"
            ) from None
        if isinstance(e, OSError):
            raise BrokenResourceError(f"cannot connect to {host}:{port}: {e}") from None
        raise
    conn = FramedConnection(
        reader, writer, proto, read_bytes=read_bytes, keep_alive_interval_s=keep_alive_interval_s
    )
    if pushed is not None:
        # The protocol paused reading at the hello; deliver_payloads resumes it.
        conn._reading_paused = True
        pushed.conn = conn
        if pushed.ended is not None:
            conn._connection_ended(pushed.ended[0])
    return conn


TLS_PROBE_TIMEOUT_S = 2.0


async def _speaks_tls(host: str, port: int) -> bool:
    """Whether ``host:port`` completes a TLS handshake (certificates unchecked: only the question "does it
    speak TLS" is asked, and nothing is sent over the result). Asked once a plain connection was hung up on
    during the hello exchange, which is what a TLS listener does to a plain client."""
    context = ssl_.SSLContext(ssl_.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl_.CERT_NONE
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(TLS_PROBE_TIMEOUT_S):
            _, writer = await asyncio.open_connection(host, port, ssl=context)
        return True
    except ssl_.SSLError as e:
        # A listener that wants a client certificate may refuse the handshake itself (TLS 1.2): it spoke TLS.
        return "CERTIFICATE" in _ssl_reason(e).upper() or "ALERT" in _ssl_reason(e).upper()
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            await _close_writer(writer, abort=True)


class _CallbackStreamProtocol(asyncio.StreamReaderProtocol):
    """The protocol of a ``callback_reads`` connection (accepted by :func:`serve` or opened by
    :func:`open_connection`): what it receives goes straight to the connection's frame decoder, in the
    transport's callback, instead of through a StreamReader and a task woken per read: the peer's hello first
    (:attr:`hello` resolves), then the payloads, handed to :meth:`FramedConnection.serve_payloads` or
    :meth:`FramedConnection.deliver_payloads`. Writing, write flow control and closing are the stream
    protocol's own, so the connection's StreamWriter (``drain``, ``wait_closed``) works as on any other.
    """

    def __init__(
        self,
        on_connect: Callable[[_CallbackStreamProtocol, asyncio.StreamWriter], None] | None,
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
        self.conn: FramedConnection | None = None
        """Receives the payloads once the serving task built it (after the hello)."""
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

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is not None:
            conn._data_received(data)
            return
        self.proto.receive_data(data)
        hello = self.hello
        if hello.done():
            return  # After the hello (reading is paused): the connection takes it when it serves.
        if self._first and not self._tls and _looks_like_tls(data):
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
            # Nothing more is read until the connection serves (serve_payloads resumes reading): what came
            # with the hello stays buffered in the decoder, bounded by this one read.
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
        elif exc is None:
            self._hello_failed(
                BrokenResourceError(f"peer closed the connection during the hello exchange{_hint(self._tls)}")
            )
        elif isinstance(exc, ssl_.SSLError):
            self._hello_failed(
                BrokenResourceError(
                    f"TLS error during the hello exchange: {_ssl_reason(exc)} (is this side's certificate "
                    "one the peer trusts?)"
                )
            )
        elif isinstance(exc, ConnectionResetError):
            # A listener that refuses the TLS handshake (or a plain connection) may reset rather than close.
            self._hello_failed(
                BrokenResourceError(f"connection broken during the hello exchange: {exc}{_hint(self._tls)}")
            )
        else:
            self._hello_failed(BrokenResourceError(f"connection broken during the hello exchange: {exc}"))

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


ConnectionHandler = Callable[[FramedConnection], Awaitable[None]]


class FramedServer:
    """A listening socket plus the handler tasks of its connections, which it owns.

    Mirrors the parts of :class:`asyncio.Server` callers use (``sockets``, ``close``, ``wait_closed``,
    ``serve_forever``, ``async with``) but :meth:`close` also cancels every connection handler, and
    :meth:`wait_closed` waits for them, so no connection outlives its server. At most ``max_connections``
    connections are served at once, and at most ``max_connections_per_source`` from one source address; more
    are closed right after accept with a WARNING (rate-limited per source).
    """

    def __init__(
        self,
        handler: ConnectionHandler,
        *,
        magic: int,
        versions: Iterable[int],
        hello_text: str,
        max_frame_bytes: int,
        handshake_timeout_ms: int,
        keep_alive_interval_s: float | None,
        read_bytes: int,
        write_buffer_high_bytes: int,
        max_connections: int,
        max_connections_per_source: int = DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
        idle_timeout_s: float | None = None,
        callback_reads: bool = False,
    ) -> None:
        if max_connections_per_source < 1:
            raise ValueError(f"max_connections_per_source must be positive, got {max_connections_per_source}")
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive, got {idle_timeout_s}")
        self._handler = handler
        self._magic = magic
        self._versions = tuple(versions)
        self._hello_text = hello_text
        self._max_frame_bytes = max_frame_bytes
        self._handshake_timeout_ms = handshake_timeout_ms
        self._keep_alive_interval_s = keep_alive_interval_s
        self._read_bytes = read_bytes
        self._write_buffer_high_bytes = write_buffer_high_bytes
        self._max_connections = max_connections
        self._max_connections_per_source = max_connections_per_source
        self._idle_timeout_s = idle_timeout_s
        self.callback_reads = callback_reads
        """Connections hand their payloads to :meth:`FramedConnection.serve_payloads` (see :func:`serve`)."""
        self._per_source: dict[str, int] = {}
        self._warnings = RateLimitedLog(log)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self._closing = False
        # Fail fast, at serve() time, on a configuration the protocol cannot carry.
        ProtocolConnection(magic, self._versions, hello_text, max_frame_bytes)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._server.sockets) if self._server is not None else ()

    @property
    def port(self) -> int:
        """The port of the first listening socket (useful after binding port 0)."""
        return int(self.sockets[0].getsockname()[1])

    @property
    def connection_count(self) -> int:
        """Connections currently being served (including those still exchanging hellos)."""
        return len(self._tasks)

    def is_serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    def close(self) -> None:
        """Stop listening and cancel every connection handler."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()

    async def wait_closed(self) -> None:
        """Wait until the listener and every connection handler have finished."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))
        if self._server is not None:
            await self._server.wait_closed()

    async def aclose(self) -> None:
        self.close()
        await self.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback, so asyncio creates no task of its own: the connection's task is ours, held in
        # self._tasks until it ends, and cancelled by close(). (Python 3.11's stream protocol also mishandles
        # a cancelled callback task, logging a spurious error.)
        task = asyncio.get_running_loop().create_task(
            self._serve_connection(reader, writer), name=f"connection {writer.get_extra_info('peername')}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _protocol(self) -> _CallbackStreamProtocol:
        """A ``callback_reads`` server's protocol factory."""
        proto = ProtocolConnection(self._magic, self._versions, self._hello_text, self._max_frame_bytes)
        return _CallbackStreamProtocol(self._on_connect_pushed, proto, asyncio.get_running_loop())

    def _on_connect_pushed(self, protocol: _CallbackStreamProtocol, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(
            self._serve_connection(None, writer, protocol),
            name=f"connection {writer.get_extra_info('peername')}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_connection(
        self,
        reader: asyncio.StreamReader | None,
        writer: asyncio.StreamWriter,
        pushed: _CallbackStreamProtocol | None = None,
    ) -> None:
        peer = writer.get_extra_info("peername")
        source = _source(writer)
        conn: FramedConnection | None = None
        counted = False
        try:
            if self._closing:
                return  # accepted just before close(): do not start serving it
            if len(self._tasks) > self._max_connections:
                self._warnings.warning(
                    source,
                    "max-connections",
                    "refusing connection from %s: already serving %d connections (max_connections)",
                    peer,
                    self._max_connections,
                )
                return
            from_source = self._per_source.get(source, 0)
            if from_source >= self._max_connections_per_source:
                self._warnings.warning(
                    source,
                    "max-per-source",
                    "refusing connection from %s: %s already holds %d connections (per-source limit)",
                    peer,
                    source,
                    from_source,
                )
                return
            self._per_source[source] = from_source + 1
            counted = True
            _configure_socket(writer, self._write_buffer_high_bytes)
            if pushed is None:
                proto = ProtocolConnection(
                    self._magic, self._versions, self._hello_text, self._max_frame_bytes
                )
            else:
                proto = pushed.proto
            try:
                async with asyncio.timeout(self._handshake_timeout_ms / 1000):
                    if reader is not None:
                        await _exchange_hellos(reader, writer, proto, self._read_bytes)
                    elif pushed is not None:
                        writer.write(proto.send_hello())
                        await asyncio.shield(pushed.hello)
            except TimeoutError:
                self._warnings.warning(
                    source,
                    "hello-timeout",
                    "closing connection from %s: no hello within %d ms",
                    peer,
                    self._handshake_timeout_ms,
                )
                return
            except ProtocolError as e:
                self._warnings.warning(
                    source,
                    reason_kind("hello", e),
                    "closing connection from %s: hello exchange failed: %s",
                    peer,
                    e,
                )
                return
            conn = FramedConnection(
                reader,
                writer,
                proto,
                read_bytes=self._read_bytes,
                keep_alive_interval_s=self._keep_alive_interval_s,
                idle_timeout_s=self._idle_timeout_s,
                write_buffer_high_bytes=self._write_buffer_high_bytes,
                peer_warnings=self._warnings,
            )
            if pushed is not None:
                # The protocol paused reading at the hello; serve_payloads resumes it.
                conn._reading_paused = True
                pushed.conn = conn
                if pushed.ended is not None:
                    conn._connection_ended(pushed.ended[0])
            await self._handler(conn)
        except (ConnectionError_, ProtocolError) as e:
            # Broken connections are routine; protocol errors were logged where they were detected.
            log.debug("connection from %s ended: %s", peer, e)
        except Exception:
            log.exception("connection handler for %s failed", peer)
        finally:
            if counted:
                left = self._per_source[source] - 1
                if left:
                    self._per_source[source] = left
                else:
                    del self._per_source[source]
            if conn is not None:
                await conn.aclose()
            else:
                await _close_writer(writer, abort=True)


async def serve(
    host: str,
    port: int,
    handler: ConnectionHandler,
    *,
    magic: int,
    versions: Iterable[int],
    hello_text: str,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    handshake_timeout_ms: int = DEFAULT_HANDSHAKE_TIMEOUT_MS,
    keep_alive_interval_s: float | None = None,
    read_bytes: int = DEFAULT_READ_BYTES,
    write_buffer_high_bytes: int = DEFAULT_WRITE_BUFFER_HIGH_BYTES,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_connections_per_source: int = DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
    idle_timeout_s: float | None = None,
    ssl: ssl_.SSLContext | None = None,
    callback_reads: bool = False,
) -> FramedServer:
    """Listen on ``host:port`` (port 0 picks a free one) and serve each connection with ``handler``.

    ``handler(conn)`` runs in its own task once the hello exchange succeeded (a peer that sends no valid hello
    within ``handshake_timeout_ms`` is dropped with a WARNING); the connection is closed when the handler
    returns or raises. Broken connections and protocol errors escaping the handler are logged, not raised;
    any other exception is logged with its traceback. The accepting side sends no keep-alives by default,
    as in the original Waltz.

    Bounds per connection: :meth:`FramedConnection.receive` reads nothing from a peer while more than
    ``write_buffer_high_bytes`` of our frames to it are unsent (until they drain), and with ``idle_timeout_s``
    a connection is closed when its peer sent nothing (not even a keep-alive) for that long while we waited to
    read, or when a :meth:`FramedConnection.drain` waited that long for the peer to read. The connecting
    side's keep-alives (every ``DEFAULT_KEEP_ALIVE_INTERVAL_S``) keep a quiet but healthy peer alive, so the
    timeout must be well above that interval.

    With ``ssl`` every connection starts with a TLS handshake, limited to ``handshake_timeout_ms`` like the
    hello exchange that follows it. asyncio runs that handshake before the connection reaches us, and drops
    a failed one silently (logged only in asyncio's debug mode): the connecting side reports what failed.
    (Running the handshake in our own task with ``start_tls`` would let us log it, but on uvloop the stream
    reads the client's first TLS bytes before ``start_tls`` can take over, and the handshake then stalls.)

    With ``callback_reads`` the bytes a connection receives go straight from the transport's callback to its
    frame decoder (no StreamReader), and the handler serves the payloads with
    :meth:`FramedConnection.serve_payloads` (``receive`` and ``receive_many`` are not available): for a peer
    whose every request should be handled in the loop pass that read it. Every bound above holds the same.
    """
    server = FramedServer(
        handler,
        magic=magic,
        versions=versions,
        hello_text=hello_text,
        max_frame_bytes=max_frame_bytes,
        handshake_timeout_ms=handshake_timeout_ms,
        keep_alive_interval_s=keep_alive_interval_s,
        read_bytes=read_bytes,
        write_buffer_high_bytes=write_buffer_high_bytes,
        max_connections=max_connections,
        max_connections_per_source=max_connections_per_source,
        idle_timeout_s=idle_timeout_s,
        callback_reads=callback_reads,
    )
    ssl_handshake_timeout_s = handshake_timeout_ms / 1000 if ssl is not None else None
    if callback_reads:
        server._server = await asyncio.get_running_loop().create_server(
            server._protocol, host, port, ssl=ssl, ssl_handshake_timeout=ssl_handshake_timeout_s
        )
    else:
        server._server = await asyncio.start_server(
            server._on_connect,
            host,
            port,
            limit=read_bytes,
            ssl=ssl,
            ssl_handshake_timeout=ssl_handshake_timeout_s,
        )
    return server


class RpcClient(Generic[ReqT, RespT]):
    """Concurrent request/response calls over one :class:`FramedConnection`, matched by sequence number.

    Guarantees:

    * At most ``max_in_flight`` requests are outstanding; further callers wait (within their timeout).
    * Every call ends: with its response, with :class:`~waltz.errors.ClientTimeoutError` after
      ``timeout_ms`` (a late response is then dropped), with the error ``error_of(response)`` returns, or with
      :class:`~waltz.errors.BrokenResourceError` for every pending and later call once the connection dies.
    * Responses are read by the client from its construction on (which therefore must run in the event
      loop): on a connection of ``open_connection(..., callback_reads=True)`` from the transport's data
      callback (:meth:`FramedConnection.deliver_payloads`), each response resolving its caller's future in
      the loop pass that read it; on any other connection by a reader task of the client's. A response that
      cannot be decoded fails every pending and later call and closes the connection (logged at WARNING);
      :meth:`aclose` stops the reading and closes the connection.

    The caller chooses sequence numbers (see :meth:`next_seq`); two requests with the same number may not be
    in flight at once. ``encode`` returns a request's payload, or its ``(head, body)`` parts: one frame whose
    body is written after the head without being joined to it (:meth:`FramedConnection.send_parts`), for a
    large body sent as it is (a server's batch of records, the same bytes for every replica).
    """

    def __init__(
        self,
        conn: FramedConnection,
        *,
        encode: Callable[[ReqT], bytes | tuple[bytes, bytes]],
        decode: Callable[[bytes], RespT],
        request_seq: Callable[[ReqT], int],
        response_seq: Callable[[RespT], int],
        error_of: Callable[[RespT], BaseException | None] | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        name: str = "rpc",
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self._conn = conn
        self._encode = encode
        self._decode = decode
        self._request_seq = request_seq
        self._response_seq = response_seq
        self._error_of = error_of
        self._name = name
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._pending: dict[int, asyncio.Future[RespT]] = {}
        self._on_answer: dict[int, Callable[[asyncio.Future[RespT]], None]] = {}
        """The ``on_answer`` of the start_call requests in :attr:`_pending` that have one."""
        self._seq = 0
        self._closed = False
        self._broken: str | None = None
        self._reader_task: asyncio.Task[None] | None = None
        if conn._reader is None:
            # Responses delivered from the transport's callback: no task wakes up per read (a storage node's
            # every answer to the server used to cost one wake-up of the reader task and its loop passes).
            conn.deliver_payloads(self._on_payloads, self._on_end)
        else:
            self._reader_task = self._loop.create_task(
                self._read_loop(), name=f"{name} reader {conn.peername}"
            )

    @property
    def connection(self) -> FramedConnection:
        return self._conn

    @property
    def in_flight(self) -> int:
        """Requests sent (or being sent) and not yet answered."""
        return len(self._pending)

    @property
    def is_usable(self) -> bool:
        """False once the client was closed or its connection died."""
        return not self._closed and self._broken is None

    def next_seq(self) -> int:
        """A fresh per-client sequence number (0, 1, 2, ...)."""
        seq = self._seq
        self._seq += 1
        return seq

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedResourceError(f"{self._name} client closed")
        if self._broken is not None:
            raise BrokenResourceError(self._broken)

    async def call(self, request: ReqT, timeout_ms: int) -> RespT:
        """Send ``request`` and return its response (see the class docstring for how a call can end)."""
        self._check_usable()
        try:
            async with asyncio.timeout(timeout_ms / 1000), self._slots:
                self._check_usable()
                return await self._call_with_slot(request)
        except TimeoutError:
            raise ClientTimeoutError(
                f"{self._name}: no response from {self._conn.peername} within {timeout_ms} ms"
                f" to {type(request).__name__}"
            ) from None

    def start_call(
        self, request: ReqT, on_answer: Callable[[asyncio.Future[RespT]], None] | None = None
    ) -> asyncio.Future[RespT]:
        """Send ``request`` now and return the future of its response, for a caller that bounds its requests
        in flight and their time itself (no slot, no timeout, no task): the replica sessions of the server,
        whose requests then leave in the iteration that formed them instead of one task start later. With
        nothing else in flight on the connection the request is handed to the transport at once
        (:meth:`FramedConnection.send_now`); otherwise it joins the iteration's write.

        The future fails with the response's error (``error_of``) or as :meth:`call` would on a lost
        connection; cancelling it forgets the request (a late response is dropped). ``on_answer``, if given,
        is called with the future once the response or the connection's end resolved it, in the callback
        that did (a done callback runs a loop pass later: one more pass per answer of a replica), and not
        if the caller cancelled it first; an exception from it is logged."""
        self._check_usable()
        seq = self._request_seq(request)
        if seq in self._pending:
            raise LocalProtocolError(f"{self._name}: sequence number {seq} is already in flight")
        payload = self._encode(request)
        future: asyncio.Future[RespT] = self._loop.create_future()
        pending = self._pending
        if isinstance(payload, tuple):
            # A large body (a batch of records, the same bytes for every replica) written from where it is.
            self._conn.send_parts(*payload)
        elif pending:
            self._conn.send(payload)  # Joins this iteration's write (requests pipelined on a busy peer).
        else:
            # Nothing in flight to this peer (a lone append's replica request): written now rather than one
            # loop iteration later, with nothing to coalesce it with yet.
            self._conn.send_now(payload)
        pending[seq] = future
        if on_answer is not None:
            self._on_answer[seq] = on_answer
        return future

    async def _call_with_slot(self, request: ReqT) -> RespT:
        seq = self._request_seq(request)
        if seq in self._pending:
            raise LocalProtocolError(f"{self._name}: sequence number {seq} is already in flight")
        payload = self._encode(request)
        future: asyncio.Future[RespT] = self._loop.create_future()
        self._pending[seq] = future
        try:
            if isinstance(payload, tuple):
                self._conn.send_parts(*payload)
            else:
                self._conn.send(payload)
            await self._conn.drain()
            response = await future
        finally:
            if self._pending.get(seq) is future:
                del self._pending[seq]
            if future.done() and not future.cancelled():
                # Mark a failure set while we were being cancelled as seen, so it is not logged at GC.
                future.exception()
        return response  # a failure response raised above: the reader makes it the future's exception

    async def _read_loop(self) -> None:
        reason: BaseException
        conn = self._conn
        payloads: list[bytes] = []
        try:
            while True:
                # Every whole response of one socket read in one go: one coroutine per read, not per response.
                await conn.receive_many(payloads)
                for payload in payloads:
                    self._deliver(self._decode(payload))
                payloads.clear()
        except (ConnectionError_, ProtocolError) as e:
            reason = e
        except Exception as e:
            log.exception("%s: reader for %s failed", self._name, self._conn.peername)
            reason = e
        if not self._closed:
            self._broken = f"{self._name}: connection with {self._conn.peername} lost: {reason}"
            self._fail_pending(lambda: BrokenResourceError(self._broken))
            await self._conn.aclose()

    def _on_payloads(self, payloads: list[bytes]) -> None:
        """The responses of one socket read, from the transport's callback (see the constructor)."""
        decode = self._decode
        deliver = self._deliver
        try:
            for payload in payloads:
                deliver(decode(payload))
        except RemoteProtocolError as e:
            # Garbage inside a well-formed frame: the peer's fault, logged (rate-limited) like bad framing.
            self._conn._protocol_failure(e)
            self._lost(e)
        except Exception as e:
            log.exception("%s: reading a response from %s failed", self._name, self._conn.peername)
            self._lost(e)

    def _on_end(self, reason: BaseException) -> None:
        """The connection ended (told once, from a callback: see FramedConnection.deliver_payloads)."""
        self._lost(reason)

    def _lost(self, reason: BaseException) -> None:
        """Fail every pending and later call with ``reason`` and end the connection at once (no await: from
        a callback); :meth:`aclose` still releases it. Nothing to do after our own :meth:`aclose`."""
        if self._closed or self._broken is not None:
            return
        self._broken = f"{self._name}: connection with {self._conn.peername} lost: {reason}"
        self._fail_pending(lambda: BrokenResourceError(self._broken))
        self._conn._abort(BrokenResourceError(self._broken))

    def _deliver(self, response: RespT) -> None:
        seq = self._response_seq(response)
        # Popped here, so a start_call request is forgotten once answered (a call's own cleanup finds it
        # gone, which it allows for).
        future = self._pending.pop(seq, None)
        on_answer = self._on_answer.pop(seq, None) if self._on_answer else None
        if future is None or future.done():
            # Normal after a caller timed out or was cancelled.
            log.debug(
                "%s: dropping response %d from %s: no caller waits", self._name, seq, self._conn.peername
            )
            return
        error = self._error_of(response) if self._error_of is not None else None
        if error is None:
            future.set_result(response)
        else:
            future.set_exception(error)
        if on_answer is not None:
            self._answered(on_answer, future)

    def _answered(
        self, on_answer: Callable[[asyncio.Future[RespT]], None], future: asyncio.Future[RespT]
    ) -> None:
        try:
            on_answer(future)
        except Exception:
            log.exception(
                "%s: the answer callback of a request to %s failed", self._name, self._conn.peername
            )

    def _fail_pending(self, make_error: Callable[[], BaseException]) -> None:
        # A list: an answer callback may start another call (which fails at once: the client is unusable).
        for seq, future in list(self._pending.items()):
            if not future.done():
                future.set_exception(make_error())
                on_answer = self._on_answer.pop(seq, None)
                if on_answer is not None:
                    self._answered(on_answer, future)
        self._on_answer.clear()

    async def aclose(self) -> None:
        """Stop the reader, fail pending calls with ClosedResourceError, close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.wait([self._reader_task])
        self._fail_pending(lambda: ClosedResourceError(f"{self._name} client closed"))
        await self._conn.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def run(main: Coroutine[Any, Any, T]) -> T:
    """For entry points only: run ``main`` on uvloop when it is installed, else on the default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A private event loop for a thread of its own (the sync client's, the Spark source's I/O loop): uvloop
    when it is installed (its socket reads, futures and ``call_soon_threadsafe``, which every request from
    another thread crosses, cost less than asyncio's), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


GC_THRESHOLDS = (50_000, 20, 100)
"""Collector thresholds of long-running nodes (CPython's defaults are ``(700, 10, 10)``)."""


def tune_gc() -> None:
    """For servers, once started: fewer, cheaper garbage collections.

    A node allocates a handful of container objects per message (tuples, futures, records) that almost all
    die young, while its caches keep hundreds of thousands alive; with the default thresholds the young
    generation is collected every 700 allocations and full collections walk every cached object. Freezing
    what start-up built moves it out of the collector's sight, and higher thresholds collect in larger,
    rarer steps; reference counting still frees the garbage that has no cycles, which is nearly all of it.
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
"""glibc's largest mmap threshold on 64-bit: a record run (at most one frame, ~5.5 MB for 10,000 records of
512 bytes) and the buffers it is received into come from the heap below it."""
TRIM_THRESHOLD_BYTES = 128 * 1024 * 1024
"""Free heap a process keeps mapped for its next large buffers instead of giving it back to the system."""


def tune_malloc() -> bool:
    """For processes that move record runs (servers, storage nodes, reused Spark workers), once started: keep
    large buffers in memory that stays mapped. Returns whether the allocator is glibc's and was tuned.

    With glibc's defaults a buffer of a few megabytes (a range read's record run, received, joined, sent) is
    mapped afresh and unmapped when freed, so every page of every run is faulted in and zeroed by the kernel:
    one fault per 4 KiB moved, 0.1-0.2 faults per 512-byte record on the server and on the storage node.
    Blocks up to 32 MiB now come from the heap, and up to 128 MiB of free heap stay mapped for the next runs:
    the process keeps what its largest burst of reads needed (a few runs per reader) instead of returning it
    between runs. Elsewhere (not glibc) nothing changes."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    return True


async def wait_for_stop_signal() -> None:
    """Return on SIGTERM or SIGINT (the way ``waltz storage run`` and ``waltz server run`` are stopped)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
