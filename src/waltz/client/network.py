"""The network driver: ZooKeeper discovery plus TCP connections to the Waltz servers.

:class:`NetworkDriver` implements the :class:`~waltz.client.driver.ClientDriver` contract (read that module's
docstring first); this one only says how.

Discovery
---------
A :class:`Discovery` supplies the cluster's name, its partition count, a unique client id and, on every
change, where each partition lives: ``{partition: ("host:port", generation)}``. :class:`ZkDiscovery` reads
them from ZooKeeper (``cluster.root``) with a :class:`~waltz.cluster.membership.ClusterWatcher`, which only
ever publishes assignments consistent with the live membership. Tests may pass their own.

Links
-----
One :class:`_Link` per server endpoint ("network client" in the original), created when a partition is
placed there. It holds two connections:

* the **stream** connection (mount, append, feed, flush), opened as long as a mounted partition lives on the
  endpoint. Its reader task routes every message to the partition it names (``req_id.partition_id``) and
  only if that partition is currently attached to this link. Each connection gets a new *incarnation*
  number (sent as the MountRequest's ``seqNum``; the server then ignores the older connection of this
  client). Losing the connection, for whatever reason, makes every partition on it report ``NOT_READY``; the
  link reconnects at once, waiting (0.2 s doubling to 1 s) only when the connect itself fails, and re-mounts
  each partition from the last transaction id it delivered.
* the **RPC** connection (transaction data, high-water mark, range reads) in an
  :class:`~waltz.transport.RpcClient`, opened on first use and re-opened after a failure. Responses echo the
  request's ReqId, whose sequence number matches them to their call. A lost RPC fails with a retriable
  error; the core's retry loop (or :meth:`NetworkDriver.read_range`'s) asks again, on the then-current owner.

Partitions
----------
A mounted partition (:class:`_Mount`) has one *feed session* at a time: the ReqId of its latest
MountRequest (a sequence number from a driver-wide counter, negative so it never equals an append's). A
MountResponse or FeedSuspended naming another ReqId is stale and ignored. FeedData carries the request id of
the original append, so it is accepted by partition, while that partition's session is open on the
connection it arrived on; ids at or below the last one delivered are dropped and a gap resets the link.

Each partition has an inbox and a delivery task that awaits the listener for one event at a time, in
arrival order, so partitions never wait on one another's application. The inbox holds at most
:data:`INBOX_FEED_LIMIT` feed entries; beyond that the connection's reader waits (TCP back pressure towards
the server). A FeedSuspended is answered with a new FeedRequest only when the delivery task reaches it,
i.e. once the core accepted everything before it: the feed window is the other half of the back pressure.

State changes: MountResponse READY → feed request, ``READY``. NOT_READY → ``NOT_READY`` and a new mount after
:data:`NOT_READY_RETRY_S`, wherever the latest assignment then places the partition. CLIENT_AHEAD →
``CLIENT_AHEAD``, and the partition stays put until unmounted. A new assignment that moves a partition, or
raises its generation, abandons its session (``NOT_READY``) and mounts it on the new endpoint.

Appends and flushes are encoded and written straight onto the stream connection (never blocking: the
connection buffers them), so a partition's requests go out in call order. Without a ready mount they raise
:class:`~waltz.errors.BrokenResourceError`, which the core treats as a failed send.

Everything runs on the client's event loop; kazoo's threads only reach it through the ClusterWatcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from ssl import SSLContext
from typing import Final, Protocol, TypeVar

from kazoo.client import KazooClient

from waltz.client.config import ClientConfig
from waltz.client.driver import AppendRequest, ClientDriver, DriverListener, MountState
from waltz.cluster import zk
from waltz.cluster.membership import ClusterWatcher
from waltz.cluster.store_metadata import next_id, read_cluster_params
from waltz.errors import (
    BrokenResourceError,
    ClientClosedError,
    ClientError,
    ClientTimeoutError,
    ClosedResourceError,
    ConfigError,
    ConnectionError_,
    DataChecksumError,
    LocalProtocolError,
    PartitionNotReadyError,
    ProtocolError,
    RemoteProtocolError,
    WaltzError,
)
from waltz.protocol import client_server as cs
from waltz.protocol.framing import MAGIC_CLIENT
from waltz.protocol.record_run import run_records
from waltz.protocol.records import Record, ReqId
from waltz.transport import FramedConnection, RpcClient, open_connection

__all__ = [
    "CLIENT_HELLO",
    "Discovery",
    "NetworkDriver",
    "RpcPool",
    "ZkDiscovery",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

CLIENT_HELLO: Final = "Waltz Client"
NOT_READY_RETRY_S: Final = 0.3
"""Pause before mounting again after a MountResponse(NOT_READY)."""
RECONNECT_INITIAL_DELAY_S: Final = 0.2
RECONNECT_MAX_DELAY_S: Final = 1.0
"""Back-off between failed connects to one endpoint (a lost connection is re-opened at once)."""
CONNECT_TIMEOUT_MS: Final = 5000
INBOX_FEED_LIMIT: Final = 1024
"""Feed entries queued per partition before the connection's reader waits for the application."""
MAX_RPC_IN_FLIGHT: Final = 256
"""RPCs outstanding per endpoint; further calls wait for a slot (within their timeout)."""
RPC_ATTEMPT_TIMEOUT_MS: Final = 5000
"""Longest wait for one RPC response. A server that no longer owns the partition drops high-water-mark and
range requests, so an attempt must end well before the caller's own limit for it to retry elsewhere."""
RPC_RETRY_INITIAL_S: Final = 0.05
RPC_RETRY_MAX_S: Final = 1.0
ZK_CLOSE_TIMEOUT_S: Final = 5.0
ZK_MIN_CONNECT_TIMEOUT_MS: Final = 1000
ZK_MAX_CONNECT_TIMEOUT_MS: Final = 10000
_MASK32: Final = 0xFFFFFFFF

