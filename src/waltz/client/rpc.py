"""Connections to the Waltz servers: :func:`connect_server`, and the RPCs (transaction data, high-water
mark, range reads) in one :class:`RpcPool` per client.

The pool keeps one :class:`~waltz.transport.RpcClient` per server endpoint, opened on first use and re-opened
after a failure. Responses echo the request's ReqId, whose sequence number matches them to their call. A lost
RPC fails with a retriable error, and so does one left unanswered (its connection is then closed, so that the
next attempt does not wait on the same silence); the caller's retry loop (:func:`retry_rpc`, the core's)
asks again, on the then-current owner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from ssl import SSLContext
from typing import Final, TypeVar

from waltz.config import host_port
from waltz.errors import (
    BrokenResourceError,
    ClientClosedError,
    ClientError,
    ClientTimeoutError,
    ClosedResourceError,
    DataChecksumError,
    LocalProtocolError,
    PartitionNotReadyError,
    RemoteProtocolError,
    WaltzError,
)
from waltz.protocol import client_server as cs
from waltz.protocol.framing import MAGIC_CLIENT
from waltz.protocol.record_run import RunBytes, run_records
from waltz.protocol.records import Record, ReqId
from waltz.transport import FramedConnection, RpcClient, open_connection

__all__ = [
    "CLIENT_HELLO",
    "RpcPool",
    "connect_server",
    "retry_rpc",
    "rpc_high_water_mark",
    "rpc_read_range",
    "rpc_read_run",
    "verified_records",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

CLIENT_HELLO: Final = "Waltz Client"
CONNECT_TIMEOUT_MS: Final = 5000
MAX_RPC_IN_FLIGHT: Final = 256
"""RPCs outstanding per endpoint; further calls wait for a slot (within their timeout)."""
RPC_ATTEMPT_TIMEOUT_MS: Final = 5000
"""Longest wait for one RPC response. A server that no longer owns the partition drops high-water-mark and
range requests, so an attempt must end well before the caller's own limit for it to retry elsewhere."""
RPC_RETRY_INITIAL_S: Final = 0.05
RPC_RETRY_MAX_S: Final = 1.0
_MASK32: Final = 0xFFFFFFFF


async def connect_server(endpoint: str, ssl: SSLContext | None = None) -> FramedConnection:
    """A client-protocol connection to the server at ``endpoint`` (BrokenResourceError if unreachable),
    over TLS with ``ssl`` (from ``client.ssl.*``)."""
    host, port = host_port(endpoint, what="server endpoint")
    return await open_connection(
        host,
        port,
        magic=MAGIC_CLIENT,
        versions=cs.SUPPORTED_VERSIONS,
        hello_text=CLIENT_HELLO,
        connect_timeout_ms=CONNECT_TIMEOUT_MS,
        ssl=ssl,
    )


