"""The accepting side: :func:`serve` listens and runs ``handler(conn)`` for each connection once its hello
exchange completed. The returned :class:`FramedServer` owns those handler tasks: closing it cancels them and
closes their sockets.

The accepting side bounds what one peer can hold: at most ``max_connections`` in all and
``max_connections_per_source`` per source address; a connection whose peer sends nothing (not even a
keep-alive) for ``idle_timeout_s``, or reads none of our bytes for that long while our write buffer is full,
is closed; and it stops reading from a peer whose responses are piling up unsent (above the write buffer's
high-water mark) until they drain, so a peer that sends requests and never reads the answers is pushed back by
TCP instead of growing our memory.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as ssl_
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, Self

from waltz.errors import ConnectionError_, ProtocolError
from waltz.protocol.framing import DEFAULT_MAX_FRAME_BYTES, ProtocolConnection
from waltz.transport.connection import FramedConnection
from waltz.transport.hello import FrameProtocol, close_writer, configure_socket, source_of
from waltz.transport.limits import (
    DEFAULT_HANDSHAKE_TIMEOUT_MS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
    DEFAULT_WRITE_BUFFER_HIGH_BYTES,
    RateLimitedLog,
    reason_kind,
)

__all__ = ["ConnectionHandler", "FramedServer", "serve"]

log = logging.getLogger("waltz.transport")

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
        write_buffer_high_bytes: int,
        max_connections: int,
        max_connections_per_source: int = DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
        idle_timeout_s: float | None = None,
    ) -> None:
        if max_connections_per_source < 1:
            raise ValueError(f"max_connections_per_source must be positive, got {max_connections_per_source}")
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive, got {idle_timeout_s}")
        self._handler = handler
        self._hello = (magic, tuple(versions), hello_text, max_frame_bytes)
        self._handshake_timeout_ms = handshake_timeout_ms
        self._keep_alive_interval_s = keep_alive_interval_s
        self._write_buffer_high_bytes = write_buffer_high_bytes
        self._max_connections = max_connections
        self._max_connections_per_source = max_connections_per_source
        self._idle_timeout_s = idle_timeout_s
        self._per_source: dict[str, int] = {}
        self._warnings = RateLimitedLog(log)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self._closing = False
        # Fail fast, at serve() time, on a configuration the protocol cannot carry.
        ProtocolConnection(*self._hello)

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

    def _protocol(self) -> FrameProtocol:
        """The protocol factory of the listener."""
        proto = ProtocolConnection(*self._hello)
        return FrameProtocol(self._on_connect, proto, asyncio.get_running_loop())

    def _on_connect(self, protocol: FrameProtocol, writer: asyncio.StreamWriter) -> None:
        # The connection's task is ours, held in self._tasks until it ends, and cancelled by close().
        task = asyncio.get_running_loop().create_task(
            self._serve_connection(writer, protocol), name=f"connection {writer.get_extra_info('peername')}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _admit(self, peer: object, source: str) -> bool:
        """Count a new connection from ``source`` against the limits; False (logged) if it is refused."""
        if self._closing:
            return False  # accepted just before close(): do not start serving it
        if len(self._tasks) > self._max_connections:
            self._warnings.warning(
                source,
                "max-connections",
                "refusing connection from %s: already serving %d connections (max_connections)",
                peer,
                self._max_connections,
            )
            return False
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
            return False
        self._per_source[source] = from_source + 1
        return True

    def _release(self, source: str) -> None:
        left = self._per_source[source] - 1
        if left:
            self._per_source[source] = left
        else:
            del self._per_source[source]

    async def _exchange_hellos(
        self, writer: asyncio.StreamWriter, protocol: FrameProtocol, peer: object
    ) -> bool:
        """Send our hello and wait for the peer's; False (logged) if it did not come in time or was bad."""
        source = source_of(writer)
        try:
            async with asyncio.timeout(self._handshake_timeout_ms / 1000):
                writer.write(protocol.proto.send_hello())
                await asyncio.shield(protocol.hello)
        except TimeoutError:
            self._warnings.warning(
                source,
                "hello-timeout",
                "closing connection from %s: no hello within %d ms",
                peer,
                self._handshake_timeout_ms,
            )
            return False
        except ProtocolError as e:
            self._warnings.warning(
                source,
                reason_kind("hello", e),
                "closing connection from %s: hello exchange failed: %s",
                peer,
                e,
            )
            return False
        return True

    async def _serve_connection(self, writer: asyncio.StreamWriter, protocol: FrameProtocol) -> None:
        peer = writer.get_extra_info("peername")
        source = source_of(writer)
        conn: FramedConnection | None = None
        if not self._admit(peer, source):
            await close_writer(writer, abort=True)
            return
        try:
            configure_socket(writer, self._write_buffer_high_bytes)
            if not await self._exchange_hellos(writer, protocol, peer):
                return
            conn = FramedConnection(
                writer,
                protocol.proto,
                keep_alive_interval_s=self._keep_alive_interval_s,
                idle_timeout_s=self._idle_timeout_s,
                write_buffer_high_bytes=self._write_buffer_high_bytes,
                peer_log=self._warnings,
            )
            protocol.attach(conn)
            await self._handler(conn)
        except (ConnectionError_, ProtocolError) as e:
            # Broken connections are routine; protocol errors were logged where they were detected.
            log.debug("connection from %s ended: %s", peer, e)
        except Exception:
            log.exception("connection handler for %s failed", peer)
        finally:
            self._release(source)
            if conn is not None:
                await conn.aclose()
            else:
                await close_writer(writer, abort=True)


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
    write_buffer_high_bytes: int = DEFAULT_WRITE_BUFFER_HIGH_BYTES,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_connections_per_source: int = DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
    idle_timeout_s: float | None = None,
    ssl: ssl_.SSLContext | None = None,
) -> FramedServer:
    """Listen on ``host:port`` (port 0 picks a free one) and serve each connection with ``handler``.

    ``handler(conn)`` runs in its own task once the hello exchange succeeded (a peer that sends no valid hello
    within ``handshake_timeout_ms`` is dropped with a WARNING); the connection is closed when the handler
    returns or raises. Broken connections and protocol errors escaping the handler are logged, not raised;
    any other exception is logged with its traceback. The accepting side sends no keep-alives by default,
    as in the original Waltz. A handler on a hot path reads with :meth:`FramedConnection.serve_payloads`.

    Bounds per connection: nothing is read from a peer while more than ``write_buffer_high_bytes`` of our
    frames to it are unsent (until they drain), and with ``idle_timeout_s`` a connection is closed when its
    peer sent nothing (not even a keep-alive) for that long while we waited to read, or when a
    :meth:`FramedConnection.drain` waited that long for the peer to read. The connecting side's keep-alives
    (every ``DEFAULT_KEEP_ALIVE_INTERVAL_S``) keep a quiet but healthy peer alive, so the timeout must be
    well above that interval.

    With ``ssl`` every connection starts with a TLS handshake, limited to ``handshake_timeout_ms`` like the
    hello exchange that follows it. asyncio runs that handshake before the connection reaches us, and drops
    a failed one silently (logged only in asyncio's debug mode): the connecting side reports what failed.
    """
    server = FramedServer(
        handler,
        magic=magic,
        versions=versions,
        hello_text=hello_text,
        max_frame_bytes=max_frame_bytes,
        handshake_timeout_ms=handshake_timeout_ms,
        keep_alive_interval_s=keep_alive_interval_s,
        write_buffer_high_bytes=write_buffer_high_bytes,
        max_connections=max_connections,
        max_connections_per_source=max_connections_per_source,
        idle_timeout_s=idle_timeout_s,
    )
    ssl_handshake_timeout_s = handshake_timeout_ms / 1000 if ssl is not None else None
    server._server = await asyncio.get_running_loop().create_server(
        server._protocol, host, port, ssl=ssl, ssl_handshake_timeout=ssl_handshake_timeout_s
    )
    return server