Endpoints = dict[int, tuple[str, int]]
"""``{partition: ("host:port", generation)}``."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)`` (the host may be a bracketed IPv6 address)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ClientError(f"bad server endpoint {endpoint!r}: expected host:port")
    return host.strip("[]"), int(port)


PLAIN_CHECK_WAIT_S = 0.5
"""How long a plain client's start waits for the assignment to check that the servers take plain TCP."""


async def connect_server(endpoint: str, ssl: SSLContext | None = None) -> FramedConnection:
    """A client-protocol connection to the server at ``endpoint`` (BrokenResourceError if unreachable),
    over TLS with ``ssl`` (from ``client.ssl.*``)."""
    host, port = split_endpoint(endpoint)
    return await open_connection(
        host,
        port,
        magic=MAGIC_CLIENT,
        versions=cs.SUPPORTED_VERSIONS,
        hello_text=CLIENT_HELLO,
        connect_timeout_ms=CONNECT_TIMEOUT_MS,
        ssl=ssl,
    )


# --------------------------------------------------------------------------------------------- discovery


class Discovery(Protocol):
    """Where the cluster's partitions live. ``open`` first; the properties are valid afterwards."""

    @property
    def cluster_name(self) -> str: ...

    @property
    def num_partitions(self) -> int: ...

    @property
    def endpoints(self) -> Endpoints:
        """The latest assignment (empty before the first one)."""
        ...

    async def open(self) -> None: ...

    async def new_client_id(self) -> int:
        """An id no other client of the cluster has."""
        ...

    def updates(self) -> AsyncIterator[Endpoints]:
        """The current assignment (if any), then each new one, until :meth:`close`."""
        ...

    async def close(self) -> None: ...


