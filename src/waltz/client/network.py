"""The network driver: ZooKeeper discovery plus TCP connections to the Waltz servers.

:class:`NetworkDriver` implements the :class:`~waltz.client.driver.ClientDriver` contract (read that module's
docstring first); this one only says how. It is split along the lifecycle of a connection:

* :mod:`waltz.client.discovery`: where partitions live (ZooKeeper);
* :mod:`waltz.client.rpc`: connecting to a server, and the RPCs (data, high-water mark, range reads);
* :mod:`waltz.client.stream`: the stream connection to one server (:class:`~waltz.client.stream.StreamLink`:
  connect, reconnect, read and route) and the per-partition inbox it fills;
* this module: the request and feed driver: mounts, feed sessions, placement, delivery to the core.

Partitions
----------
A mounted partition (:class:`~waltz.client.stream.Mount`) has one *feed session* at a time: the ReqId of its
latest MountRequest (a sequence number from a driver-wide counter, negative so it never equals an append's).
A MountResponse or FeedSuspended naming another ReqId is stale and ignored. FeedData carries the request id
of the original append, so it is accepted by partition, while that partition's session is open on the
connection it arrived on; ids at or below the last one delivered are dropped and a gap resets the link.

A FeedSuspended is answered with a new FeedRequest only when the delivery task reaches it, i.e. once the core
accepted everything before it: the feed window is the other half of the back pressure.

State changes: MountResponse READY → feed request, ``READY``. NOT_READY → ``NOT_READY`` and a new mount after
:data:`NOT_READY_RETRY_S`, wherever the latest assignment then places the partition. CLIENT_AHEAD →
``CLIENT_AHEAD``, and the partition stays put while the assignment names the same owner and generation:
CLIENT_AHEAD is final only against the incarnation that answered it, so a new owner or generation mounts the
partition again. A new assignment that moves a partition, or raises its generation, abandons its session
(``NOT_READY``) and mounts it on the new endpoint. A
MountRequest left unanswered for ``client.answerTimeout`` (and a :meth:`NetworkDriver.resync` from the core)
drops the stream connection: every partition on it re-mounts, as after a lost connection.

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
from collections.abc import Awaitable, Coroutine, Mapping
from ssl import SSLContext
from typing import Any, Final

from waltz.client.builder import TransactionBuilder
from waltz.client.config import ClientConfig
from waltz.client.discovery import Discovery, Endpoints, ZkDiscovery
from waltz.client.driver import ClientDriver, CoordinationTrouble, DriverListener, MountState
from waltz.client.rpc import (
    CLIENT_HELLO,
    RPC_ATTEMPT_TIMEOUT_MS,
    RpcPool,
    connect_server,
    retry_rpc,
    rpc_high_water_mark,
    rpc_read_range,
)
from waltz.client.stream import (
    Feed,
    Flushed,
    LockFailed,
    Mount,
    MountReply,
    StreamLink,
    Suspended,
    Trimmed,
    Unready,
)
from waltz.client.tasks import TaskSet
from waltz.cluster.trim_points import TrimOutcome
from waltz.errors import (
    BrokenResourceError,
    ClientClosedError,
    ClientError,
    ConfigError,
    PartitionNotReadyError,
    RemoteProtocolError,
    TrimmedError,
    WaltzError,
)
from waltz.protocol import client_server as cs
from waltz.protocol.records import Record, ReqId

__all__ = [
    "CLIENT_HELLO",
    "Discovery",
    "Endpoints",
    "NetworkDriver",
    "RpcPool",
    "ZkDiscovery",
]

log = logging.getLogger(__name__)

NOT_READY_RETRY_S: Final = 0.3
"""Pause before mounting again after a MountResponse(NOT_READY)."""
PLAIN_CHECK_WAIT_S: Final = 0.5
"""How long a plain client's start waits for the assignment to check that the servers take plain TCP."""


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
        self._mounts: dict[int, Mount] = {}
        self._links: dict[str, StreamLink] = {}
        self._rpc: RpcPool | None = None
        self._tasks = TaskSet(self._task_failed)  # The driver's own tasks (see waltz.client.tasks).
        self._incarnations = itertools.count()
        self._sessions = itertools.count(1)
        self._opened = False
        self._closed = False

    # -- contract: lifecycle and identity ------------------------------------------------------------------

    def coordination_trouble(self) -> CoordinationTrouble | None:
        trouble = getattr(self._discovery, "coordination_trouble", None)  # Test discoveries have none.
        return trouble() if trouble is not None else None

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
        self._tasks.spawn(self._follow_assignments(), "waltz-assignments", self._assignments_failed)
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
    def zookeeper_client(self) -> Any:
        """The discovery's kazoo client while it is open (None otherwise): the client's metrics read its
        session state (``waltz_zookeeper_*``)."""
        return getattr(self._discovery, "zookeeper_client", None)

    @property
    def num_partitions(self) -> int:
        return self._discovery.num_partitions

    def generation(self, partition_id: int) -> int:
        mount = self._mounts.get(partition_id)
        if mount is not None and mount.link is not None:
            return mount.generation
        target = self._endpoints.get(partition_id)
        return target[1] if target is not None else 0

    # -- what a StreamLink may ask (waltz.client.stream.LinkOwner) ----------------------------------------

    @property
    def ssl(self) -> SSLContext | None:
        return self._ssl

    @property
    def mounts(self) -> Mapping[int, Mount]:
        return self._mounts

    @property
    def listener(self) -> object:
        return self._listener

    def next_incarnation(self) -> int:
        return next(self._incarnations)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for partition_id in list(self._mounts):
            await self.unmount(partition_id)
        await self._tasks.aclose()
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
        mount = Mount(partition_id, client_high_water_mark)
        self._mounts[partition_id] = mount
        mount.deliver_task = self.spawn_vital(self._deliver(mount), f"waltz-deliver-p{partition_id}")
        self._place(mount)

    async def unmount(self, partition_id: int) -> None:
        mount = self._mounts.pop(partition_id, None)
        if mount is None:
            return
        mount.closed = True
        mount.session = None
        mount.ready = False
        mount.cancel_answer_timer()
        if mount.link is not None:
            mount.link.detach(mount)
        tasks = [t for t in (mount.deliver_task, mount.retry_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- contract: requests ----------------------------------------------------------------------------------

    def send_append(self, partition_id: int, req_id: ReqId, builder: TransactionBuilder, now: bool) -> None:
        """Frame the append straight from the builder into this loop iteration's write on the partition's
        link (``StreamLink.queue_built``: no AppendRequest made), or with ``now``, write it and what was
        queued before it at once: the core's hot path, once per append."""
        mount = self._mounts.get(partition_id)
        link = mount.link if mount is not None else None
        if self._closed or link is None or link.conn is None or not mount.ready:  # type: ignore[union-attr]
            link = self._ready_link(partition_id)  # Raises the error that says why.
        conn = link.conn
        assert conn is not None  # Checked above.
        link.queue_built(conn, req_id, builder)
        if now:
            link.flush_appends()

    def send_flush(self, partition_id: int, req_id: ReqId) -> None:
        self._ready_link(partition_id).send(cs.FlushRequest(req_id))

    def _ready_link(self, partition_id: int) -> StreamLink:
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
            trimmed = TrimmedError.from_message(response.error or "")
            if trimmed is not None:
                raise trimmed  # not retriable: no replica holds it any more
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

    async def raise_trim_point(
        self, partition_id: int, target: int, high_water_mark: int, min_kept_transactions: int | None
    ) -> TrimOutcome:
        """Raise the partition's trim point in ZooKeeper (see :meth:`AsyncWaltzClient.trim`)."""
        self._check_open()
        raise_in_zk = getattr(self._discovery, "raise_trim_point", None)
        if raise_in_zk is None:
            raise ClientError("this client's discovery cannot trim (it has no ZooKeeper connection)")
        outcome: TrimOutcome = await raise_in_zk(partition_id, target, high_water_mark, min_kept_transactions)
        return outcome

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
        # A third of the caller's limit at most, so that an attempt lost in silence leaves time for two more
        # (each on a new connection: see RpcPool.call).
        return max(min(self._config.request_timeout_ms // 3, RPC_ATTEMPT_TIMEOUT_MS), 1)

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
        raise ClientError("the partition assignment's updates ended")  # Only close() may end them.

    def _assignments_failed(self, task: asyncio.Task[None], error: BaseException) -> None:
        """Following the assignment failed: no mount can move to a new owner any more, so the driver no
        longer serves; the client hears it (and stops its partitions with the reason) instead of stalling."""
        self._driver_failed("following the partition assignment", error)

    def _vital_failed(self, task: asyncio.Task[None], error: BaseException) -> None:
        """A task the driver cannot serve without failed (see :meth:`spawn_vital`): a bug."""
        self._driver_failed(f"its task {task.get_name()!r}", error)

    def _driver_failed(self, what: str, error: BaseException) -> None:
        failure = ClientError(
            f"the client driver stopped: {what} failed with {type(error).__name__}: {error} "
            "(restart the client)"
        )
        failure.__cause__ = error
        log.error("client %d: %s", self._client_id, failure, exc_info=error)
        if self._listener is not None and not self._closed:
            self._listener.on_driver_failure(failure)

    def _on_assignment(self, endpoints: Endpoints) -> None:
        self._endpoints = dict(endpoints)
        for mount in list(self._mounts.values()):
            if mount.closed:
                continue
            target = endpoints.get(mount.partition_id)
            current = (mount.link.endpoint, mount.generation) if mount.link is not None else None
            if mount.ahead:
                if target is None or target == current:
                    continue  # Still the incarnation that found the client ahead: the answer stands.
                # CLIENT_AHEAD is final only against the incarnation that said it: a new owner or generation
                # is asked again (the answer may have come from a fenced, stale incarnation).
                log.info(
                    "partition %d: owner now %s generation %d (was %s); checking again whether the client "
                    "is ahead",
                    mount.partition_id,
                    target[0],
                    target[1],
                    f"{current[0]} generation {current[1]}" if current is not None else "none",
                )
                mount.ahead = False
                mount.put(Unready())  # NOT_READY for the core while the new owner answers.
                self._place(mount)
            elif target != current or (mount.session is None and not mount.ready):
                self._place(mount)
        # Links nobody uses any more (their server left, or holds none of our partitions) are closed.
        wanted = {endpoint for endpoint, _ in endpoints.values()}
        for endpoint, link in list(self._links.items()):
            if not link.attached and endpoint not in wanted:
                del self._links[endpoint]
                self.spawn(link.aclose(), f"waltz-close-link {endpoint}")
        if self._rpc is not None:
            for close in self._rpc.forget(wanted):
                self.spawn(_awaited(close), "waltz-close-rpc")

    def _place(self, mount: Mount) -> None:
        """Mount ``mount`` where the latest assignment puts it (or wait for one that does)."""
        if mount.closed or mount.ahead or self._closed:
            return
        self._cancel_retry(mount)
        target = self._endpoints.get(mount.partition_id)
        if mount.session is not None or mount.ready:
            self.abandon(mount)
        if target is None:
            if mount.link is not None:
                mount.link.detach(mount)
            mount.put(Unready())
            return  # The next assignment that names the partition places it.
        endpoint, generation = target
        link = self._links.get(endpoint)
        if link is None:
            link = self._links[endpoint] = StreamLink(self, endpoint)
        if mount.link is not link:
            if mount.link is not None:
                mount.link.detach(mount)
            link.attach(mount)
        mount.generation = generation
        if link.connected:
            self.send_mount(mount)
        # Otherwise the link mounts every attached partition once it is connected.

    def send_mount(self, mount: Mount) -> None:
        link = mount.link
        if link is None or mount.closed or mount.ahead:
            return
        self._cancel_retry(mount)
        if mount.session is not None or mount.ready:
            self.abandon(mount)
        # Session ids count down from -1, so a session never shares a ReqId with one of the core's appends.
        session = ReqId.of(self._client_id, mount.generation, mount.partition_id, -next(self._sessions))
        mount.session = session
        try:
            link.send(cs.MountRequest(session, mount.position, link.incarnation))
        except BrokenResourceError:
            return  # The link's reader sees the loss and mounts again on the next connection.
        self._arm_answer_timer(mount, session)

    def _arm_answer_timer(self, mount: Mount, session: ReqId) -> None:
        mount.cancel_answer_timer()
        mount.fed = False
        mount.answer_timer = asyncio.get_running_loop().call_later(
            self._config.answer_timeout_ms / 1000, self._mount_unanswered, mount, session
        )

    def _mount_unanswered(self, mount: Mount, session: ReqId) -> None:
        """No MountResponse within ``client.answerTimeout``: a server that drops requests (or a link that
        lost them without closing) would otherwise leave the partition unmounted for good. The server answers
        a mount by streaming the backlog the client lacks, then the MountResponse: feed that arrived within
        the timeout, or feed still queued for the application (the client, not the server, is the slow
        one), is an answer in progress, and the timeout starts again."""
        mount.answer_timer = None
        if mount.session != session or mount.ready or mount.closed:
            return
        if mount.fed or mount.feed_queued:
            self._arm_answer_timer(mount, session)
            return
        self._reconnect(mount, f"no answer to the mount within {self._config.answer_timeout_ms} ms")

    def resync(self, partition_id: int) -> None:
        mount = self._mounts.get(partition_id)
        if mount is None or mount.closed or mount.ahead or self._closed:
            return
        self._reconnect(mount, f"appends unresolved for {self._config.answer_timeout_ms} ms")

    def _reconnect(self, mount: Mount, why: str) -> None:
        """Drop the partition's stream connection (every partition on it re-mounts, as after a lost
        connection), or place the partition again if it has none."""
        link = mount.link
        conn = link.conn if link is not None else None
        if link is None or conn is None or conn.is_closed:
            self._place(mount)
            return
        log.warning(
            "partition %d: %s (client.answerTimeout); reconnecting to %s",
            mount.partition_id,
            why,
            link.endpoint,
        )
        # The link's reader sees the close, abandons every session on it and reconnects at once.
        self.spawn(conn.aclose(), f"waltz-reconnect {link.endpoint}")

    def abandon(self, mount: Mount) -> None:
        """End the partition's session: NOT_READY for the core, and no more feed from it."""
        mount.session = None
        mount.ready = False
        mount.cancel_answer_timer()
        mount.put(Unready())
        mount.wake_readers()

    def _cancel_retry(self, mount: Mount) -> None:
        task, mount.retry_task = mount.retry_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _retry_later(self, mount: Mount) -> None:
        self._cancel_retry(mount)

        async def retry() -> None:
            await asyncio.sleep(NOT_READY_RETRY_S)
            self._place(mount)

        mount.retry_task = self.spawn_vital(retry(), f"waltz-remount-p{mount.partition_id}")

    # -- delivery ------------------------------------------------------------------------------------------

    async def _deliver(self, mount: Mount) -> None:
        listener = self._listener
        assert listener is not None  # mount() checked
        # A listener may take feed entries without a coroutine when it has room (the core does): one
        # function call per entry instead of two coroutine frames.
        nowait = getattr(listener, "feed_run_nowait", None)
        p = mount.partition_id
        while True:
            mount.busy = False
            event = mount.get_nowait()
            if event is None:
                event = await mount.get()
            mount.busy = True
            try:
                if isinstance(event, Feed):
                    if event.session != mount.session or event.transaction_id <= mount.position:
                        continue  # From an abandoned session, or a repeat after a re-mount.
                    if event.transaction_id != mount.position + 1:
                        raise RemoteProtocolError(
                            f"partition {p}: the feed jumped from {mount.position} to {event.transaction_id}"
                        )
                    entry = (event.transaction_id, event.req_id, event.header)
                    if nowait is None or nowait(p, [entry]) != 1:
                        await listener.on_feed_data(p, event.transaction_id, event.req_id, event.header)
                    mount.position = event.transaction_id
                elif isinstance(event, MountReply):
                    if event.session == mount.session:
                        await self._on_mount_reply(mount, event, listener)
                elif isinstance(event, Trimmed):
                    if event.session == mount.session:
                        await self._on_trimmed(mount, event.error, listener)
                elif isinstance(event, Suspended):
                    if event.session == mount.session and mount.ready and mount.link is not None:
                        with contextlib.suppress(BrokenResourceError):
                            mount.link.send(cs.FeedRequest(event.session, mount.position))
                elif isinstance(event, LockFailed):
                    await listener.on_lock_failure(p, event.req_id, event.transaction_id)
                elif isinstance(event, Flushed):
                    await listener.on_flush_response(p, event.req_id, event.transaction_id)
                elif isinstance(event, Unready) and mount.reported is not MountState.NOT_READY:
                    if mount.ahead:
                        continue  # CLIENT_AHEAD stays the partition's state until its owner changes.
                    mount.reported = MountState.NOT_READY
                    await listener.on_mount_state(p, MountState.NOT_READY)
            except asyncio.CancelledError:
                raise
            except RemoteProtocolError as e:
                # The feed is not dense: start a new session from the last id delivered.
                log.error("%s; mounting again", e)
                self.send_mount(mount)
            except Exception:
                log.exception("partition %d: delivering %r failed", p, event)

    async def _on_mount_reply(self, mount: Mount, reply: MountReply, listener: DriverListener) -> None:
        p = mount.partition_id
        mount.cancel_answer_timer()
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

    async def _on_trimmed(self, mount: Mount, error: TrimmedError, listener: DriverListener) -> None:
        """The mount starts below the trim point: final, like CLIENT_AHEAD (no re-mount until the partition's
        owner or generation changes); the core stops the partition with ``error``."""
        mount.session = None
        mount.ready = False
        mount.ahead = True
        log.debug("%s", error)  # The core stops the partition and logs it once.
        await listener.on_mount_failure(mount.partition_id, error)

    # -- tasks ---------------------------------------------------------------------------------------------

    def spawn(self, coro: Awaitable[None], name: str) -> None:
        """Run a housekeeping task (closing a link, say): its failure is logged (:meth:`_task_failed`)."""
        self._tasks.spawn(_awaited(coro), name)

    def spawn_vital(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run a task the driver cannot serve without (a link's connection loop or its paused reads, a
        partition's delivery or its next mount): its failure (a bug) would stall partitions, so it stops the
        driver and the client hears why, as when following the assignment fails. Cancelled by ``close``."""
        return self._tasks.spawn(coro, name, self._vital_failed)

    def _task_failed(self, task: asyncio.Task[None], error: BaseException) -> None:
        """One of the driver's housekeeping tasks failed (closing a link, following the assignment): what
        it was for is retried by the links and the next assignment; the failure is a bug, said once."""
        log.error("network driver task %s failed", task.get_name(), exc_info=error)

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


def _endpoint_of(mount: Mount) -> str | None:
    return mount.link.endpoint if mount.link is not None else None


async def _awaited(awaitable: Awaitable[None]) -> None:
    await awaitable
