"""The thin asyncio layer under every Waltz connection: framed connections, a server, an RPC multiplexer.

All protocol decisions live in :mod:`waltz.protocol.framing`; this package only moves bytes between sockets
and a :class:`~waltz.protocol.framing.ProtocolConnection`. Where to read:

==============  ==========================================================================================
``hello``       the asyncio protocol of every connection: the hello exchange, then each read straight to
                the connection from the transport's data callback (the one read path)
``connection``  :class:`FramedConnection`: the receivers of each read's payloads (``deliver_payloads``,
                ``serve_payloads``, ``receive``), the one send path (``send``), close, keep-alives, idle
``client``      :func:`open_connection`: connect and exchange hellos within a time limit
``server``      :func:`serve` and :class:`FramedServer`: listen, bound what each peer holds, own the
                handler task of every connection
``rpc``         :class:`RpcClient`: concurrent request/response calls matched by sequence number
``limits``      default limits, :class:`ByteBudget`, :class:`RateLimitedLog`
==============  ==========================================================================================

Errors follow :mod:`waltz.errors`: :class:`~waltz.errors.BrokenResourceError` when the peer or the network
ended the connection (retriable with a new connection), :class:`~waltz.errors.ClosedResourceError` when we
closed it, :class:`~waltz.errors.RemoteProtocolError` when the peer sent garbage (the connection is aborted
and the reason logged at WARNING), :class:`~waltz.errors.BusyResourceError` when a second receiver is asked
of a connection. Everything logs to the ``waltz.transport`` logger.
"""

from waltz.transport.client import open_connection
from waltz.transport.connection import FramedConnection, PayloadHandler, PayloadSink
from waltz.transport.limits import (
    DEFAULT_CONNECT_TIMEOUT_MS,
    DEFAULT_HANDSHAKE_TIMEOUT_MS,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_INTERVAL_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_WRITE_BUFFER_HIGH_BYTES,
    PEER_WARNING_INTERVAL_S,
    ByteBudget,
    RateLimitedLog,
    reason_kind,
)
from waltz.transport.rpc import RpcClient
from waltz.transport.server import ConnectionHandler, FramedServer, serve

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_MS",
    "DEFAULT_HANDSHAKE_TIMEOUT_MS",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_KEEP_ALIVE_INTERVAL_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_SOURCE",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_WRITE_BUFFER_HIGH_BYTES",
    "PEER_WARNING_INTERVAL_S",
    "ByteBudget",
    "ConnectionHandler",
    "FramedConnection",
    "FramedServer",
    "PayloadHandler",
    "PayloadSink",
    "RateLimitedLog",
    "RpcClient",
    "open_connection",
    "reason_kind",
    "serve",
]
