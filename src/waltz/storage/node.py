"""The storage node: serves the storage protocol (data port) and the admin protocol (admin port).

Guarantees:

* **Durability.** An append is answered with Success only after its records are fsynced. Appends that arrive
  while an fsync is running are written together and share the next fsync (group commit), so throughput
  does not collapse to one batch per fsync. The groups of different partitions waiting at the same time
  have their files fsynced in one hand-off to a thread (:class:`~waltz.storage.fsync.GroupSync`), each
  answered after its own file's fsync, or, for a batch of ``storage.fsync.syncfsMinFiles`` files or more
  where that is trusted, after one ``syncfs`` of the data directory's file system (``StorageNode.fs_sync``).
* **Order.** Requests for one partition are processed one at a time, in arrival order, by that partition's
  worker task; responses to one connection for one partition leave in the same order. An append that finds
  the worker idle with nothing queued anywhere (and fsyncs running on the loop), and no request read behind
  it on its connection, is written, fsynced and answered at once, in the transport callback that read it
  (``StoragePartition.commit_now``): the same steps the worker would take next, one loop pass and no task
  wake-up sooner. Appends read together go to the worker, which commits them as one group.
* **Fencing.** Each partition keeps an in-memory session id, initialised from the control file. On
  *arrival* of any data request its value becomes ``max(current, request.session_id)``; when the worker
  later processes the request it fails it with SessionFencedError unless ``request.session_id == current``.
  So the first message of a newer store session fences every older session, even requests already queued.
  With ZooKeeper configured, a session id above the newest one the cluster's metadata records for the
  partition is refused on arrival and fences nothing (see :mod:`waltz.storage.authority`): only a session
  that a server really took can fence, and so only such a session can persist a fence.
* **Permissions.** A partition must carry the ASSIGNED flag. A normal request needs AVAILABLE; an offline
  request (``offline=True``) needs AVAILABLE cleared and the *persisted* session id.
* **Back pressure.** Each partition queue and each connection's unanswered requests are bounded; when either
  is full the connection's reader stops reading from its socket, so TCP pushes back on the sender. A full
  partition queue gives each freed slot to the connection that has waited longest, so one that floods a
  partition does not starve the others. Read
  requests also reserve their largest response from the connection's ``maxResponseBytes`` budget until it is
  sent, and the reader takes no request while its unsent responses exceed the write buffer's high-water mark:
  a peer that asks and never reads holds at most about the budget, and is closed after the idle timeout.
* **Bad input** (malformed or oversized frames, unknown types, a wrong cluster key, requests before Open)
  gets a failure response or a closed connection with a logged reason; other connections are unaffected.
* **Disk faults fail-stop the partition, which heals itself.** A failed write or fsync (an I/O error, a full
  disk) *breaks* the partition: one ERROR line says why, nothing of the failed group is acknowledged, and
  every later request is refused, so the server writes through the other replicas and keeps retrying this
  one. At most every ``HEAL_INTERVAL_S`` (:mod:`waltz.storage.worker`), a request to a broken partition
  first tries to heal it, if the disk has ``HEAL_MIN_FREE_BYTES`` free: reopen the log (which repairs a torn
  tail, as a restart would), truncate it to the last id an fsync made durable (after a failed fsync the
  page cache may hold data the disk lost, and a later fsync may report success: nothing above that id can
  be trusted, and none of it was acknowledged), fsync. On success one INFO line says so and the partition
  serves again; the server's recovery then brings it up to date.
* **Preallocation.** With ``storage.segment.preallocateBytes`` > 0 each partition keeps its newest segment's
  data file zero-filled that far ahead of its last record: after a group's answers left, the worker writes
  the next chunk of zeros (on the loop: only this thread writes a partition's files, so zeros never land
  where an append goes), one chunk at a time, and the next group's fsync of the data file makes it
  durable with that group's records (no fsync of its own, so no fsync in a thread overlaps the groups and
  no second descriptor can consume the report of a writeback error). Appends then overwrite blocks already
  written and fsynced, and their fsync needs no journal commit of the file's size (see
  :mod:`waltz.storage.segment`). A failed zero write (a full disk) leaves the records alone: one WARNING
  line, a metric, and no preallocation for ``PREALLOCATE_RETRY_S``. A failed fsync that carried zeros breaks
  the partition as any failed group fsync does.
* **Failures are heard.** A broken partition, or one whose worker hit a bug (``failed``: it refuses
  everything until the node restarts and answers each request with a failure instead of leaving it
  queued), is reported by ``/health`` (503, with the reason per partition). The node owns its background
  tasks (a :class:`~waltz.runtime.TaskSet`): a worker that ends for any reason but the node's close marks its
  partition failed and answers what was queued; a failed scrub is reported by ``/health`` under ``tasks``.

The admin port mutates partitions (assign, unassign, availability) through the same partition queues, so an
admin change is ordered with respect to data requests.

Where it lives: this module holds the node (its parts, start, health, close, responses);
:mod:`~waltz.storage.worker` a partition and its worker (checks, health state, group commit, healing),
:mod:`~waltz.storage.handlers` the worker's answer to each request other than an append,
:mod:`~waltz.storage.work` the queued items and queues, :mod:`~waltz.storage.fsync` where fsyncs run,
:mod:`~waltz.storage.data_port` and :mod:`~waltz.storage.admin_port` the two ports,
:mod:`~waltz.storage.scrub` the background verification, :mod:`~waltz.storage.metrics` the metrics, and
:mod:`~waltz.storage.startup` the process's start (cluster identity, ZooKeeper, the stop signal).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from waltz.errors import ClusterKeyMismatchError, ConnectionError_, PartitionNotAssignedError
from waltz.http import HttpEndpoint, listen, new_registry
from waltz.protocol import admin as adm
from waltz.protocol import storage as st
from waltz.protocol.framing import MAGIC_ADMIN, MAGIC_STORAGE
from waltz.runtime import TaskSet
from waltz.storage.admin_port import serve_admin
from waltz.storage.authority import SessionAuthority
from waltz.storage.config import StorageConfig
from waltz.storage.controlfile import ControlFile
from waltz.storage.data_port import serve_data
from waltz.storage.fileio import OS_FS, FileSystem, FsSync
from waltz.storage.fsync import FsyncPolicy, GroupSync
from waltz.storage.handlers import HANDLERS
from waltz.storage.index_writes import FlushedIndexWrites
from waltz.storage.metrics import AppendCounters, Metrics, directory_bytes, free_bytes
from waltz.storage.scrub import scrub_forever
from waltz.storage.work import Item, Tally
from waltz.storage.worker import StoragePartition
from waltz.tls import TlsConfig
from waltz.transport import FramedConnection, FramedServer, serve

log = logging.getLogger(__name__)


class StorageNode:
    """A storage node: control file, partitions, data port, admin port and optional HTTP port.

    Use ``await StorageNode.start(config, key, num_partitions)``; ``await node.aclose()`` stops everything it
    started. ``key``/``num_partitions`` come from ZooKeeper (see :func:`load_cluster_identity`) or the config.
    """

    def __init__(
        self,
        config: StorageConfig,
        control: ControlFile,
        authority: SessionAuthority | None = None,
        *,
        fs: FileSystem = OS_FS,
        fsync: FsyncPolicy | None = None,
    ) -> None:
        self.config = config
        self.control = control
        self.authority = authority
        """Checks new session ids against the cluster's metadata; None (no ZooKeeper) trusts every peer."""
        self.fs = fs
        """The file layer of the partitions' logs (tests inject one that fails, see ``waltz.testing``)."""
        self.fsync = fsync if fsync is not None else FsyncPolicy()
        """Where group-commit fsyncs run (on the loop or in a thread); shared by the partitions."""
        self.registry = new_registry()
        self.metrics = Metrics(self.registry, control.num_partitions)
        self.queued = Tally()
        """Requests queued in all partitions (see ``StoragePartition._fsync``)."""
        self.fs_sync: FsSync | None = None
        """The descriptor on the data directory for ``syncfs`` (see :meth:`_open_fs_sync`); None: never."""
        self.fs_sync_mode = "fdatasync per file"
        if config.syncfs_min_files > 0:
            self.fs_sync, self.fs_sync_mode = fs.open_fs_sync(str(config.directory))
        else:
            self.fs_sync_mode += ": storage.fsync.syncfsMinFiles is 0"
        self.group_sync = GroupSync(
            self.fsync, self.queued, fs_sync=self.fs_sync, syncfs_min_files=config.syncfs_min_files
        )
        """The partitions' group fsyncs, several files to one hand-off to a thread (see ``_fsync``)."""
        self.index_writes = FlushedIndexWrites()
        """The index entries the group fsyncs made due, written together a little later."""
        self.handlers = HANDLERS
        self.partitions = [StoragePartition(self, pid) for pid in range(control.num_partitions)]
        self._register_gauges()
        self.tasks = TaskSet(self._task_failed)
        """The node's background tasks: the partition workers and the scrub."""
        self.task_failures: dict[str, str] = {}
        """Background tasks other than workers that failed -> why (on /health until the node restarts)."""
        self.task_failed = asyncio.Event()
        """Set when a background task failed (a worker or another)."""
        self._data_server: FramedServer | None = None
        self._admin_server: FramedServer | None = None
        self._http: HttpEndpoint | None = None
        self._closing = False
        self.port = 0
        self.admin_port = 0
        self.http_port = 0

    def _register_gauges(self) -> None:
        self.registry.register(AppendCounters(lambda: self.partitions, self.group_sync, self.index_writes))
        directory = str(self.config.directory)
        self.metrics.disk_bytes.set_function(lambda: directory_bytes(directory))
        self.metrics.disk_free_bytes.set_function(lambda: free_bytes(directory))
        self.metrics.partitions_assigned.set_function(
            lambda: sum(1 for p in self.partitions if p.info.assigned)
        )
        self.metrics.partitions_available.set_function(
            lambda: sum(1 for p in self.partitions if p.info.assigned and p.info.available)
        )
        self.metrics.damaged_replicas.set_function(
            lambda: len(
                {p.partition_id for p in self.partitions if p.lost is not None} | set(self.control.damaged)
            )
        )
        self.metrics.damaged_records.set_function(lambda: sum(len(p.damaged) for p in self.partitions))
        self.metrics.partitions_unhealthy.set_function(lambda: len(self.health()[1]["partitions"]))

    @classmethod
    async def start(
        cls,
        config: StorageConfig,
        key: uuid.UUID,
        num_partitions: int,
        authority: SessionAuthority | None = None,
        *,
        fs: FileSystem = OS_FS,
    ) -> StorageNode:
        server_ssl = config.tls.server_context("storage config")  # Before touching any file.
        control = await asyncio.to_thread(
            ControlFile.open_or_create, str(config.directory), key, num_partitions, fs=fs
        )
        node = cls(control=control, config=config, authority=authority, fs=fs)
        try:
            for p in node.partitions:
                if p.info.assigned:
                    await asyncio.to_thread(p.open_log)
            for p in node.partitions:
                worker_failed = functools.partial(node._worker_failed, p)
                node.tasks.spawn(p.run(), f"storage-partition-{p.partition_id}", worker_failed)
            if config.scrub_bytes_per_second > 0:
                node.tasks.spawn(scrub_forever(node), "storage-scrub")
            await node._listen(server_ssl)
        except BaseException:
            await node.aclose()
            raise
        log.info(
            "storage node serving %s: data port %d, admin port %d, %d partitions%s",
            config.directory,
            node.port,
            node.admin_port,
            num_partitions,
            _tls_note(config.tls),
        )
        log.info("storage node group commits: %s%s", node.fs_sync_mode, _syncfs_note(node))
        return node

    async def _listen(self, server_ssl: ssl.SSLContext | None) -> None:
        """Open the data port, the admin port and (if configured) the HTTP port."""
        config = self.config

        def server(port: int, handler: Callable[[FramedConnection], Awaitable[None]], admin: bool) -> Any:
            return serve(
                config.host,
                port,
                handler,
                magic=MAGIC_ADMIN if admin else MAGIC_STORAGE,
                versions=adm.ADMIN_VERSIONS if admin else st.STORAGE_VERSIONS,
                hello_text=adm.ADMIN_SERVER_HELLO if admin else st.STORAGE_SERVER_HELLO,
                max_frame_bytes=config.max_frame_bytes,
                max_connections=config.max_connections,
                max_connections_per_source=config.max_connections_per_source,
                idle_timeout_s=config.connection_idle_timeout_ms / 1000,
                ssl=server_ssl,
            )

        self._data_server = await listen(
            "storage.port",
            config.host,
            config.port,
            lambda: server(config.port, functools.partial(serve_data, self), False),
        )
        self.port = self._data_server.port
        self._admin_server = await listen(
            "storage.admin.port",
            config.host,
            config.admin_port,
            lambda: server(config.admin_port, functools.partial(serve_admin, self), True),
        )
        self.admin_port = self._admin_server.port
        if config.http_port:
            self._http = HttpEndpoint(self.registry, self.health)
            self.http_port = await self._http.start(config.host, config.http_port, "storage.http.port")

    def _task_failed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        """A background task other than a worker (the scrub) failed: one ERROR line, and /health reports
        it until the node restarts."""
        if self._closing:
            return
        self.task_failures[task.get_name()] = f"failed: {error!r}"
        self.task_failed.set()
        log.error(
            "storage node: background task %s failed; /health reports it until the node restarts",
            task.get_name(),
            exc_info=error,
        )

    def _worker_failed(self, part: StoragePartition, task: asyncio.Task[Any], error: BaseException) -> None:
        """A partition's worker ended: the partition fails and answers what it holds."""
        if self._closing:
            return
        self.task_failed.set()
        part.worker_gone = True
        part.fail(f"worker ended: {error!r}", error)
        # Nobody takes from this queue any more: answer what it was on and what is queued now; ``enqueue``
        # answers later ones.
        if part.current is not None:
            part.answer_failed(part.current)
        while part.queue.peek() is not None:
            part.answer_failed(part.queue.pop())

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy when no partition failed, is fail-stopped or holds a damaged replica, and no background
        task (the scrub) failed; ``partitions`` and ``tasks`` say which, and why.

        Damaged records not repaired yet, and partitions whose control-file entry is damaged, are listed
        too (for operators and ``waltz cluster verify``); a damaged control entry takes its partition down.
        """
        problems = {str(p.partition_id): p.problem for p in self.partitions if p.problem is not None}
        transactions, entries = self.damage_report()
        for pid, why in entries.items():
            problems[pid] = f"control file entry damaged: {why}"
        tasks = dict(self.task_failures)
        healthy = not problems and not tasks
        return healthy, {
            "storage": "ok" if healthy else "degraded",
            "partitions": problems,
            "tasks": tasks,
            "damagedTransactions": transactions,
            "damagedControlEntries": entries,
        }

    def damage_report(self) -> tuple[dict[str, list[int]], dict[str, str]]:
        """The damage this node knows of, as /health and the admin metrics both show it: per partition the
        stored ids found damaged and not repaired yet (partitions with none are left out), and per partition
        why its control-file entry is damaged."""
        transactions = {str(p.partition_id): sorted(p.damaged) for p in self.partitions if p.damaged}
        entries = {str(pid): why for pid, why in sorted(self.control.damaged.items())}
        return transactions, entries

    async def aclose(self) -> None:
        """Stop serving and close every file; idempotent."""
        self._closing = True
        for server in (self._data_server, self._admin_server):
            if server is not None:
                await server.aclose()
        if self._http is not None:
            await self._http.aclose()
        await self.tasks.aclose()  # a worker that died was reported by _worker_failed already
        # An fsync a cancelled worker handed off may still run: it finishes before its file is closed.
        await asyncio.to_thread(self.fsync.close)
        self.index_writes.close()  # closing the logs writes every entry
        for p in self.partitions:
            p.close_log()
        if self.fs_sync is not None:
            self.fs_sync.close()
        self.control.close()

    async def on_partition(self, pid: int, op: Callable[[], Any]) -> Any:
        """Run ``op`` in partition ``pid``'s worker, ordered with its data requests."""
        if not 0 <= pid < len(self.partitions):
            raise PartitionNotAssignedError(f"Partition:{pid} does not exist.")
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self.partitions[pid].enqueue(Item(None, None, op=op, done=done))
        return await done

    def check_identity(self, key: uuid.UUID, num_partitions: int) -> None:
        """Refuse a peer (ClusterKeyMismatchError) that names another cluster than this node's."""
        if key != self.control.key:
            raise ClusterKeyMismatchError(f"cluster key {key} does not match this node's {self.control.key}")
        if num_partitions != self.control.num_partitions:
            raise ClusterKeyMismatchError(
                f"number of partitions {num_partitions} does not match this node's "
                f"{self.control.num_partitions}"
            )

    # -- responses ---------------------------------------------------------------------------------

    def respond(self, item: Item, resp: st.StorageMessage) -> None:
        if type(resp) is st.RecordRunResponse and resp.run:
            # A range read's run (megabytes) leaves as it was read, not copied into a payload and a frame.
            self.send_payload(
                item,
                st.record_run_response_parts(
                    resp.session_id, resp.seq_num, resp.partition_id, resp.count, resp.run
                ),
            )
            return
        self.send_payload(item, st.encode(resp))

    def send_payload(self, item: Item, payload: bytes | tuple[bytes, bytes | bytearray | memoryview]) -> None:
        """Send the encoded response to ``item`` (a payload, or a head and a body to send after it without
        joining them) and release what the request held."""
        if item.slot is not None:
            item.slot.release()
        if item.reserved and item.budget is not None:
            # From here on the reader's drain bounds these bytes (it reads nothing while they pile up).
            item.budget.release(item.reserved)
        conn = item.conn
        if conn is None or conn.is_closed:
            return
        try:
            if isinstance(payload, tuple):
                conn.send(*payload)
            else:
                conn.send(payload)
        except ConnectionError_:
            pass  # the peer is gone; it learns nothing more from us


def _syncfs_note(node: StorageNode) -> str:
    if node.fs_sync is None:
        return ""
    return f" for batches of >= {node.config.syncfs_min_files} files, fdatasync per file below"


def _tls_note(tls: TlsConfig) -> str:
    if not tls.enabled:
        return ""
    return ", TLS with client certificates" if tls.ca_file else ", TLS"