class ZkDiscovery:
    """:class:`Discovery` from ZooKeeper: ``zookeeper.*`` and ``cluster.root`` of the client config."""

    def __init__(self, config: ClientConfig) -> None:
        config.require_cluster()
        self._config = config
        self._zk: KazooClient | None = None
        self._watcher: ClusterWatcher | None = None
        self._name = ""
        self._num_partitions = 0

    @property
    def cluster_name(self) -> str:
        return self._name

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    @property
    def endpoints(self) -> Endpoints:
        return self._watcher.endpoints if self._watcher is not None else {}

    async def open(self) -> None:
        config = self._config
        session_timeout_ms = config.zookeeper_session_timeout_ms
        client = await asyncio.to_thread(
            zk.connect,
            config.zookeeper_connect_string,
            auth=config.zookeeper_auth(),
            session_timeout_ms=session_timeout_ms,
            # An ensemble that does not answer within a session timeout is reported, not waited for.
            connect_timeout_ms=max(
                ZK_MIN_CONNECT_TIMEOUT_MS, min(session_timeout_ms, ZK_MAX_CONNECT_TIMEOUT_MS)
            ),
        )
        try:
            params = await asyncio.to_thread(read_cluster_params, client, config.cluster_root)
            watcher = ClusterWatcher(client, config.cluster_root)
            await watcher.start()
        except BaseException:
            await _close_zk(client)
            raise
        self._zk, self._watcher = client, watcher
        self._name, self._num_partitions = params.name, params.num_partitions

    async def new_client_id(self) -> int:
        if self._zk is None:
            raise ClientError("discovery is not open")
        return await asyncio.to_thread(next_id, self._zk, self._config.cluster_root, "client")

    async def updates(self) -> AsyncIterator[Endpoints]:
        if self._watcher is None:
            return
        async for endpoints in self._watcher.updates():
            yield endpoints

    async def close(self) -> None:
        watcher, self._watcher = self._watcher, None
        client, self._zk = self._zk, None
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.close()
        if client is not None:
            await _close_zk(client)


async def _close_zk(client: KazooClient) -> None:
    # kazoo's stop() can wait on an unreachable ensemble; close() must return regardless.
    try:
        async with asyncio.timeout(ZK_CLOSE_TIMEOUT_S):
            await asyncio.to_thread(zk.close, client)
    except (TimeoutError, Exception) as e:  # noqa: BLE001 - closing is best effort, say why and go on
        log.warning("closing the ZooKeeper client failed: %s", e or type(e).__name__)


# ------------------------------------------------------------------------------------------------- RPCs


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
) -> tuple[int, bytes]:
    """One TransactionRangeRequest attempt: ``(count, run)``, the records from ``start`` as a record run whose
    shape the codec checked; verify the checksums with :func:`run_records` or :func:`run_columns`."""

    def make(req_id: ReqId) -> cs.Message:
        return cs.TransactionRangeRequest(req_id, start, max_count)

    try:
        response = await pool.call(endpoint, make, partition_id, generation, timeout_ms)
    except LocalProtocolError as e:
        raise ClientError(
            f"the server at {endpoint} cannot serve range reads (needs codec V5): {e}"
        ) from None
    if not isinstance(response, cs.TransactionRangeResponse):
        raise RemoteProtocolError(f"expected a TransactionRangeResponse, got {type(response).__name__}")
    if response.transaction_id != start:
        raise RemoteProtocolError(f"asked for a range from {start}, got one from {response.transaction_id}")
    if response.count > max_count:
        raise RemoteProtocolError(f"asked for {max_count} records, got {response.count}")
    return response.count, response.run


def verified_records(partition_id: int, start: int, count: int, run: bytes) -> list[Record]:
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


# ----------------------------------------------------------------------------------- partition events


@dataclass(slots=True)
class _Feed:
    session: ReqId
    transaction_id: int
    req_id: ReqId
    header: int


@dataclass(slots=True)
class _MountReply:
    session: ReqId
    state: cs.PartitionState


@dataclass(slots=True)
class _Suspended:
    session: ReqId


@dataclass(slots=True)
class _LockFailed:
    req_id: ReqId
    transaction_id: int


@dataclass(slots=True)
class _Flushed:
    req_id: ReqId
    transaction_id: int


@dataclass(slots=True)
class _Unready:
    """The driver abandoned the session (connection lost, partition moved): report NOT_READY."""


_Event = _Feed | _MountReply | _Suspended | _LockFailed | _Flushed | _Unready