class RpcPool:
    """One lazily opened, self-healing :class:`~waltz.transport.RpcClient` per server endpoint.

    Each call is one attempt: a lost connection or a missing response raises a retriable error, and the next
    call opens a new connection. :func:`retry_rpc` wraps a call in the retry loop readers want.
    """

    def __init__(self, client_id: int, ssl: SSLContext | None = None) -> None:
        self.client_id = client_id
        self._ssl = ssl
        self._clients: dict[str, RpcClient[cs.Message, cs.Message]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    async def _client(self, endpoint: str) -> RpcClient[cs.Message, cs.Message]:
        lock = self._locks.setdefault(endpoint, asyncio.Lock())
        async with lock:
            if self._closed:
                raise ClientClosedError("the RPC connections are closed")
            rpc = self._clients.get(endpoint)
            if rpc is not None and rpc.is_usable:
                return rpc
            if rpc is not None:
                await rpc.aclose()
            # Responses decoded in the transport's callback: a range read's multi-megabyte runs no longer pass
            # through a StreamReader (two more copies of every run, and a task woken per socket read).
            conn = await connect_server(endpoint, self._ssl)
            version = conn.negotiated_version

            def encode(msg: cs.Message) -> bytes:
                return cs.encode(msg, version)

            def decode(payload: bytes) -> cs.Message:
                return cs.decode(payload, version)

            rpc = RpcClient(
                conn,
                encode=encode,
                decode=decode,
                request_seq=_seq_of,
                response_seq=_seq_of,
                max_in_flight=MAX_RPC_IN_FLIGHT,
                name=f"waltz-rpc {endpoint}",
            )
            self._clients[endpoint] = rpc
            return rpc

    async def call(
        self,
        endpoint: str,
        make: Callable[[ReqId], cs.Message],
        partition_id: int,
        generation: int,
        timeout_ms: int,
    ) -> cs.Message:
        """Send ``make(req_id)`` to ``endpoint`` and return the response (one attempt)."""
        rpc = await self._client(endpoint)
        seq = rpc.next_seq() & _MASK32
        request = make(ReqId.of(self.client_id, generation, partition_id, seq))
        try:
            return await rpc.call(request, timeout_ms)
        except ClientTimeoutError:
            # No answer on a connection that looks open: the server dropped the request, or the link loses
            # what comes back. The next attempt gets a new connection rather than the same silence.
            if self._clients.get(endpoint) is rpc:
                del self._clients[endpoint]
                await rpc.aclose()
            raise
        except ClosedResourceError:
            if self._closed:
                raise
            # We dropped the connection because the partition moved: ask again, on the new owner.
            raise BrokenResourceError(f"the connection to {endpoint} was closed under the call") from None

    def forget(self, keep: set[str]) -> list[Awaitable[None]]:
        """Drop the connections to endpoints not in ``keep``; returns their closes to await."""
        closes: list[Awaitable[None]] = []
        for endpoint in [e for e in self._clients if e not in keep]:
            closes.append(self._clients.pop(endpoint).aclose())
            self._locks.pop(endpoint, None)
        return closes

    async def aclose(self) -> None:
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for rpc in clients:
            await rpc.aclose()


def _seq_of(msg: cs.Message) -> int:
    return msg.req_id.lsb & _MASK32


async def retry_rpc(call: Callable[[], Awaitable[T]], what: str, timeout_ms: int) -> T:
    """``call()`` again after each retriable :class:`~waltz.errors.WaltzError` (with back-off), until it
    succeeds, raises a non-retriable error, or ``timeout_ms`` has passed (ClientTimeoutError)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_ms / 1000
    delay_s = RPC_RETRY_INITIAL_S
    last: WaltzError | None = None
    while True:
        remaining_s = deadline - loop.time()
        if remaining_s <= 0:
            raise ClientTimeoutError(f"{what} did not succeed within {timeout_ms} ms: {last}") from last
        try:
            async with asyncio.timeout(remaining_s):
                return await call()
        except TimeoutError:
            raise ClientTimeoutError(f"{what} did not succeed within {timeout_ms} ms: {last}") from last
        except WaltzError as e:
            if not e.retriable:
                raise
            last = e
            log.debug("%s: %s; retrying", what, e)
        await asyncio.sleep(min(delay_s, max(deadline - loop.time(), 0)))
        delay_s = min(delay_s * 2, RPC_RETRY_MAX_S)


class _ChecksumMismatch(DataChecksumError):
    """A record read over the wire failed its checksum; reading it again may succeed."""

    retriable = True


async def rpc_high_water_mark(
    pool: RpcPool, endpoint: str, partition_id: int, generation: int, timeout_ms: int
) -> int:
    """One HighWaterMarkRequest attempt: the mark (-1 for an empty log), or a retriable PartitionNotReadyError
    when the owner has not opened the partition's store (its mark is unknown, never "empty")."""
    response = await pool.call(endpoint, cs.HighWaterMarkRequest, partition_id, generation, timeout_ms)
    if not isinstance(response, cs.HighWaterMarkResponse):
        raise RemoteProtocolError(f"expected a HighWaterMarkResponse, got {type(response).__name__}")
    hwm = response.transaction_id
    if hwm == cs.HWM_NOT_SERVED:
        raise PartitionNotReadyError(
            f"partition {partition_id} is not served: its server {endpoint} has not opened its store "
            "(too few clean replicas?); its high-water mark is unknown"
        )
    if hwm < -1:
        raise PartitionNotReadyError(f"partition {partition_id}: {endpoint} sent a bad high-water mark {hwm}")
    return hwm


async def rpc_read_run(
    pool: RpcPool,
    endpoint: str,
    partition_id: int,
    generation: int,
    start: int,
    max_count: int,
    timeout_ms: int,
) -> tuple[int, RunBytes]:
    """One TransactionRangeRequest attempt: ``(count, run)``, the records from ``start`` as a record run, not
    yet checked: unpack it with :func:`run_records`, :func:`run_columns` or :func:`run_bounds`, which check
    its shape and verify every checksum."""

    def make(req_id: ReqId) -> cs.Message:
        return cs.TransactionRangeRequest(req_id, start, max_count)

    try:
        response = await pool.call(endpoint, make, partition_id, generation, timeout_ms)
    except LocalProtocolError as e:
        raise ClientError(
            f"the server at {endpoint} cannot serve range reads (needs codec V5): {e}"
        ) from None
    if isinstance(response, cs.TrimmedResponse):
        raise response.error()  # Below the trim point: final, names the partition, the id and the point.
    if not isinstance(response, cs.TransactionRangeResponse):
        raise RemoteProtocolError(f"expected a TransactionRangeResponse, got {type(response).__name__}")
    if response.transaction_id != start:
        raise RemoteProtocolError(f"asked for a range from {start}, got one from {response.transaction_id}")
    if response.count > max_count:
        raise RemoteProtocolError(f"asked for {max_count} records, got {response.count}")
    return response.count, response.run


def verified_records(partition_id: int, start: int, count: int, run: RunBytes) -> list[Record]:
    """The records of a run, every checksum verified; a mismatch raises a retriable DataChecksumError (the
    copy may have been damaged on its way, so reading it again may succeed)."""
    try:
        return run_records(run, start, count)
    except DataChecksumError as e:
        raise _ChecksumMismatch(f"partition {partition_id}: {e}") from None


async def rpc_read_range(
    pool: RpcPool,
    endpoint: str,
    partition_id: int,
    generation: int,
    start: int,
    max_count: int,
    timeout_ms: int,
) -> list[Record]:
    """One TransactionRangeRequest attempt, the records' checksums verified."""
    count, run = await rpc_read_run(pool, endpoint, partition_id, generation, start, max_count, timeout_ms)
    return verified_records(partition_id, start, count, run)
