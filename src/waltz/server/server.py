"""The Waltz server process: client connections, partition ownership, replica sets, health and metrics.

* **Ownership** comes from ZooKeeper (:class:`~waltz.cluster.membership.ClusterMember`): a partition assigned
  to us is opened (a :class:`~waltz.server.partition.Partition` over a
  :class:`~waltz.server.store.store_partition.StorePartition`), a raised generation is passed on, a partition
  that moved away is closed. A :class:`~waltz.server.partition.Partition` is one incarnation: it lives for
  one generation, so a raised generation closes it and opens a new one (its lock table and registrations
  may be stale: the partition was elsewhere meanwhile). While the ZooKeeper connection is SUSPENDED, or its
  session LOST and not yet re-registered, the server holds new appends, flushes and mounts until it knows
  what it owns again (at most one session timeout; then it answers them as not mounted). It keeps its
  partitions meanwhile: one that comes back in the same generation never left, and carries on as it was.
  Store sessions stay fenced by the storage nodes regardless, so a stale owner cannot commit.
* **Replica sets** come from ``<root>/store/assignment``, watched: a change makes the affected partitions
  start a new store session against the new set (recovery brings new replicas up to date).
* **Connections** speak the client<->server protocol (frame magic 'L', codec versions 0..4). Each
  connection's messages are handled in order; appends wait when the partition's queue is full, which stops
  reading that connection (back pressure). **No request goes unanswered**: one for a partition we do not
  own, or from a connection that is not the client's current mount of it, ends that mount (MountResponse
  NOT_READY on the mount's ReqId; the client mounts again wherever the assignment then says); a
  TransactionDataRequest gets an error response; for a partition we own but do not serve (no open store
  session within ``HWM_RECOVERY_WAIT_S``: never opened, or its quorum lost), a high-water mark request gets
  ``HWM_NOT_SERVED`` and a range request no records (readers then ask for the mark); a high-water mark or
  range request for a partition we do not own closes the connection (its RPC fails at once and is retried
  on the owner), as does a stream request for a partition the connection never mounted (a protocol
  violation). **Only the current incarnation answers as the owner**: an incarnation that a new assignment
  ends leaves the partition table before any of them is closed; a mount is answered only by the incarnation
  of the generation it names (else NOT_READY), and a high-water mark or range request naming a newer
  generation than ours gets ``HWM_NOT_SERVED`` or no records: the mark of an incarnation whose generation is
  over (fenced by the new owner) may be far below the log's end. A flush is answered through an open store
  session only (see ``Partition.flush_request``).
* **Bounds per connection** (``server.connection.*``, docs/operations.md "Limits"): at most ``maxInFlight``
  mounts, reads and flushes unanswered (the connection is not read meanwhile); read responses reserve their
  bytes from a ``maxResponseBytes`` budget until they left our write buffer, so a peer that asks and never
  reads holds at most that much; connections silent (or not reading) for ``idleTimeout`` are closed; at most
  ``maxConnections`` connections, ``maxPerSource`` from one address. Transaction data reads go through one
  :class:`~waltz.server.transaction_cache.TransactionFetcher` (cache first, one load per key, at most
  ``server.maxFetchesInFlight`` store reads at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
import weakref
from collections.abc import Awaitable
from typing import Any

from kazoo.client import KazooClient

from waltz.cluster import zk
from waltz.cluster.features import watch_feature_version
from waltz.cluster.membership import ClusterMember
from waltz.cluster.replica_assignments import ReplicaAssignments
from waltz.cluster.store_metadata import read_store_params
from waltz.cluster.trim_points import TrimOutcome, TrimSource, raise_trim_point
from waltz.cluster.zk import ClusterPaths
from waltz.cluster.zk_metrics import ZooKeeperCollector
from waltz.config import parse_partition_ranges
from waltz.errors import PartitionNotReadyError, RemoteProtocolError, WaltzError
from waltz.http import HttpEndpoint, listen, new_registry
from waltz.protocol import client_server as cs
from waltz.protocol.framing import MAGIC_CLIENT
from waltz.protocol.record_run import RunBytes
from waltz.protocol.storage_multi import MULTI_APPEND_FEATURE_VERSION
from waltz.runtime import TaskSet
from waltz.server import retention
from waltz.server.adapters import TcpReplicaConnector, ZkPartitionMetadataStore
from waltz.server.bursts import ReadBursts
from waltz.server.config import ServerConfig
from waltz.server.connection import BadMessage, ClientConnection, CloseConnection
from waltz.server.feed_cache import FeedCache
from waltz.server.metrics import PartitionGauges, ServerMetrics, StoreCollector
from waltz.server.partition import Partition
from waltz.server.retention import RetentionKeeper
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache, TransactionData, TransactionFetcher
from waltz.transport import (
    FramedConnection,
    FramedServer,
    RateLimitedLog,
    reason_kind,
    serve,
)

log = logging.getLogger(__name__)
_peer_warnings = RateLimitedLog(log)

SERVER_HELLO = "Waltz Server"
MAX_RANGE_RECORDS = 10_000
"""Most records one TransactionRangeRequest is answered with."""
_APPEND_REQUEST_TYPE = int(cs.MessageType.APPEND_REQUEST)
HWM_RECOVERY_WAIT_S = 1.0
"""How long a high-water-mark request waits for a partition that is still recovering before the answer is
``HWM_NOT_SERVED``: long enough for a normal start, short against a client's request timeout."""