class _Mount:
    """The driver's state for one mounted partition (event loop only)."""

    def __init__(self, partition_id: int, client_high_water_mark: int) -> None:
        self.partition_id = partition_id
        self.position = client_high_water_mark  # Last feed id delivered; kept across reconnects and moves.
        self.link: _Link | None = None
        self.generation = 0
        self.session: ReqId | None = None  # The current feed session (the latest MountRequest's ReqId).
        self.ready = False  # READY seen for the current session: appends may be sent.
        self.ahead = False  # CLIENT_AHEAD: terminal until unmounted.
        self.closed = False
        self.reported: MountState | None = None
        self.inbox: deque[_Event] = deque()
        self.feed_queued = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self.deliver_task: asyncio.Task[None] | None = None
        self.retry_task: asyncio.Task[None] | None = None

    def put(self, event: _Event) -> None:
        self.inbox.append(event)
        if isinstance(event, _Feed):
            self.feed_queued += 1
        self._wake.set()

    def get_nowait(self) -> _Event | None:
        """The next event if one is queued (no coroutine), else None."""
        if not self.inbox:
            return None
        event = self.inbox.popleft()
        if isinstance(event, _Feed):
            self.feed_queued -= 1
            if self.feed_queued <= INBOX_FEED_LIMIT // 2:
                self._room.set()
        return event

    async def get(self) -> _Event:
        while not self.inbox:
            self._wake.clear()
            await self._wake.wait()
        event = self.inbox.popleft()
        if isinstance(event, _Feed):
            self.feed_queued -= 1
            if self.feed_queued <= INBOX_FEED_LIMIT // 2:
                self._room.set()
        return event

    async def wait_room(self, link: _Link) -> None:
        """Wait while the inbox is full and the partition still listens to ``link``."""
        while self.feed_queued >= INBOX_FEED_LIMIT and self.link is link and not self.closed:
            self._room.clear()
            await self._room.wait()

    def wake_readers(self) -> None:
        self._room.set()


class _Link:
    """The stream connection to one server endpoint, kept open while partitions are attached."""

    def __init__(self, driver: NetworkDriver, endpoint: str) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.attached: dict[int, _Mount] = {}
        self.conn: FramedConnection | None = None
        self.version = 0
        self.incarnation = -1
        self._wanted = asyncio.Event()
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"waltz-link {endpoint}")

    @property
    def connected(self) -> bool:
        return self.conn is not None and not self.conn.is_closed

    def attach(self, mount: _Mount) -> None:
        self.attached[mount.partition_id] = mount
        mount.link = self
        self._wanted.set()

    def detach(self, mount: _Mount) -> None:
        if self.attached.get(mount.partition_id) is mount:
            del self.attached[mount.partition_id]
        if mount.link is self:
            mount.link = None
        mount.wake_readers()
        conn = self.conn
        if not self.attached and conn is not None and not conn.is_closed:
            # Nothing of ours lives here any more: let the connection go (the run loop then idles).
            self.driver._spawn(conn.aclose(), f"waltz-idle {self.endpoint}")

    def send(self, msg: cs.Message) -> None:
        """Encode and queue ``msg`` on the stream connection (BrokenResourceError if there is none)."""
        conn = self.conn
        if conn is None:
            raise BrokenResourceError(f"no connection to {self.endpoint}")
        payload = cs.encode(msg, self.version)
        try:
            conn.send(payload)
        except ConnectionError_ as e:
            raise BrokenResourceError(f"connection to {self.endpoint} lost: {e}") from None

    async def aclose(self) -> None:
        self._closed = True
        self._task.cancel()
        await asyncio.wait([self._task])
        conn, self.conn = self.conn, None
        if conn is not None:
            await conn.aclose()

    async def _run(self) -> None:
        delay_s = RECONNECT_INITIAL_DELAY_S
        while not self._closed:
            if not self.attached:
                self._wanted.clear()
                await self._wanted.wait()
                continue
            try:
                conn = await connect_server(self.endpoint, self.driver._ssl)
            except ConfigError as e:
                # Such as a plain client meeting a TLS server: retrying will not help, but the assignment may
                # move the partitions to a server that takes us, so keep the link (slowly).
                log.error("cannot connect to %s: %s", self.endpoint, e)
                await asyncio.sleep(RECONNECT_MAX_DELAY_S)
                continue
            except (ConnectionError_, ProtocolError) as e:
                log.info("cannot connect to %s (retrying in %.1f s): %s", self.endpoint, delay_s, e)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, RECONNECT_MAX_DELAY_S)
                continue
            delay_s = RECONNECT_INITIAL_DELAY_S
            self.incarnation = next(self.driver._incarnations)
            self.conn, self.version = conn, conn.negotiated_version
            log.debug("connected to %s (incarnation %d)", self.endpoint, self.incarnation)
            try:
                for mount in list(self.attached.values()):
                    self.driver._send_mount(mount)
                await self._read(conn)
            except (ConnectionError_, ProtocolError) as e:
                if not self._closed:
                    log.info("connection to %s lost: %s", self.endpoint, e)
            finally:
                self.conn = None
                await conn.aclose()
            for mount in list(self.attached.values()):
                self.driver._abandon(mount)

    async def _read(self, conn: FramedConnection) -> None:
        driver = self.driver
        version = conn.negotiated_version
        while True:
            msg = cs.decode(await conn.receive(), version)
            mount = driver._mounts.get(msg.req_id.partition_id)
            if mount is None or mount.link is not self or mount.closed:
                continue  # Not (or no longer) ours to hear from this server.
            if isinstance(msg, cs.FeedData):
                if mount.session is None:
                    continue
                mount.put(_Feed(mount.session, msg.transaction_id, msg.req_id, msg.header))
                if mount.feed_queued >= INBOX_FEED_LIMIT:
                    await mount.wait_room(self)
            elif isinstance(msg, cs.MountResponse):
                if msg.req_id == mount.session:
                    mount.put(_MountReply(msg.req_id, msg.state))
            elif isinstance(msg, cs.FeedSuspended):
                if msg.req_id == mount.session:
                    mount.put(_Suspended(msg.req_id))
            elif isinstance(msg, cs.LockFailure):
                mount.put(_LockFailed(msg.req_id, msg.transaction_id))
            elif isinstance(msg, cs.FlushResponse):
                mount.put(_Flushed(msg.req_id, msg.transaction_id))
            else:
                log.debug("ignoring %s from %s on the stream connection", type(msg).__name__, self.endpoint)


