"""The connecting side: :func:`open_connection` connects, exchanges hellos within ``connect_timeout_ms`` and
returns a :class:`~waltz.transport.connection.FramedConnection`, which sends a keep-alive after
``keep_alive_interval_s`` without writes (as the original Waltz did), so idle connections survive
middleboxes and a dead peer is noticed."""

from __future__ import annotations

import asyncio
import ssl as ssl_
from collections.abc import Iterable
from typing import Final

from waltz.errors import BrokenResourceError, ConfigError
from waltz.protocol.framing import DEFAULT_MAX_FRAME_BYTES, ProtocolConnection
from waltz.transport.connection import FramedConnection
from waltz.transport.hello import FrameProtocol, close_writer, configure_socket, ssl_reason
from waltz.transport.limits import (
    DEFAULT_CONNECT_TIMEOUT_MS,
    DEFAULT_KEEP_ALIVE_INTERVAL_S,
    DEFAULT_WRITE_BUFFER_HIGH_BYTES,
)

__all__ = ["TLS_PROBE_TIMEOUT_S", "open_connection"]

TLS_PROBE_TIMEOUT_S: Final = 2.0


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
    write_buffer_high_bytes: int = DEFAULT_WRITE_BUFFER_HIGH_BYTES,
    ssl: ssl_.SSLContext | None = None,
) -> FramedConnection:
    """Connect and exchange hellos, all within ``connect_timeout_ms``.

    Raises BrokenResourceError if the connection cannot be made, is lost or times out (all retriable), and
    RemoteProtocolError if the peer's hello is malformed or shares no version with ``versions``. Nothing is
    left open on failure.

    With ``ssl`` the TLS handshake is part of the connect (and of its time limit); the peer's certificate is
    checked against ``host`` when the context checks hostnames. A failed handshake (untrusted certificate, a
    plain peer) is a BrokenResourceError whose message says so; a plain connection to a TLS listener is a
    ConfigError (retrying cannot help).
    """
    proto = ProtocolConnection(magic, versions, hello_text, max_frame_bytes)
    loop = asyncio.get_running_loop()
    protocol: FrameProtocol | None = None
    hello_refused = False
    try:
        async with asyncio.timeout(connect_timeout_ms / 1000):
            _, protocol = await loop.create_connection(
                lambda: FrameProtocol(None, proto, loop), host, port, ssl=ssl
            )
            writer = protocol.writer
            assert writer is not None  # set by connection_made, before create_connection returns
            configure_socket(writer, write_buffer_high_bytes)
            try:
                writer.write(proto.send_hello())
                await asyncio.shield(protocol.hello)
            except BrokenResourceError:
                hello_refused = True
                raise
    except BaseException as e:
        if protocol is not None and protocol.writer is not None:
            await close_writer(protocol.writer, abort=True)
        if hello_refused and ssl is None and await _speaks_tls(host, port):
            # Retrying cannot help, and the caller's time limit would turn this into a vague timeout.
            raise ConfigError(
                f"{host}:{port} wants TLS and this side has no TLS settings: give it the ssl.* keys "
                "(client.ssl.* for a client) with a CA that trusts the server"
            ) from None
        error = _connect_error(e, host, port, connect_timeout_ms)
        if error is None:
            raise
        raise error from None
    conn = FramedConnection(writer, proto, keep_alive_interval_s=keep_alive_interval_s)
    protocol.attach(conn)
    return conn


def _connect_error(e: BaseException, host: str, port: int, connect_timeout_ms: int) -> Exception | None:
    """What a failed connect raises: a BrokenResourceError that says why, or None for ``e`` itself."""
    if isinstance(e, TimeoutError):
        return BrokenResourceError(f"connecting to {host}:{port} timed out after {connect_timeout_ms} ms")
    if isinstance(e, ssl_.SSLCertVerificationError):
        return BrokenResourceError(
            f"TLS: the certificate of {host}:{port} is not trusted: {e.verify_message or e}"
        )
    if isinstance(e, ssl_.SSLError):
        return BrokenResourceError(
            f"TLS handshake with {host}:{port} failed: {ssl_reason(e)} (does the peer serve TLS?)"
        )
    if isinstance(e, OSError):
        return BrokenResourceError(f"cannot connect to {host}:{port}: {e}")
    return None


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
        return "CERTIFICATE" in ssl_reason(e).upper() or "ALERT" in ssl_reason(e).upper()
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            await close_writer(writer, abort=True)