class WaltzServer:
    """A running Waltz server. Use :meth:`start`; :meth:`aclose` stops everything it started."""

    def __init__(
        self, config: ServerConfig, zk_client: KazooClient, cluster_key: uuid.UUID, num_partitions: int
    ):
        self.config = config
        self.zk = zk_client
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.registry = new_registry()
        self.metrics = ServerMetrics(self.registry, num_partitions)
        # server.ssl.* also secures the links to storage nodes (REFERENCE §7.4).
        self.connector = TcpReplicaConnector(
            cluster_key, num_partitions, ssl=config.tls.client_context("server config")
        )
        self.metadata_store = ZkPartitionMetadataStore(zk_client, config.cluster_root)
        self.feed_cache = FeedCache(config.feed_cache_bytes, num_partitions)
        self.transaction_cache = TransactionCache(config.transaction_cache_bytes)
        self.fetcher = TransactionFetcher(
            self.transaction_cache, self._load_transaction, max_in_flight=config.max_fetches_in_flight
        )
        self.metrics.export_caches(self.feed_cache, self.transaction_cache)
        self.registry.register(PartitionGauges(lambda: self.partitions))
        self.registry.register(StoreCollector(lambda: self.partitions, num_partitions))
        self.registry.register(ZooKeeperCollector(lambda: self.zk))
        self.partitions: dict[int, Partition] = {}
        self.replica_sets: dict[int, tuple[str, ...]] = {}
        self.retention = RetentionKeeper(
            lambda: {pid: part.store for pid, part in self.partitions.items()},
            self._write_policy_trim,
            check_interval_ms=config.retention_check_interval_ms,
        )
        """Trim points in force and the retention policy (``<root>/store/trim`` and ``.../retention``)."""
        self.member: ClusterMember | None = None
        self._listener: FramedServer | None = None
        self._http: HttpEndpoint | None = None
        self._tasks = TaskSet(self._task_failed)
        """Every task of the server: its own work, and requests of clients (see :meth:`_spawn`)."""
        self._reconcile_lock = asyncio.Lock()
        self._replicas_changed = asyncio.Event()
        self.multi_append = False
        """Whether the cluster's feature version lets appends share storage requests (see _watch_features)."""
        self.failure: BaseException | None = None
        """Why the server stopped following ZooKeeper (a bug): it must not go on serving; see run_server."""
        self._failed = asyncio.Event()
        self._suspended = False
        self._suspended_at = 0.0
        self._unserved: weakref.WeakKeyDictionary[Partition, tuple[float, int]] = weakref.WeakKeyDictionary()
        """Partitions not serving since (a time on the monotonic clock, and how many store sessions they had
        opened then): from their opening here, or from the first read that found them not serving. See
        :meth:`_wait_serving`."""
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.port = 0
        self.http_port = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- life cycle --

    @classmethod
    async def start(cls, config: ServerConfig) -> WaltzServer:
        client = await asyncio.to_thread(
            zk.connect,
            config.zookeeper_connect,
            session_timeout_ms=config.zookeeper_session_timeout_ms,
            connect_timeout_ms=config.zookeeper_connect_timeout_ms,
            auth=config.zookeeper_auth,
        )
        try:
            params = await asyncio.to_thread(read_store_params, client, config.cluster_root)
        except BaseException:
            await asyncio.to_thread(zk.close, client)
            raise
        server = cls(config, client, params.cluster_key, params.num_partitions)
        try:
            await server._start()
        except BaseException:
            await server.aclose()
            raise
        return server

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        ssl = self.config.tls.server_context("server config")
        self._listener = await listen(
            "server.port",
            self.config.host,
            self.config.port,
            lambda: serve(
                self.config.host,
                self.config.port,
                self._serve_client,
                magic=MAGIC_CLIENT,
                versions=cs.SUPPORTED_VERSIONS,
                hello_text=SERVER_HELLO,
                max_frame_bytes=self.config.max_frame_bytes,
                max_connections=self.config.max_connections,
                max_connections_per_source=self.config.max_connections_per_source,
                idle_timeout_s=self.config.connection_idle_timeout_ms / 1000,
                ssl=ssl,
            ),
        )
        self.port = self._listener.port
        # Every port is bound before we join the cluster: a port in use must not cost a partition move.
        if self.config.http_port:
            self._http = HttpEndpoint(self.registry, self.health)
            self.http_port = await self._http.start(
                self.config.host, self.config.http_port, "server.http.port"
            )
        await self._watch_replica_assignments()
        await retention.watch(self.zk, self.config.cluster_root, self.retention)
        await self._watch_features()
        preferred = (
            parse_partition_ranges(self.config.preferred_partitions, self.num_partitions)
            if self.config.preferred_partitions
            else []
        )
        host, port = self.config.advertised_address or (self.config.host, self.port)
        self.member = ClusterMember(
            self.zk,
            self.config.cluster_root,
            host,
            port,
            preferred,
            on_suspended=self._on_suspended,
            on_resumed=self._on_resumed,
        )
        await self.member.start()
        self._tasks.spawn(self._follow(), "server-followers", self._followers_failed)
        log.info(
            "server %d serving clients on %s:%d%s (%d partitions in the cluster)",
            self.member.server_id,
            self.config.host,
            self.port,
            f", HTTP on port {self.http_port}" if self.http_port else "",
            self.num_partitions,
        )

    async def aclose(self) -> None:
        """Leave the cluster (our partitions move at once), close partitions and connections."""
        if self.member is not None:
            with contextlib.suppress(Exception):
                await self.member.close()
        await self._tasks.aclose()
        if self._listener is not None:
            await self._listener.aclose()
        await self.fetcher.aclose()
        for p in list(self.partitions.values()):
            with contextlib.suppress(Exception):
                await p.close()
        self.partitions.clear()
        await self.connector.aclose()
        if self._http is not None:
            await self._http.aclose()
        await asyncio.to_thread(zk.close, self.zk)

    @property
    def server_id(self) -> int:
        return self.member.server_id if self.member is not None else -1

    # -- ZooKeeper-driven state --

    # The ZooKeeper state change itself is logged once, by waltz.cluster.zk.

    async def _watch_features(self) -> None:
        """Follow the cluster's feature version: from 3 on, appends for several partitions go to a storage
        node in one request (:mod:`waltz.protocol.storage_multi`)."""
        loop = asyncio.get_running_loop()

        def on_change(fv: int) -> None:
            loop.call_soon_threadsafe(self._feature_version, fv)

        await asyncio.to_thread(watch_feature_version, self.zk, self.config.cluster_root, on_change)

    def _feature_version(self, fv: int) -> None:
        allowed = fv >= MULTI_APPEND_FEATURE_VERSION
        if allowed != self.multi_append:
            self.multi_append = allowed
            log.info(
                "cluster feature version %d: multi-partition storage appends %s",
                fv,
                "on" if allowed else "off",
            )
        self.connector.allow_multi_append(allowed)

    def _on_suspended(self) -> None:
        self._suspended = True
        self._suspended_at = time.monotonic()
        self._resumed.clear()
        log.debug("ZooKeeper connection suspended: holding new work until it is back")

    def _on_resumed(self) -> None:
        self._suspended = False
        self._resumed.set()
        log.debug(
            "ZooKeeper connection resumed after %.1f s; serving partitions %s",
            time.monotonic() - self._suspended_at,
            sorted(self.partitions),
        )

    async def _owned(self, partition_id: int) -> Partition | None:
        """The partition if we own it. While ZooKeeper is suspended we may not be the owner any more, so this
        waits until it is back: a short pause then only delays work. The wait is bounded by one session
        timeout from the suspension (by then the session is gone anyway); after it, None."""
        if self._suspended:
            deadline_s = self._suspended_at + self.config.zookeeper_session_timeout_ms / 1000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline_s - time.monotonic())):
                    await self._resumed.wait()
            if self._suspended:
                return None
        return self.partitions.get(partition_id)

    async def _follow(self) -> None:
        """Follow the partition assignment and the replica sets, and apply retention; all live as long as
        the server, and if one fails or returns the others stop too and the server learns of it
        (``_followers_failed``)."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._follow_assignments(), name="server-assignments")
            group.create_task(self._follow_replica_sets(), name="server-replica-sets")
            group.create_task(self.retention.run(), name="server-retention")
        raise RuntimeError("the ZooKeeper followers returned")

    def _followers_failed(self, _task: asyncio.Task[Any], error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        # A server that no longer follows its ownership cannot be trusted to serve.
        self._fail(error, "stopped following ZooKeeper")

    def _fail(self, error: BaseException, what: str) -> None:
        """A background task of the server failed: report it on /health and let run_server stop the server,
        so its partitions move to a server that works (the first failure is the one reported)."""
        if self.failure is None:
            self.failure = error
        self._failed.set()
        log.error("server %d: %s; stopping", self.server_id, what, exc_info=error)

    async def wait_failed(self) -> BaseException:
        """Wait until a background task of the server fails, and return its exception."""
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    async def _follow_assignments(self) -> None:
        assert self.member is not None
        async for assignment in self.member.assignments():
            await self._reconcile(assignment)

    async def _close_ended(self, assignment: dict[int, int]) -> None:
        """Close every incarnation that ``assignment`` ends (its partition moved away or to a new generation).

        Each leaves :attr:`partitions` before the first of them is closed (a close waits for its tasks and its
        store): one still listed would go on answering requests for a generation that is over meanwhile, e.g.
        a mount with the stale high-water mark of a store fenced by the new owner. Not listed, its requests
        are answered NOT_READY (Partition.mount also refuses every generation but its own)."""
        over = sorted(pid for pid, p in self.partitions.items() if assignment.get(pid) != p.generation)
        ending = [(pid, self.partitions.pop(pid)) for pid in over]
        for pid, old in ending:
            if pid not in assignment:
                await old.close()
                log.info(
                    "partition %d closed: moved away (generation %d, high-water mark %d)",
                    pid,
                    old.generation,
                    old.high_water_mark,
                )
                continue
            # It moved away and back (we missed the step between): another server may have committed
            # meanwhile, so this incarnation's lock table and registrations are stale. Start afresh.
            self.metrics.generation_changes.labels(str(pid)).inc()
            log.info("partition %d: generation %d -> %d; reopening it", pid, old.generation, assignment[pid])
            await old.close()

    async def _reconcile(self, assignment: dict[int, int]) -> None:
        async with self._reconcile_lock:
            await self._close_ended(assignment)
            for pid, generation in sorted(assignment.items()):
                if pid in self.partitions:
                    continue  # the same generation: carries on as it was
                replicas = self.replica_sets.get(pid, ())
                if not replicas:
                    log.error("partition %d has no replicas assigned in ZooKeeper; not opening it", pid)
                    continue
                store = StorePartition(
                    pid,
                    generation,
                    replicas,
                    connector=self.connector,
                    metadata_store=self.metadata_store,
                    config=self.config.store,
                )
                part = Partition(
                    pid,
                    store,
                    feed_cache=self.feed_cache,
                    transaction_cache=self.transaction_cache,
                    fetcher=self.fetcher,
                    lock_table_size=self.config.lock_table_size,
                    min_fetch_size=self.config.min_fetch_size,
                    append_queue_size=self.config.append_queue_size,
                    metrics=self.metrics.for_partition(pid),
                )
                part.on_failure = self._partition_failed
                store.set_trim_point(self.retention.in_force(pid))
                await part.start()
                self.partitions[pid] = part
                # Not served until its first session opens: reads wait for that from now, not from the first
                # read (see _wait_serving).
                self._unserved[part] = (time.monotonic(), 0)
                self.metrics.generation_changes.labels(str(pid)).inc()
                log.info(
                    "partition %d opened at generation %d, replicas %s; recovering",
                    pid,
                    generation,
                    list(replicas),
                )
            self.metrics.partitions.set(len(self.partitions))

    def _partition_failed(self, part: Partition) -> None:
        # Its append task died (a bug): close this incarnation (which tells its clients to mount again) and
        # open a fresh one, so one failure costs a re-mount rather than the partition.
        self._spawn(self._reopen(part), f"reopen-{part.partition_id}")

    async def _reopen(self, part: Partition) -> None:
        pid = part.partition_id
        async with self._reconcile_lock:
            if self.partitions.get(pid) is not part:
                return
            del self.partitions[pid]
            log.warning("partition %d: reopening it after its failure", pid)
            await part.close()
        if self.member is not None:
            await self._reconcile(self.member.partitions)

    async def _watch_replica_assignments(self) -> None:
        path = ClusterPaths(self.config.cluster_root).replica_assignments
        loop = asyncio.get_running_loop()
        first = asyncio.Event()

        def on_data(data: bytes | None, _stat: Any, *_: Any) -> None:
            # Called on a kazoo thread: hop onto the loop before touching anything.
            loop.call_soon_threadsafe(self._replica_data, data, first)

        await asyncio.to_thread(self.zk.DataWatch, path, on_data)
        await asyncio.wait_for(first.wait(), timeout=self.config.zookeeper_session_timeout_ms / 1000)

    async def _write_policy_trim(
        self, partition_id: int, target: int, hwm: int, grace_ms: int
    ) -> TrimOutcome:
        """Set the retention policy's trim point (the keeper's writer; see waltz.server.retention)."""
        return await asyncio.to_thread(
            raise_trim_point,
            self.zk,
            self.config.cluster_root,
            partition_id,
            target,
            hwm,
            min_kept_transactions=0,
            grace_ms=grace_ms,
            source=TrimSource.POLICY,
            replace_pending=False,
        )

    def _replica_data(self, data: bytes | None, first: asyncio.Event) -> None:
        if data is None:
            return
        try:
            assignments = ReplicaAssignments.decode(data)
        except WaltzError as e:
            log.error("unreadable replica assignments: %s", e)
            return
        sets: dict[int, list[str]] = {}
        for storage, pids in assignments.replicas.items():
            for pid in pids:
                sets.setdefault(pid, []).append(storage)
        self.replica_sets = {pid: tuple(sorted(s)) for pid, s in sets.items()}
        first.set()
        self._replicas_changed.set()

    async def _follow_replica_sets(self) -> None:
        while True:
            await self._replicas_changed.wait()
            self._replicas_changed.clear()
            async with self._reconcile_lock:
                for pid, part in self.partitions.items():
                    new = self.replica_sets.get(pid, ())
                    if new and new != part.store.replicas:
                        log.info("partition %d: replica set changed to %s", pid, list(new))
                        part.store.set_replicas(new)
            if self.member is not None:
                # Partitions that had no replicas before may be openable now.
                await self._reconcile(self.member.partitions)

    # -- health --

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy when ZooKeeper is connected and every partition we own takes appends. ``partitions`` maps
        each owned partition to whether it takes appends now; ``problems`` says why not, one line each."""
        zk_ok = bool(self.zk.connected) and not self._suspended
        problems: list[str] = []
        if self.failure is not None:
            problems.append(f"server failed: {self.failure!r}")
        if not zk_ok:
            problems.append("ZooKeeper connection suspended or lost: appends are held")
        parts: dict[str, bool] = {}
        for pid, p in sorted(self.partitions.items()):
            problem = p.problem
            parts[str(pid)] = problem is None and zk_ok
            if problem is not None:
                problems.append(f"partition {pid}: {problem}")
        # Replicas whose stored copies failed a read here (reads went elsewhere and a repair was started):
        # for operators and `waltz cluster verify`; they do not make the server unhealthy.
        damaged = {
            str(pid): dict(p.store.damaged_replicas)
            for pid, p in sorted(self.partitions.items())
            if p.store.damaged_replicas
        }
        conflicts = {
            str(pid): p.store.metadata_conflict
            for pid, p in sorted(self.partitions.items())
            if p.store.metadata_conflict
        }
        # Repairs of damage the storage nodes' scrub reported (running, or failed and waiting for their next
        # try): like damaged reads, they leave the partition served and the server healthy.
        repairs = {
            str(pid): p.store.repairs.health()
            for pid, p in sorted(self.partitions.items())
            if p.store.repairs.started
        }
        healthy = zk_ok and self.failure is None and all(parts.values())
        return healthy, {
            "zookeeper": zk_ok,
            "partitions": parts,
            "problems": problems,
            "damagedReplicaReads": damaged,
            "metadataConflicts": conflicts,
            "scrubRepairs": repairs,
        }

    # -- client connections --

    async def _load_transaction(self, partition_id: int, transaction_id: int) -> TransactionData:
        """The fetcher's loader: a committed transaction from the store (NotFound if there is none)."""
        part = self.partitions.get(partition_id)
        if part is None:
            raise PartitionNotReadyError(f"partition {partition_id} is not served here")
        return await part.load_transaction(transaction_id)

    async def _serve_client(self, conn: FramedConnection) -> None:
        peer = ClientConnection(
            conn, self.config.connection_max_in_flight, self.config.connection_max_response_bytes
        )
        version = conn.negotiated_version
        log.debug("client connection from %s opened (protocol version %d)", conn.peername, version)
        partitions = self.partitions
        decode = cs.decode
        # Appends are decoded to their fields (a tuple built in C), not to the message class.
        decode_append = cs.decode_append_fields
        append_type = _APPEND_REQUEST_TYPE
        append_cls = cs.AppendFields
        feed_request_cls = cs.FeedRequest
        dispatch = self._dispatch
        bursts = ReadBursts()

        def on_payload(payload: bytes) -> Awaitable[None] | None:
            """One message of the client, in order, from the transport's data callback (no task wake-up and
            no coroutine per socket read): None once handled, or the coroutine that handles it when it has
            to wait (reading pauses meanwhile, so the messages after it keep their order)."""
            try:
                msg = (
                    decode_append(payload, version) if payload[0] == append_type else decode(payload, version)
                )
            except RemoteProtocolError as e:
                raise BadMessage(e) from None
            if peer.client_id is None:
                peer.client_id = msg.req_id.client_id
            if bursts.pending and type(msg) is not append_cls and not conn.read_ahead:
                bursts.end()  # the read ends with another request
            if type(msg) is append_cls and not self._suspended:
                # Appends first, without a coroutine when nothing has to wait (nearly every message under
                # load is one): the partition takes it, refuses it, or says it must wait. The partition id is
                # the high half of the ReqId's lsb, read unsigned (no property call): it equals a key of ours
                # (0 <= id < 2**31) exactly when the signed id does.
                pid = msg.req_id[1] >> 32
                part = partitions.get(pid)
                if part is not None:
                    # read_ahead: more requests of this read come next, in this callback. An idle store
                    # writer then waits for the last of them, so a burst read in one go leaves as one batch
                    # (one request and one fsync per replica) while a lone append still leaves at once.
                    taken = part.append_nowait(peer, msg, more := conn.read_ahead)
                    bursts.took(part, more)
                    if taken:
                        return None
                    if taken is False:
                        if not peer.end_mount(pid):
                            raise CloseConnection(
                                f"AppendRequest for partition {pid}, never mounted on this connection"
                            )
                        return None
                    # None: it has to wait for room in the append queue: the general path does.
            elif type(msg) is feed_request_cls and not self._suspended:
                # The next feed window (one per window of ~a hundred commits under load), answered here as
                # _dispatch would: its coroutine made the read hand over to the serving task and pause.
                part = partitions.get(msg.req_id.partition_id)
                if part is None or not part.feed_request(peer, msg):
                    peer.send(cs.MountResponse(msg.req_id, cs.PartitionState.NOT_READY))
                return None
            return dispatch(peer, msg)

        try:
            await conn.serve_payloads(on_payload)
        except (BadMessage, CloseConnection) as e:
            _log_closing(conn, peer, e)
        finally:
            log.debug("client connection from %s (client %s) closed", conn.peername, peer.client_id)
            for part in self.partitions.values():
                part.disconnect(peer)

    async def _dispatch(self, peer: ClientConnection, msg: cs.Message | cs.AppendFields) -> None:
        rid = msg.req_id
        if isinstance(msg, cs.AppendFields | cs.AppendRequest):
            # Appends first: nearly every message under load is one.
            pid = rid.partition_id
            part = self.partitions.get(pid) if not self._suspended else await self._owned(pid)
            if not (part is not None and await part.append(peer, msg)) and not peer.end_mount(pid):
                raise CloseConnection(f"AppendRequest for partition {pid}, never mounted on this connection")
            return
        # Cluster-level queries first: they name no partition.
        if await self._cluster_request(peer, msg):
            return
        pid = rid.partition_id
        part = self.partitions.get(pid)
        # Reads of committed data need no current ownership proof: answer them even while suspended.
        if isinstance(msg, cs.TransactionDataRequest):
            await self._spawn_for(peer, self._transaction_data(peer, part, msg), f"data-{pid}")
            return
        if isinstance(msg, cs.TransactionRangeRequest | cs.HighWaterMarkRequest):
            if part is None:
                raise CloseConnection(
                    f"{type(msg).__name__} for partition {pid}, which this server does not own"
                )
            if rid.generation > part.generation:
                # The reader knows a newer owner than this incarnation (one being replaced here, or a store
                # fenced by that owner): the mark this one knows may be far below the log's end, and a reader
                # takes the mark for the end. Answered as for a partition not served: retriable.
                if isinstance(msg, cs.HighWaterMarkRequest):
                    peer.send(cs.HighWaterMarkResponse(rid, cs.HWM_NOT_SERVED))
                else:
                    peer.send_range(cs.TransactionRangeResponse(rid, msg.transaction_id, 0, b""))
            elif isinstance(msg, cs.HighWaterMarkRequest):
                if part.is_serving:
                    peer.send(cs.HighWaterMarkResponse(rid, part.high_water_mark))
                else:
                    self._spawn(self._high_water_mark(peer, part, msg), f"hwm-{pid}", peer)
            else:
                await self._spawn_for(peer, self._transaction_range(peer, part, msg), f"range-{pid}")
            return
        if isinstance(msg, cs.MountRequest):
            await self._mount(peer, msg)
            return
        if not isinstance(msg, cs.FeedRequest | cs.FlushRequest):
            raise CloseConnection(f"unexpected {type(msg).__name__} from a client")
        part = await self._owned(pid)
        if isinstance(msg, cs.FeedRequest):
            # A FeedRequest names its own mount session: answer on that one, which the client ignores if it
            # has mounted again since.
            if part is None or not part.feed_request(peer, msg):
                peer.send(cs.MountResponse(rid, cs.PartitionState.NOT_READY))
            return
        # A flush (appends were handled first, above).
        accepted = part is not None and part.accepts_flush(peer, rid)
        if part is not None and accepted:
            await self._spawn_for(peer, part.flush_request(peer, msg), f"flush-{pid}")
        if not accepted and not peer.end_mount(pid):
            raise CloseConnection(
                f"{type(msg).__name__} for partition {pid}, never mounted on this connection"
            )

    async def _mount(self, peer: ClientConnection, msg: cs.MountRequest) -> None:
        rid = msg.req_id
        pid = rid.partition_id
        peer.mounts[pid] = rid
        part = await self._owned(pid)
        if part is None:
            peer.mounts[pid] = None  # answered here: nothing more to end
            peer.send(cs.MountResponse(rid, cs.PartitionState.NOT_READY))
            return
        first, trim = msg.client_high_water_mark + 1, part.store.trim_point
        if first < trim and peer.send_trimmed(rid, first, trim):
            # The client needs what was trimmed: final for it (it bootstraps from a snapshot).
            peer.mounts[pid] = None
            log.warning(
                "partition %d: client %d mounts at %d, below the trim point %d",
                pid,
                rid.client_id,
                first - 1,
                trim,
            )
            return
        # Mounting waits for the append queue to drain; do it off this connection's read loop.
        await self._spawn_for(peer, part.mount(peer, msg), f"mount-{pid}")

    async def _cluster_request(self, peer: ClientConnection, msg: cs.Message) -> bool:
        """Answer ``msg`` if it is a cluster-level query (it names no partition); False if it is not one."""
        rid = msg.req_id
        if isinstance(msg, cs.CheckStorageConnectivityRequest):
            # Every storage node of the cluster, not only those this server has talked to (as the original).
            storages = {s for replicas in self.replica_sets.values() for s in replicas}
            reachable = await self.connector.probe(storages)
            peer.send(cs.CheckStorageConnectivityResponse(rid, tuple(reachable.items())))
        elif isinstance(msg, cs.ServerPartitionsAssignmentRequest):
            peer.send(cs.ServerPartitionsAssignmentResponse(rid, tuple(sorted(self.partitions))))
        elif isinstance(msg, cs.AddPreferredPartitionRequest | cs.RemovePreferredPartitionRequest):
            ok = await self._change_preferred(msg)
            resp_cls = (
                cs.AddPreferredPartitionResponse
                if isinstance(msg, cs.AddPreferredPartitionRequest)
                else cs.RemovePreferredPartitionResponse
            )
            peer.send(resp_cls(rid, ok))
        elif isinstance(msg, cs.ServerPartitionsHealthStatRequest):
            health = tuple((pid, p.is_healthy) for pid, p in sorted(self.partitions.items()))
            peer.send(cs.ServerPartitionsHealthStatResponse(rid, health))
        else:
            return False
        return True

    async def _spawn_for(self, peer: ClientConnection, coro: Any, name: str) -> None:
        """Run a request of ``peer`` in its own task, once one of its in-flight slots is free.

        Waiting for a slot holds up this connection's read loop: a peer with ``maxInFlight`` requests
        unanswered is not read until one is answered.
        """
        try:
            await peer.slots.acquire()
        except BaseException:
            coro.close()
            raise
        task = self._spawn(coro, name, peer)
        # The slot goes back however the task ends, even cancelled before it ran.
        task.add_done_callback(lambda _t: peer.slots.release())

    def _spawn(self, coro: Any, name: str, peer: ClientConnection | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` in a task the server owns (cancelled by :meth:`aclose`): a request of ``peer``, whose
        bug closes that peer's connection (:meth:`_request_failed`), or the server's own work (``peer``
        None), whose bug fails the server (:meth:`_task_failed`)."""
        handler = None if peer is None else functools.partial(self._request_failed, peer)
        return self._tasks.spawn(coro, name, handler)

    def _task_failed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        # A WaltzError is an answer the task gave up on (the store or the connection failed), logged where it
        # happened. Anything else is a bug: the server's own work failing fails the server, as its
        # followers do (/health reports it and run_server stops it).
        if not isinstance(error, WaltzError):
            self._fail(error, f"task {task.get_name()} failed")

    def _request_failed(self, peer: ClientConnection, task: asyncio.Task[Any], error: BaseException) -> None:
        # A bug in a client's request closes that client's connection: it reconnects and asks again rather
        # than wait for an answer that never comes. A WaltzError is an answer given up on (see above).
        if isinstance(error, WaltzError):
            return
        log.error(
            "request task %s failed; closing the connection of client %s",
            task.get_name(),
            peer.client_id,
            exc_info=error,
        )
        self._spawn(peer.aclose(), f"close-client-{peer.client_id}")

    async def _transaction_data(
        self, peer: ClientConnection, part: Partition | None, msg: cs.TransactionDataRequest
    ) -> None:
        rid = msg.req_id
        if part is None:
            peer.send(cs.TransactionDataResponse.failure(rid, msg.transaction_id, "partition not ready"))
            return
        try:
            found = await part.transaction_data(msg.transaction_id)
        except WaltzError as e:
            peer.send(cs.TransactionDataResponse.failure(rid, msg.transaction_id, str(e)))
            return
        if found is None:
            peer.send(cs.TransactionDataResponse.failure(rid, msg.transaction_id, "transaction not found"))
            return
        data, checksum = found
        self.metrics.read_bytes.labels(str(rid.partition_id)).inc(len(data))
        # The response's bytes count against the connection's budget until they left our write buffer.
        await peer.budget.acquire(len(data))
        try:
            peer.send(cs.TransactionDataResponse.success(rid, msg.transaction_id, data, checksum))
            await peer.drain()
        finally:
            peer.budget.release(len(data))

    async def _wait_serving(self, part: Partition) -> bool:
        """True once ``part`` serves reads (ready, its store session open), False if it does not within
        :data:`HWM_RECOVERY_WAIT_S` of its opening here or of the first read that found it not serving: a
        normal start or a new session fits in it, a lost quorum does not. Once that wait has run out with no
        session opened since, reads are answered at once (a reader retrying an unserved partition pays a round
        trip, not a wait each time)."""
        if part.is_serving:
            self._unserved.pop(part, None)
            return True
        now = time.monotonic()
        opened = part.store.stats.sessions_opened
        since, opened_then = self._unserved.get(part, (now, opened))
        if opened_then != opened:  # served in between, unread: this is a new gap
            since = now
        self._unserved[part] = (since, opened)
        wait_s = min(HWM_RECOVERY_WAIT_S, self.config.zookeeper_session_timeout_ms / 1000)
        try:
            async with asyncio.timeout(max(0.0, since + wait_s - now)):
                await part.wait_serving()
        except (TimeoutError, WaltzError):
            return False
        return True

    async def _high_water_mark(
        self, peer: ClientConnection, part: Partition, msg: cs.HighWaterMarkRequest
    ) -> None:
        """Answer once the partition serves: before its first session, its mark (-1) is not the log's, and
        after its session ended (quorum lost) the last mark it knew may not be either. If it does not serve
        within :data:`HWM_RECOVERY_WAIT_S`, answer :data:`~cs.HWM_NOT_SERVED`: the mark is unknown, and a
        reader must fail with a clear, retriable error rather than take the partition for an empty one (or one
        that ends at a stale mark) or wait out its whole request timeout for an answer that does not come."""
        served = await self._wait_serving(part)
        peer.send(cs.HighWaterMarkResponse(msg.req_id, part.high_water_mark if served else cs.HWM_NOT_SERVED))

    async def _transaction_range(
        self, peer: ClientConnection, part: Partition, msg: cs.TransactionRangeRequest
    ) -> None:
        count = max(0, min(msg.max_count, MAX_RANGE_RECORDS))
        trim_point = part.store.trim_point
        if 0 <= msg.transaction_id < trim_point and peer.send_trimmed(
            msg.req_id, msg.transaction_id, trim_point
        ):
            return  # A peer before codec V6 gets no answer, as before: the read fails in its timeout.
        # The run is relayed as the storage node sent it; the budget keeps the response well inside the frame
        # limit whatever the record sizes (a single record larger than it still goes: it was appended whole),
        # and within an eighth of the connection's response budget, so several reads proceed at once.
        budget = min(self.config.max_frame_bytes // 2, max(1, self.config.connection_max_response_bytes // 8))
        reserved = budget
        # Reserved before reading, so a peer that asks for many ranges and reads none of them holds at most
        # the connection's budget; what the run turns out to need stays reserved until it left our buffer.
        await peer.budget.acquire(reserved)
        try:
            if peer.closed:
                return
            # Not served (no open store session): answer with no records rather than not at all (the reader
            # would wait out its request timeout). No records is also how the end of the log reads, so readers
            # ask for the high-water mark next, which says HWM_NOT_SERVED. A partition that never opened
            # answers at once (the mark request does the waiting); one that was served waits here too, so a
            # new session (the checkpoint interval) does not read as the end of the log.
            got = 0
            run: RunBytes = b""
            if count and part.is_ready and await self._wait_serving(part):
                try:
                    got, run = await part.store.read_run(msg.transaction_id, count, budget)
                except WaltzError:
                    if part.is_serving:
                        raise
            if len(run) < reserved:
                peer.budget.release(reserved - len(run))
                reserved = len(run)
            if run:
                self.metrics.read_bytes.labels(str(msg.req_id.partition_id)).inc(len(run))
            peer.send_range(cs.TransactionRangeResponse(msg.req_id, msg.transaction_id, got, run))
            del run  # the write buffer holds the bytes now: one copy per reservation, not two
            await peer.drain()
        finally:
            peer.budget.release(reserved)

    async def _change_preferred(
        self, msg: cs.AddPreferredPartitionRequest | cs.RemovePreferredPartitionRequest
    ) -> bool:
        if self.member is None:
            return False
        ids = set(msg.partition_ids)
        if any(not 0 <= p < self.num_partitions for p in ids):
            return False
        current = set(self.member.preferred_partitions)
        new = current | ids if isinstance(msg, cs.AddPreferredPartitionRequest) else current - ids
        await self.member.set_preferred_partitions(new)
        return True


def _log_closing(conn: FramedConnection, peer: ClientConnection, error: BadMessage | CloseConnection) -> None:
    """Say why the server closes a client connection: a message that did not decode (rate-limited per source)
    or a request whose only honest answer is to close."""
    if isinstance(error, BadMessage):
        _peer_warnings.warning(
            conn.source,
            reason_kind("decode", error.error),
            "closing client connection from %s: %s",
            conn.peername,
            error.error,
        )
    else:
        log.info("closing the connection of client %s (%s): %s", peer.client_id, conn.peername, error)