# -------------------------------------------------------------------------------------------- the driver


class NetworkDriver(ClientDriver):
    """The :class:`~waltz.client.driver.ClientDriver` for a real cluster (see the module docstring).

    ``discovery`` replaces ZooKeeper (tests). Besides the contract it offers :meth:`read_range`, a verified
    bulk read of committed transactions.
    """

    def __init__(self, config: ClientConfig, *, discovery: Discovery | None = None) -> None:
        self._config = config
        self._ssl = config.tls.client_context("client config")
        self._discovery: Discovery = discovery if discovery is not None else ZkDiscovery(config)
        self._listener: DriverListener | None = None
        self._client_id = -1
        self._endpoints: Endpoints = {}
        self._mounts: dict[int, _Mount] = {}
        self._links: dict[str, _Link] = {}
        self._rpc: RpcPool | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._incarnations = itertools.count()
        self._sessions = itertools.count(1)
        self._opened = False
        self._closed = False

    # -- contract: lifecycle and identity ------------------------------------------------------------------

    async def open(self, listener: DriverListener) -> None:
        if self._opened:
            raise ClientError("a NetworkDriver serves one client; create one per client")
        self._opened = True
        await self._discovery.open()
        try:
            self._client_id = await self._discovery.new_client_id()
        except BaseException:
            await self._discovery.close()
            raise
        self._listener = listener
        self._rpc = RpcPool(self._client_id, self._ssl)
        self._endpoints = self._discovery.endpoints
        if self._ssl is None:
            try:
                await self._check_plain_is_welcome()
            except BaseException:
                await self._discovery.close()
                raise
        self._spawn(self._follow_assignments(), "waltz-assignments")
        log.info(
            "client %d connected to cluster %s (%d partitions)",
            self._client_id,
            self.cluster_name,
            self.num_partitions,
        )

    async def _check_plain_is_welcome(self) -> None:
        """A client without TLS settings meeting a TLS cluster is a configuration error: say so now (one
        connection to one server), rather than let every mount retry until ``client.mountTimeout``."""
        current = self._discovery.endpoints
        if not current:
            # Discovery may not have read the assignment yet; a cluster without one is not worth a wait.
            updates = self._discovery.updates()
            try:
                async with asyncio.timeout(PLAIN_CHECK_WAIT_S):
                    async for current in updates:
                        if current:
                            break
            except TimeoutError:
                return
            finally:
                await updates.aclose()  # type: ignore[attr-defined]
        endpoints = sorted({endpoint for endpoint, _generation in current.values()})
        if not endpoints:
            return
        try:
            conn = await connect_server(endpoints[0], None)
        except ConfigError:
            raise
        except WaltzError:
            return  # unreachable or busy: the links retry and report it
        await conn.aclose()

    @property
    def client_id(self) -> int:
        return self._client_id

    @property
    def cluster_name(self) -> str:
        return self._discovery.cluster_name

    @property
    def num_partitions(self) -> int:
        return self._discovery.num_partitions

    def generation(self, partition_id: int) -> int:
        mount = self._mounts.get(partition_id)
        if mount is not None and mount.link is not None:
            return mount.generation
        target = self._endpoints.get(partition_id)
        return target[1] if target is not None else 0

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for partition_id in list(self._mounts):
            await self.unmount(partition_id)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.aclose()
        if self._rpc is not None:
            await self._rpc.aclose()
        await self._discovery.close()

    # -- contract: mounts ------------------------------------------------------------------------------------

    async def mount(self, partition_id: int, client_high_water_mark: int) -> None:
        self._check_open()
        if not 0 <= partition_id < self.num_partitions:
            raise ClientError(f"partition {partition_id} outside 0..{self.num_partitions - 1}")
        if partition_id in self._mounts:
            raise ClientError(f"partition {partition_id} is already mounted")
        mount = _Mount(partition_id, client_high_water_mark)
        self._mounts[partition_id] = mount
        mount.deliver_task = asyncio.get_running_loop().create_task(
            self._deliver(mount), name=f"waltz-deliver-p{partition_id}"
        )
        self._place(mount)

    async def unmount(self, partition_id: int) -> None:
        mount = self._mounts.pop(partition_id, None)
        if mount is None:
            return
        mount.closed = True
        mount.session = None
        mount.ready = False
        if mount.link is not None:
            mount.link.detach(mount)
        tasks = [t for t in (mount.deliver_task, mount.retry_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- contract: requests ----------------------------------------------------------------------------------

    def send_append(self, partition_id: int, request: AppendRequest) -> None:
        self._ready_link(partition_id).send(request)

    def send_flush(self, partition_id: int, req_id: ReqId) -> None:
        self._ready_link(partition_id).send(cs.FlushRequest(req_id))

    def _ready_link(self, partition_id: int) -> _Link:
        mount = self._mounts.get(partition_id)
        if self._closed or mount is None:
            raise BrokenResourceError(f"partition {partition_id} is not mounted")
        link = mount.link
        if not mount.ready or link is None or not link.connected:
            raise BrokenResourceError(f"partition {partition_id} is not ready (reconnecting or moving)")
        return link

    async def fetch_transaction_data(self, partition_id: int, transaction_id: int) -> tuple[bytes, int]:
        endpoint, generation = self._rpc_target(partition_id)

        def make(req_id: ReqId) -> cs.Message:
            return cs.TransactionDataRequest(req_id, transaction_id)

        response = await self._pool().call(endpoint, make, partition_id, generation, self._attempt_timeout_ms)
        if not isinstance(response, cs.TransactionDataResponse):
            raise RemoteProtocolError(f"expected a TransactionDataResponse, got {type(response).__name__}")
        if response.transaction_id != transaction_id:
            raise RemoteProtocolError(
                f"asked for transaction {transaction_id}, got {response.transaction_id}"
            )
        if response.data is None:
            raise PartitionNotReadyError(
                f"partition {partition_id}: {endpoint} could not read transaction {transaction_id}: "
                f"{response.error}"
            )
        return response.data, response.checksum

    async def high_water_mark(self, partition_id: int) -> int:
        endpoint, generation = self._rpc_target(partition_id)
        return await rpc_high_water_mark(
            self._pool(), endpoint, partition_id, generation, self._attempt_timeout_ms
        )

    async def read_range(self, partition_id: int, start: int, max_count: int) -> list[Record]:
        """Up to ``max_count`` committed transactions from ``start``, data included, each checksum verified.

        Fewer (or none) come back at the high-water mark or when the server trims a large response. Retried
        on retriable errors (the partition moving, a lost connection) within ``client.requestTimeout``.
        """
        self._check_open()
        if start < 0 or max_count < 0:
            raise ClientError(f"bad range: start {start}, max_count {max_count}")

        async def attempt() -> list[Record]:
            endpoint, generation = self._rpc_target(partition_id)
            return await rpc_read_range(
                self._pool(), endpoint, partition_id, generation, start, max_count, self._attempt_timeout_ms
            )

        return await retry_rpc(
            attempt, f"read_range({partition_id}, {start}, {max_count})", self._config.request_timeout_ms
        )

    @property
    def _attempt_timeout_ms(self) -> int:
        return min(self._config.request_timeout_ms, RPC_ATTEMPT_TIMEOUT_MS)

    def _rpc_target(self, partition_id: int) -> tuple[str, int]:
        self._check_open()
        target = self._endpoints.get(partition_id)
        if target is None:
            raise PartitionNotReadyError(f"partition {partition_id} has no server assigned yet")
        return target

    def _pool(self) -> RpcPool:
        if self._rpc is None:
            raise ClientError("the driver is not open")
        return self._rpc

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("the driver is closed")
        if self._listener is None:
            raise ClientError("the driver is not open")

    # -- placement ---------------------------------------------------------------------------------------

    async def _follow_assignments(self) -> None:
        async for endpoints in self._discovery.updates():
            self._on_assignment(endpoints)

    def _on_assignment(self, endpoints: Endpoints) -> None:
        self._endpoints = dict(endpoints)
        for mount in list(self._mounts.values()):
            if mount.ahead or mount.closed:
                continue
            target = endpoints.get(mount.partition_id)
            current = (mount.link.endpoint, mount.generation) if mount.link is not None else None
            if target != current or (mount.session is None and not mount.ready):
                self._place(mount)
        # Links nobody uses any more (their server left, or holds none of our partitions) are closed.
        wanted = {endpoint for endpoint, _ in endpoints.values()}
        for endpoint, link in list(self._links.items()):
            if not link.attached and endpoint not in wanted:
                del self._links[endpoint]
                self._spawn(link.aclose(), f"waltz-close-link {endpoint}")
        if self._rpc is not None:
            for close in self._rpc.forget(wanted):
                self._spawn(_awaited(close), "waltz-close-rpc")

    def _place(self, mount: _Mount) -> None:
        """Mount ``mount`` where the latest assignment puts it (or wait for one that does)."""
        if mount.closed or mount.ahead or self._closed:
            return
        self._cancel_retry(mount)
        target = self._endpoints.get(mount.partition_id)
        if mount.session is not None or mount.ready:
            self._abandon(mount)
        if target is None:
            if mount.link is not None:
                mount.link.detach(mount)
            mount.put(_Unready())
            return  # The next assignment that names the partition places it.
        endpoint, generation = target
        link = self._links.get(endpoint)
        if link is None:
            link = self._links[endpoint] = _Link(self, endpoint)
        if mount.link is not link:
            if mount.link is not None:
                mount.link.detach(mount)
            link.attach(mount)
        mount.generation = generation
        if link.connected:
            self._send_mount(mount)
        # Otherwise the link mounts every attached partition once it is connected.

    def _send_mount(self, mount: _Mount) -> None:
        link = mount.link
        if link is None or mount.closed or mount.ahead:
            return
        self._cancel_retry(mount)
        if mount.session is not None or mount.ready:
            self._abandon(mount)
        # Session ids count down from -1, so a session never shares a ReqId with one of the core's appends.
        session = ReqId.of(self._client_id, mount.generation, mount.partition_id, -next(self._sessions))
        mount.session = session
        try:
            link.send(cs.MountRequest(session, mount.position, link.incarnation))
        except BrokenResourceError:
            pass  # The link's reader sees the loss and mounts again on the next connection.

    def _abandon(self, mount: _Mount) -> None:
        """End the partition's session: NOT_READY for the core, and no more feed from it."""
        mount.session = None
        mount.ready = False
        mount.put(_Unready())
        mount.wake_readers()

    def _cancel_retry(self, mount: _Mount) -> None:
        task, mount.retry_task = mount.retry_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _retry_later(self, mount: _Mount) -> None:
        self._cancel_retry(mount)

        async def retry() -> None:
            await asyncio.sleep(NOT_READY_RETRY_S)
            self._place(mount)

        mount.retry_task = asyncio.get_running_loop().create_task(
            retry(), name=f"waltz-remount-p{mount.partition_id}"
        )

    # -- delivery ------------------------------------------------------------------------------------------

    async def _deliver(self, mount: _Mount) -> None:
        listener = self._listener
        assert listener is not None  # mount() checked
        # A listener may take a feed entry without a coroutine when it has room (the core does): one
        # function call per entry instead of two coroutine frames.
        nowait = getattr(listener, "feed_data_nowait", None)
        p = mount.partition_id
        while True:
            event = mount.get_nowait()
            if event is None:
                event = await mount.get()
            try:
                if isinstance(event, _Feed):
                    if event.session != mount.session or event.transaction_id <= mount.position:
                        continue  # From an abandoned session, or a repeat after a re-mount.
                    if event.transaction_id != mount.position + 1:
                        raise RemoteProtocolError(
                            f"partition {p}: the feed jumped from {mount.position} to {event.transaction_id}"
                        )
                    if nowait is None or not nowait(p, event.transaction_id, event.req_id, event.header):
                        await listener.on_feed_data(p, event.transaction_id, event.req_id, event.header)
                    mount.position = event.transaction_id
                elif isinstance(event, _MountReply):
                    if event.session == mount.session:
                        await self._on_mount_reply(mount, event, listener)
                elif isinstance(event, _Suspended):
                    if event.session == mount.session and mount.ready and mount.link is not None:
                        with contextlib.suppress(BrokenResourceError):
                            mount.link.send(cs.FeedRequest(event.session, mount.position))
                elif isinstance(event, _LockFailed):
                    await listener.on_lock_failure(p, event.req_id, event.transaction_id)
                elif isinstance(event, _Flushed):
                    await listener.on_flush_response(p, event.req_id, event.transaction_id)
                elif isinstance(event, _Unready) and mount.reported is not MountState.NOT_READY:
                    if mount.ahead:
                        continue  # CLIENT_AHEAD stays the partition's state until it is unmounted.
                    mount.reported = MountState.NOT_READY
                    await listener.on_mount_state(p, MountState.NOT_READY)
            except asyncio.CancelledError:
                raise
            except RemoteProtocolError as e:
                # The feed is not dense: start a new session from the last id delivered.
                log.error("%s; mounting again", e)
                self._send_mount(mount)
            except Exception:
                log.exception("partition %d: delivering %r failed", p, event)

    async def _on_mount_reply(self, mount: _Mount, reply: _MountReply, listener: DriverListener) -> None:
        p = mount.partition_id
        if reply.state == cs.PartitionState.READY:
            mount.ready = True
            if mount.link is not None:
                # The first feed window; each FeedSuspended opens the next one.
                with contextlib.suppress(BrokenResourceError):
                    mount.link.send(cs.FeedRequest(reply.session, mount.position))
            mount.reported = MountState.READY
            await listener.on_mount_state(p, MountState.READY)
        elif reply.state == cs.PartitionState.CLIENT_AHEAD:
            mount.session = None
            mount.ready = False
            mount.ahead = True
            mount.reported = MountState.CLIENT_AHEAD
            log.error(
                "partition %d: the client's high-water mark %d is ahead of the server", p, mount.position
            )
            await listener.on_mount_state(p, MountState.CLIENT_AHEAD)
        else:
            mount.session = None
            mount.ready = False
            log.debug("partition %d: not ready on %s; mounting again shortly", p, _endpoint_of(mount))
            self._retry_later(mount)
            if mount.reported is not MountState.NOT_READY:
                mount.reported = MountState.NOT_READY
                await listener.on_mount_state(p, MountState.NOT_READY)

    # -- tasks ---------------------------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(_awaited(coro), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("network driver task %s failed", task.get_name(), exc_info=task.exception())

    def statistics(self) -> dict[str, object]:
        """A snapshot for logs and tests: links, and per partition its position and state."""
        return {
            "client_id": self._client_id,
            "links": {
                e: {"connected": link.connected, "partitions": sorted(link.attached)}
                for e, link in self._links.items()
            },
            "partitions": {
                p: {"position": m.position, "ready": m.ready, "endpoint": _endpoint_of(m)}
                for p, m in self._mounts.items()
            },
        }


def _endpoint_of(mount: _Mount) -> str | None:
    return mount.link.endpoint if mount.link is not None else None


async def _awaited(awaitable: Awaitable[None]) -> None:
    await awaitable
