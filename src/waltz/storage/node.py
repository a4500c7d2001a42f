"""The storage node: serves the storage protocol (data port) and the admin protocol (admin port).

Guarantees:

* **Durability.** An append is answered with Success only after its records are fsynced. Appends that arrive
  while an fsync is running are written together and share the next fsync (group commit), so throughput
  does not collapse to one batch per fsync.
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
  one. At most every :data:`HEAL_INTERVAL_S`, a request to a broken partition first tries to heal it, if the
  disk has :data:`HEAL_MIN_FREE_BYTES` free: reopen the log (which repairs a torn tail, as a restart
  would), truncate it to the last id an fsync made durable (after a failed fsync the page cache may hold
  data the disk lost, and a later fsync may report success: nothing above that id can be trusted, and
  none of it was acknowledged), fsync. On success one INFO line says so and the partition serves again;
  the server's recovery then brings it up to date.
* **Preallocation.** With ``storage.segment.preallocateBytes`` > 0 each partition keeps its newest segment's
  data file zero-filled that far ahead of its last record: after a group's answers left, the worker writes
  the next chunk of zeros (on the loop: only this thread writes a partition's files, so zeros never land
  where an append goes), one chunk at a time, and the next group's fsync of the data file makes it
  durable with that group's records (no fsync of its own, so no fsync in a thread overlaps the groups and
  no second descriptor can consume the report of a writeback error). Appends then overwrite blocks already
  written and fsynced, and their fsync needs no journal commit of the file's size (see
  :mod:`waltz.storage.segment`). A failed zero write (a full disk) leaves the records alone: one WARNING
  line, a metric, and no preallocation for :data:`PREALLOCATE_RETRY_S`. A failed fsync that carried zeros
  breaks the partition as any failed group fsync does.
* **Failures are heard.** A broken partition, or one whose worker hit a bug (``failed``: it refuses
  everything until the node restarts and answers each request with a failure instead of leaving it
  queued), is reported by ``/health`` (503, with the reason per partition). The node owns its workers: one
  that ends for any reason but the node's close marks its partition failed and answers what was queued.

The admin port mutates partitions (assign, unassign, availability) through the same partition queues, so an
admin change is ordered with respect to data requests.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import functools
import itertools
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from waltz.errors import (
    ClosedResourceError,
    ClusterKeyMismatchError,
    ConnectionError_,
    CorruptionError,
    PartitionNotAssignedError,
    RemoteProtocolError,
    SessionFencedError,
    StorageError,
    TransactionOutOfOrderError,
    WaltzError,
)
from waltz.http import HttpEndpoint, build_info, listen, new_registry
from waltz.protocol import admin as adm
from waltz.protocol import storage as st
from waltz.protocol.framing import MAGIC_ADMIN, MAGIC_STORAGE
from waltz.runtime import tune_gc, tune_malloc, wait_for_stop_signal
from waltz.storage.authority import SessionAuthority, ZkSessionAuthority, step_refusal
from waltz.storage.config import StorageConfig
from waltz.storage.controlfile import FLAG_AVAILABLE, FLAG_DAMAGED, ControlFile, PartitionInfo
from waltz.storage.fileio import FAULTS, OS_FS
from waltz.storage.partition import PartitionLog, delete_log_files
from waltz.storage.replica_check import lost_below_mark, missing_log, truncation_refusal
from waltz.storage.segment import (
    RecordCorruptionError,
    ZeroFill,
    append_wire_run,
    encode_stored_run,
    verify_client_checksums,
)
from waltz.tls import TlsConfig, peer_common_name
from waltz.transport import (
    ByteBudget,
    FramedConnection,
    FramedServer,
    RateLimitedLog,
    reason_kind,
    serve,
)

log = logging.getLogger(__name__)
_peer_warnings = RateLimitedLog(log)

HEAL_INTERVAL_S = 1.0
"""Least time between two attempts to heal a broken partition."""
HEAL_MIN_FREE_BYTES = 1 << 20
"""Free space the data directory needs before a broken partition tries to heal (so a full disk does not
make it flap between healed and broken)."""
INLINE_FSYNC_LIMIT_S = 0.02
"""An fsync on the event loop slower than this sends the next ones to a thread (see ``_fsync``)."""
INLINE_FSYNC_BACKOFF_S = 10.0
"""The longest time fsyncs stay in threads after a slow one on the loop (see ``_fsync_inline``)."""
INLINE_FSYNC_FIRST_BACKOFF_S = 1.0
"""How long fsyncs stay in threads after a slow one that follows none in the last ``INLINE_FSYNC_RESET_S``;
each slow one within that time doubles it, up to ``INLINE_FSYNC_BACKOFF_S``."""
INLINE_FSYNC_RESET_S = 60.0
FSYNC_THREADS = 4
"""Threads for the fsyncs not run on the loop (fsyncs of several partitions overlap on the disk)."""
PREALLOCATE_RETRY_S = 60.0
"""After a failed write of preallocated zeros (a full disk, say), how long a partition writes none."""
FAULTS_ENV = "WALTZ_TEST_FAULTS"
"""Test-only: with this set to 1, SIGUSR1 makes the node's next data-file fsync fail (see run_node)."""

MAX_LIST_RECORDS = 10_000
"""Largest record list one request may ask for; larger requests are answered with at most this many."""
MAX_LIST_BYTES = 8 * 1024 * 1024
"""A list response stops after this many data bytes (always at least one record), to bound frames."""
SESSION_CHECK_TIMEOUT_S = 10.0
"""How long a request with a new session id waits for ZooKeeper to confirm it before it is refused."""
SESSION_RECHECK_INTERVAL_S = 0.2
"""After a refusal, higher ids are refused without asking ZooKeeper again for this long (bounds the reads a
peer sending forged ids can cause; a real new session retries after its back-off and passes)."""
REFUSAL_LOG_INTERVAL_S = 10.0
"""At most one warning per partition per this many seconds about refused session ids (and one ERROR line
about refused truncations)."""
SCRUB_CHUNK_BYTES = 256 * 1024
"""Bytes one scrub step reads (in the partition's worker, between its requests: small, so writes barely
wait)."""
MAX_DAMAGED_REPORTED = 1000
"""Damaged transaction ids remembered per partition (for metrics, /health and ``cluster verify``)."""
RECORD_RESPONSE_ESTIMATE_BYTES = 1024 * 1024
"""What a single-record read reserves from its connection's response budget (its size is unknown before)."""
HEADER_ESTIMATE_BYTES = 64
"""What one record header in a header list reserves (a header is about 40 bytes on the wire)."""


def _response_estimate(msg: st.StorageMessage) -> int:
    """The bytes a read request's response may take, reserved from the connection's budget (0: small)."""
    if isinstance(msg, st.RecordRunRequest):
        return max(0, min(msg.max_bytes, MAX_LIST_BYTES))
    if isinstance(msg, st.RecordListRequest):
        return MAX_LIST_BYTES
    if isinstance(msg, st.RecordRequest):
        return RECORD_RESPONSE_ESTIMATE_BYTES
    if isinstance(msg, st.RecordHeaderListRequest):
        return max(0, min(msg.max_records, MAX_LIST_RECORDS)) * HEADER_ESTIMATE_BYTES
    return 0


class _InFlight:
    """A connection's unanswered requests, at most ``capacity``: taken without a coroutine while there is
    room (:meth:`try_acquire`), waited for in arrival order when there is none (:meth:`acquire`)."""

    __slots__ = ("_freed", "capacity", "count")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count = 0
        self._freed: asyncio.Event | None = None

    def try_acquire(self) -> bool:
        if self.count >= self.capacity:
            return False
        self.count += 1
        return True

    async def acquire(self) -> None:
        # One connection's requests are admitted by its one serving task, so there is one waiter at most.
        while self.count >= self.capacity:
            freed = self._freed = asyncio.Event()
            await freed.wait()
        self.count += 1

    def release(self) -> None:
        self.count -= 1
        freed = self._freed
        if freed is not None:
            self._freed = None
            freed.set()


@dataclass(slots=True)
class _Item:
    """One queued unit of work for a partition worker."""

    msg: st.StorageMessage | None
    conn: FramedConnection | None
    op: Callable[[], Any] | None = None
    done: asyncio.Future[Any] | None = None
    slot: _InFlight | None = None
    arrived_s: float = 0.0
    budget: ByteBudget | None = None
    reserved: int = 0
    """Bytes of ``budget`` this request's response holds until it is handed to the connection."""


class _FsyncThreads:
    """A few long-lived threads running the fsyncs handed to them from the event loop (see
    ``StoragePartition._fsync``), started on first use and stopped by :meth:`close`.

    Cheaper per hand-off than ``asyncio.to_thread``, which was ~230 us of the loop thread's CPU per fsync in a
    profile (a context copy, an executor work item and a concurrent future chained to an asyncio one by
    callbacks both ways): here one ``SimpleQueue.put`` out and one ``call_soon_threadsafe`` back. Each
    partition has at most one group fsync in flight, so the queue holds at most one job per partition.
    """

    def __init__(self, threads: int) -> None:
        self._size = threads
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], asyncio.Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []

    def run(self, fn: Callable[[], None]) -> asyncio.Future[None]:
        """Run ``fn`` in one of the threads; the future resolves on the loop when it returned or raised."""
        loop = asyncio.get_running_loop()
        if not self._threads:
            for i in range(self._size):
                thread = threading.Thread(
                    target=self._serve, args=(loop,), name=f"storage-fsync-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        done: asyncio.Future[None] = loop.create_future()
        self._jobs.put((fn, done))
        return done

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            error: BaseException | None = None
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting partition worker
                error = e
            try:
                loop.call_soon_threadsafe(_settle, done, error)
            except RuntimeError:
                pass  # the loop closed meanwhile: nobody waits for this fsync any more

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the threads after the jobs already queued (each waits at most ``timeout_s``)."""
        threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join(timeout_s)


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():  # the waiting worker was cancelled (the node is closing)
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


class _Tally:
    """A count shared by the partition queues of a node: the requests queued in all of them."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items = 0


class _BoundedQueue:
    """A FIFO with a capacity and peeking, which asyncio.Queue lacks (group commit needs to look ahead).

    Fair to producers: when the queue is full, producers wait in arrival order and each freed slot goes to
    the one that has waited longest (its item moves in as the slot frees), so a connection that floods a
    partition cannot keep taking the slots another connection is waiting for.
    """

    def __init__(self, capacity: int, tally: _Tally | None = None) -> None:
        self._items: collections.deque[_Item] = collections.deque()
        self._capacity = capacity
        self._tally = tally if tally is not None else _Tally()
        """Counts the items of every queue sharing it (the node's: see ``StoragePartition._fsync``)."""
        self._not_empty = asyncio.Event()
        self._putters: collections.deque[tuple[_Item, asyncio.Future[None]]] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item: _Item) -> bool:
        """Queue ``item`` if there is room and no producer is waiting; False (nothing queued) otherwise."""
        if self._putters or len(self._items) >= self._capacity:
            return False
        self._items.append(item)
        self._tally.items += 1
        self._not_empty.set()
        return True

    async def put(self, item: _Item) -> None:
        if self.put_nowait(item):
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (item, waiter)
        self._putters.append(entry)
        try:
            await waiter  # pop() moves the item in before it resolves this
        except BaseException:
            if not waiter.done() or waiter.cancelled():
                with contextlib.suppress(ValueError):
                    self._putters.remove(entry)
            raise

    async def get(self) -> _Item:
        while not self._items:
            self._not_empty.clear()
            await self._not_empty.wait()
        return self.pop()

    def peek(self) -> _Item | None:
        return self._items[0] if self._items else None

    def pop(self) -> _Item:
        item = self._items.popleft()
        self._tally.items -= 1
        while self._putters and len(self._items) < self._capacity:
            waiting, waiter = self._putters.popleft()
            if waiter.done():  # cancelled while waiting: its item never goes in
                continue
            self._items.append(waiting)
            self._tally.items += 1
            waiter.set_result(None)
        return item


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        # Appends counted from 0 at start (as the Counter's child made up front was): an idle node's rate is
        # 0 rather than missing, and increase() sees the first appends.
        self.requests = _RequestCounts(("AppendRequest",))
        registry.register(self.requests)
        self.failures = Counter("waltz_storage_failures", "Failure responses", ["error"], registry=registry)
        self.append_latency = _Latency(
            "waltz_storage_append_seconds",
            "Time from an append's arrival to its acknowledgement",
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
        )
        registry.register(self.append_latency)
        self.max_txn = Gauge(
            "waltz_storage_max_transaction_id", "Max transaction id", ["partition"], registry=registry
        )
        self.session = Gauge(
            "waltz_storage_session_id", "Fencing session id", ["partition"], registry=registry
        )
        self.queue = Gauge("waltz_storage_queue_size", "Queued requests", ["partition"], registry=registry)
        self.connections = Gauge("waltz_storage_connections", "Open data connections", registry=registry)
        self.corrupt_records = Counter(
            "waltz_storage_corrupt_records",
            "Stored records found damaged (checksum, id or length) by a read",
            ["partition"],
            registry=registry,
        )
        self.repaired_records = Counter(
            "waltz_storage_repaired_records",
            "Damaged records overwritten with a good copy from another replica",
            ["partition"],
            registry=registry,
        )
        self.refused_peers = Counter(
            "waltz_storage_refused_peers",
            "Connections refused because the peer certificate is not in storage.ssl.allowedPeers",
            ["port"],
            registry=registry,
        )
        self.refused_sessions = Counter(
            "waltz_storage_refused_session_ids",
            "Requests refused for a session id the cluster's metadata never handed out",
            ["partition"],
            registry=registry,
        )
        self.read_bytes = Counter(
            "waltz_storage_read_bytes",
            "Data bytes of records read by servers",
            ["partition"],
            registry=registry,
        )
        self.disk_bytes = Gauge(
            "waltz_storage_disk_bytes", "Bytes of the files in the storage directory", registry=registry
        )
        self.disk_free_bytes = Gauge(
            "waltz_storage_disk_free_bytes",
            "Bytes free on the file system of the storage directory",
            registry=registry,
        )
        self.partitions_assigned = Gauge(
            "waltz_storage_partitions_assigned", "Partitions assigned to this node", registry=registry
        )
        self.partitions_available = Gauge(
            "waltz_storage_partitions_available",
            "Assigned partitions that are available (online)",
            registry=registry,
        )


class _Latency(Collector):
    """A histogram observed once per group commit and exported when scraped, as a prometheus Histogram of the
    same name and buckets would be: a Histogram's ``observe`` (a lock, a Python loop over the buckets, two
    counter updates) was the costliest metric update on the append path; this one is a bisect and two adds.
    Single event loop; no locking."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def collect(self) -> Iterable[Metric]:
        cumulative = list(itertools.accumulate(self._counts))
        buckets = [(repr(b), c) for b, c in zip(self._bounds, cumulative, strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        family = HistogramMetricFamily(self._name, self._documentation)
        family.add_metric([], buckets, self._sum)
        yield family


class _RequestCounts(Collector):
    """``waltz_storage_requests_total{type}``: requests processed, counted in a dict and exported when scraped
    (a prometheus Counter's ``inc`` takes a lock and four calls, on the path of every append group)."""

    def __init__(self, kinds: Iterable[str] = ()) -> None:
        self.counts: dict[str, int] = dict.fromkeys(kinds, 0)

    def inc(self, kind: str, n: int = 1) -> None:
        counts = self.counts
        counts[kind] = counts.get(kind, 0) + n

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily("waltz_storage_requests", "Requests processed", labels=["type"])
        for kind, n in sorted(self.counts.items()):
            family.add_metric([kind], n)
        yield family


class _AppendCounters(Collector):
    """``waltz_storage_appended_records``, ``_appended_bytes`` and ``_fsyncs``, read from the partitions'
    plain counts when scraped. A prometheus Counter takes a lock and a few calls per update: three per group
    commit were the largest part of the metrics' cost on the path of a lone append."""

    def __init__(self, partitions: Callable[[], list[StoragePartition]]) -> None:
        self._partitions = partitions

    def collect(self) -> Iterable[Metric]:
        records = CounterMetricFamily(
            "waltz_storage_appended_records", "Records appended", labels=["partition"]
        )
        data = CounterMetricFamily(
            "waltz_storage_appended_bytes", "Data bytes of records appended", labels=["partition"]
        )
        extending = CounterMetricFamily(
            "waltz_storage_extending_writes",
            "Group writes that reached past the data file's fsynced zeros (each of them with "
            "storage.segment.preallocateBytes 0): their fsync also commits the file's new size",
            labels=["partition"],
        )
        fsyncs = threaded = zero_bytes = zero_failures = 0
        for p in self._partitions():
            records.add_metric([str(p.partition_id)], p.appended_records)
            data.add_metric([str(p.partition_id)], p.appended_bytes)
            extending.add_metric([str(p.partition_id)], p.extending_writes)
            fsyncs += p.fsync_count
            threaded += p.threaded_fsync_count
            zero_bytes += p.preallocated_bytes
            zero_failures += p.preallocate_failures
        yield records
        yield data
        yield extending
        yield CounterMetricFamily(
            "waltz_storage_preallocated_bytes",
            "Zeros written ahead of the newest segments' last records (made durable by the next group fsync)",
            value=zero_bytes,
        )
        yield CounterMetricFamily(
            "waltz_storage_preallocate_failures",
            "Writes of preallocated zeros that failed (a full disk): records are not affected",
            value=zero_failures,
        )
        yield CounterMetricFamily("waltz_storage_fsyncs", "Group-commit fsyncs", value=fsyncs)
        yield CounterMetricFamily(
            "waltz_storage_fsyncs_in_thread",
            "Group-commit fsyncs run in a thread (a slow disk, or other partitions busy), not on the loop",
            value=threaded,
        )


def directory_bytes(directory: str) -> int:
    """Total size of the files under ``directory`` (read when /metrics is scraped: a few dozen files per
    partition, so cheap next to a scrape interval)."""
    total = 0
    stack = [directory]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue  # removed while we looked
    return total


def _free_bytes(directory: str) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


class StoragePartition:
    """One partition on this node: its log (if assigned), fencing session id, queue and worker."""

    def __init__(self, node: StorageNode, partition_id: int) -> None:
        self.node = node
        self.partition_id = partition_id
        self.log: PartitionLog | None = None
        info = node.control.partition_info(partition_id)
        self.session_id = info.session_id
        self.verified_session_id = info.session_id
        """The highest session id the cluster's metadata is known to have handed out (see authority.py)."""
        self.damaged: dict[int, str] = {}
        """Transaction ids whose stored copy failed verification here and was not repaired yet -> reason."""
        self.lost: str | None = None
        """Why this replica is damaged (it lost records it held; see waltz.storage.replica_check), or None.
        Set together with the control file's DAMAGED flag, cleared by ``_check_repaired``."""
        self._marked_since_lost = False
        """A low-water mark was set since the damage was found (the repair's target; see replica_check)."""
        self._last_truncate_refusal_log_s = -1e9
        self.session_check = asyncio.Lock()
        self.last_refusal_s = -1e9
        self.last_refusal_log_s = -1e9
        self.queue = _BoundedQueue(node.config.partition_queue_size, node.queued)
        self.fsync_count = 0
        self.threaded_fsync_count = 0
        """Of ``fsync_count``, those run in a thread (see ``_fsync``)."""
        self.appended_records = 0
        self.appended_bytes = 0
        """Records and data bytes appended and fsynced (exported by ``_AppendCounters``)."""
        self.broken: str | None = None
        """Set after a failed write or fsync: the partition is fail-stopped until it heals (``_heal``)."""
        self.durable_max = -1
        """The highest id an fsync (or a truncation, which syncs) made durable: healing truncates to it."""
        self._next_heal_s = 0.0
        self.failed: str | None = None
        """Set when the worker hit a bug: the partition then refuses every request (see ``run``)."""
        self._zeros: ZeroFill | None = None
        """A chunk of zeros written ahead and not fsynced yet: the next group fsync makes it durable (see
        ``_preallocate``)."""
        self.preallocate_off_until = 0.0
        """No zeros are written before this monotonic time (a zero write failed)."""
        self.preallocated_bytes = 0
        self.preallocate_failures = 0
        self._extending_writes_closed = 0
        """``extending_writes`` of the logs closed before the open one (a heal, an unassignment)."""
        self.worker_gone = False
        self.current: _Item | None = None
        """The item the worker is on (answered by the node if the worker ends under it)."""
        self.busy = False
        """True while a request of this partition is being processed (by the worker, or by ``commit_now``)."""
        # Metric children looked up once: ``labels()`` costs more than the update on the append path.
        # Read when scraped: setting it for every request the worker takes cost as much as the update.
        node.metrics.queue.labels(partition_id).set_function(lambda: len(self.queue))
        self._read_bytes = node.metrics.read_bytes.labels(partition_id)
        # The highest durable id, read when scraped (as the queue size): a Gauge.set per group commit took a
        # lock and three calls on the append path.
        node.metrics.max_txn.labels(partition_id).set_function(lambda: self.durable_max)

    @property
    def info(self) -> PartitionInfo:
        return self.node.control.partition_info(self.partition_id)

    def open_log(self) -> PartitionLog:
        if self.log is None:
            cfg = self.node.config
            info = self.info
            if info.assigned and self.lost is None:
                # Before PartitionLog.open, which would make a missing directory anew: an empty log must never
                # pass for the replica the control file describes.
                why = (
                    "it was found damaged before and is not repaired yet"
                    if info.replica_damaged
                    else missing_log(OS_FS, str(cfg.directory), self.partition_id)
                )
                if why is not None:
                    self._mark_lost(why)
            self.log = PartitionLog.open(
                str(cfg.directory),
                self.node.control.key,
                self.partition_id,
                segment_size_threshold_bytes=cfg.segment_size_threshold_bytes,
                segment_cache_capacity=cfg.segment_cache_capacity,
                local_low_water_mark=self.info.local_low_water_mark,
            )
            for txn in self.log.damaged_at_open:  # kept by recovery, not cut (see waltz.storage.resync)
                self.note_damage(txn, "durable but does not verify at open")
            if self.broken is None:
                # What a (re)start finds on disk is what the disk holds. A broken partition keeps the mark it
                # had: its page cache may hold records the disk lost (see ``_heal``).
                self.durable_max = self.log.max_transaction_id
            if info.assigned and self.lost is None:
                why = lost_below_mark(self.log.max_transaction_id, info)
                if why is not None:
                    self._mark_lost(why)
        return self.log

    def _mark_lost(self, why: str) -> None:
        """Record that this replica lost records it held: durably (the DAMAGED flag), one ERROR line."""
        info = self.info
        if not info.replica_damaged:
            self.node.control.update(self.partition_id, flags=info.flags | FLAG_DAMAGED)
        self.lost = why
        self._marked_since_lost = False
        log.error(
            "partition %d: this replica is damaged: %s (low-water mark %d, local low-water mark %d); it does "
            "not vote in recovery until it is repaired (caught up to a low-water mark set after this, by the "
            "owning server's recovery or by `waltz storage recover-partition`)",
            self.partition_id,
            why,
            info.low_water_mark,
            info.local_low_water_mark,
        )

    def _check_repaired(self) -> None:
        """Clear the damage once the replica holds a low-water mark set after it was found (see
        waltz.storage.replica_check): durably, one INFO line."""
        info = self.info
        if not self._marked_since_lost or self.durable_max < info.low_water_mark:
            return
        self.node.control.update(self.partition_id, flags=info.flags & ~FLAG_DAMAGED)
        log.info(
            "partition %d: the damaged replica is repaired: it holds 0..%d, at least its low-water mark %d "
            "(set by session %d after the damage was found: %s); it votes again",
            self.partition_id,
            self.durable_max,
            info.low_water_mark,
            info.session_id,
            self.lost,
        )
        self.lost = None
        self._marked_since_lost = False

    @property
    def preallocating(self) -> bool:
        """A chunk of zeros was written and waits for the next group fsync (see ``_preallocate``)."""
        return self._zeros is not None

    def close_log(self) -> None:
        self._zeros = None  # closing fsyncs (or, healing, drops) what they were written to
        if self.log is not None:
            self._extending_writes_closed += self.log.extending_writes
            self.log.close()
            self.log = None

    @property
    def extending_writes(self) -> int:
        """Group writes that went past the fsynced zeros (see ``PartitionLog.extending_writes``)."""
        plog = self.log
        return self._extending_writes_closed + (plog.extending_writes if plog is not None else 0)

    # -- checks -----------------------------------------------------------------------------------

    def _check(self, msg: st.StorageMessage, offline: bool, *, may_adopt: bool = False) -> PartitionLog:
        """``may_adopt``: an offline request may carry a *newer* session id than the persisted one (an offline
        SetLowWaterMark, which then persists it: see ``_set_low_water_mark``)."""
        damage = self.node.control.damaged.get(self.partition_id)
        if damage is not None:
            raise CorruptionError(
                f"partition {self.partition_id} is down on this node: its control file entry is damaged "
                f"({damage}); remove this replica with its files and add it again"
            )
        if self.failed is not None:
            raise StorageError(f"partition {self.partition_id} failed: {self.failed}")
        if self.broken is not None and not self._heal():
            raise StorageError(f"partition {self.partition_id} is fail-stopped: {self.broken}")
        info = self.info
        if not info.assigned or self.log is None:
            raise PartitionNotAssignedError(f"Partition:{self.partition_id} is not assigned.")
        if offline:
            if info.available:
                raise PartitionNotAssignedError(
                    f"Partition:{self.partition_id} is available; offline requests need it offline"
                )
            if msg.session_id != info.session_id and not (may_adopt and msg.session_id > info.session_id):
                raise SessionFencedError(
                    f"offline request session {msg.session_id} is not the persisted session {info.session_id}"
                )
        else:
            if not info.available:
                raise PartitionNotAssignedError(f"Partition:{self.partition_id} is not available.")
            if msg.session_id != self.session_id:
                raise SessionFencedError(
                    f"session {msg.session_id} of partition {self.partition_id} is fenced by session "
                    f"{self.session_id}"
                )
        return self.log

    def _heal(self) -> bool:
        """Try to bring a broken partition back (see the module docstring); True if it serves again."""
        now = time.monotonic()
        if now < self._next_heal_s:
            return False
        self._next_heal_s = now + HEAL_INTERVAL_S
        directory = str(self.node.config.directory)
        try:
            stat = os.statvfs(directory)
        except OSError as e:
            log.debug("partition %d: cannot stat %s: %s", self.partition_id, directory, e)
            return False
        free = stat.f_bavail * stat.f_frsize
        if free < HEAL_MIN_FREE_BYTES:
            return False
        try:
            self.close_log()
            plog = self.open_log()
            dropped = plog.max_transaction_id - self.durable_max
            if dropped > 0:
                plog.truncate(self.durable_max)
            plog.flush()
        except WaltzError as e:
            log.debug("partition %d: still broken: %s", self.partition_id, e)
            return False
        self.durable_max = plog.max_transaction_id
        log.info(
            'partition %d healed after "%s": %d MiB free, log cut to %d (the last durable id; %d '
            "unacknowledged records dropped); serving again",
            self.partition_id,
            self.broken,
            free >> 20,
            plog.max_transaction_id,
            max(0, dropped),
        )
        self.broken = None
        return True

    # -- the worker -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Process this partition's queue forever (cancelled when the node closes).

        Request errors are answered where they happen; an exception that reaches this loop is a bug. The
        partition then fails (it refuses every later request, so nothing of it can be trusted to a writer)
        but the worker goes on answering, so no request waits forever on a dead worker.
        """
        while True:
            item = self.current = await self.queue.get()
            self.busy = True
            try:
                if item.op is not None:
                    await self._run_op(item)
                elif isinstance(item.msg, st.AppendRequest):
                    await self._group_commit(item)
                else:
                    self._respond(item, self._process(item))
            except Exception as e:  # noqa: BLE001 - a bug: fail the partition, answer the request
                self.fail(
                    f"{type(item.msg).__name__ if item.msg is not None else 'admin operation'}: {e!r}", e
                )
                self.answer_failed(item)
            self.current = None
            self.busy = False

    def fail(self, reason: str, error: BaseException | None = None) -> None:
        """Fail this partition for good (until the node restarts): one ERROR line, then health reports it."""
        if self.failed is None:
            self.failed = reason
            log.error(
                "partition %d failed (%s); refusing every request until the node restarts",
                self.partition_id,
                reason,
                exc_info=error,
            )

    def answer_failed(self, item: _Item) -> None:
        """Answer ``item`` with this partition's failure (if it was not answered yet)."""
        error = StorageError(f"partition {self.partition_id} failed: {self.failed}")
        if item.done is not None:
            if not item.done.done():
                item.done.set_exception(error)
        elif item.msg is not None:
            self._respond(item, self._failure(item.msg, error))

    async def enqueue(self, item: _Item) -> None:
        """Queue ``item`` for the worker (waiting for room), or answer it at once if the worker is gone."""
        if self.worker_gone:
            self.answer_failed(item)
        else:
            await self.queue.put(item)

    def enqueue_nowait(self, item: _Item) -> bool:
        """:meth:`enqueue` without waiting (the common case, saving a coroutine per request); False if the
        queue has no room for it now (nothing done)."""
        if self.worker_gone:
            self.answer_failed(item)
            return True
        return self.queue.put_nowait(item)

    @property
    def problem(self) -> str | None:
        """Why this partition does not serve fully, or None."""
        if self.failed is not None:
            return f"failed: {self.failed}"
        if self.broken is not None:
            return f"fail-stopped: {self.broken}"
        if self.lost is not None:
            return f"replica damaged: {self.lost}; it does not vote until repaired"
        return None

    async def _run_op(self, item: _Item) -> None:
        assert item.op is not None
        assert item.done is not None
        try:
            result = item.op()
            if isinstance(result, Awaitable):
                result = await result
        except Exception as e:  # noqa: BLE001 - handed to the awaiting admin request
            if not item.done.done():
                item.done.set_exception(e)
        else:
            if not item.done.done():
                item.done.set_result(result)

    def _process(self, item: _Item) -> st.StorageMessage:
        msg = item.msg
        assert msg is not None
        sid, seq, pid = msg.session_id, msg.seq_num, msg.partition_id
        self.node.metrics.requests.inc(type(msg).__name__)
        try:
            if isinstance(msg, st.LastSessionInfoRequest):
                self._check(msg, msg.used_by_offline_recovery)
                info = self.info
                return st.LastSessionInfoResponse(
                    sid,
                    seq,
                    pid,
                    st.SessionInfo(
                        info.session_id, info.low_water_mark, info.local_low_water_mark, self.lost is not None
                    ),
                )
            if isinstance(msg, st.MaxTransactionIdRequest):
                plog = self._check(msg, msg.offline)
                return st.MaxTransactionIdResponse(sid, seq, pid, plog.max_transaction_id)
            if isinstance(msg, st.TruncateRequest):
                plog = self._check(msg, msg.offline)
                return st.MaxTransactionIdResponse(sid, seq, pid, self._truncate(plog, msg, item))
            if isinstance(msg, st.SetLowWaterMarkRequest):
                return self._set_low_water_mark(msg)
            if isinstance(msg, st.RecordHeaderRequest):
                plog = self._check(msg, False)
                return st.RecordHeaderResponse(sid, seq, pid, plog.read_header(msg.transaction_id))
            if isinstance(msg, st.RecordRequest):
                plog = self._check(msg, False)
                record = plog.read_record(msg.transaction_id)
                if record is not None:
                    self._read_bytes.inc(len(record.data))
                return st.RecordResponse(sid, seq, pid, record)
            if isinstance(msg, st.RecordHeaderListRequest):
                plog = self._check(msg, False)
                n = max(0, min(msg.max_records, MAX_LIST_RECORDS))
                headers = plog.read_headers(msg.transaction_id, n, max_bytes=MAX_LIST_BYTES) if n else []
                return st.RecordHeaderListResponse(sid, seq, pid, tuple(headers))
            if isinstance(msg, st.RecordListRequest):
                plog = self._check(msg, False)
                n = max(0, min(msg.max_records, MAX_LIST_RECORDS))
                records = plog.read_wire(msg.transaction_id, n, max_bytes=MAX_LIST_BYTES) if n else ()
                self._read_bytes.inc(records.data_bytes if records else 0)
                return st.RecordListResponse(sid, seq, pid, records)
            if isinstance(msg, st.RecordRunRequest):
                plog = self._check(msg, False)
                n = max(0, min(msg.max_records, MAX_LIST_RECORDS))
                budget = max(0, min(msg.max_bytes, MAX_LIST_BYTES))
                count, run = plog.read_run(msg.transaction_id, n, max_bytes=budget) if n else (0, b"")
                self._read_bytes.inc(len(run))
                return st.RecordRunResponse(sid, seq, pid, count, run)
            if isinstance(msg, st.RepairRequest):
                plog = self._check(msg, False)
                self._repaired(plog.repair(msg.records))
                return st.SuccessResponse(sid, seq, pid)
            if isinstance(msg, st.DamagedRecordsRequest):
                # Session-checked like a read: only the partition's current owner learns (and repairs) them.
                self._check(msg, False)
                n = max(0, min(msg.max_ids, MAX_DAMAGED_REPORTED))
                return st.DamagedRecordsResponse(sid, seq, pid, tuple(sorted(self.damaged)[:n]))
            raise RemoteProtocolError(f"{type(msg).__name__} is not a request")
        except RecordCorruptionError as e:
            self.note_damage(e.transaction_id, str(e))
            # Sent as the plain CorruptionError the peer knows: the server then reads another replica.
            return self._failure(msg, CorruptionError(str(e)))
        except WaltzError as e:
            return self._failure(msg, e)

    def _truncate(self, plog: PartitionLog, msg: st.TruncateRequest, item: _Item) -> int:
        """A TruncateRequest: refused below the persisted low-water mark unless an operator's repair asks (one
        ERROR line per 10 s); every truncation that cuts records is one INFO line (from, to, why, who)."""
        info = self.info
        before = plog.max_transaction_id
        target = msg.transaction_id
        who = (
            f"{'an offline tool' if msg.offline else 'store session'} {msg.session_id} from "
            f"{item.conn.peername if item.conn is not None else 'this node'}"
        )
        refusal = truncation_refusal(self.partition_id, info, before, target)
        if refusal is not None and not msg.operator_repair:
            now = time.monotonic()
            if now - self._last_truncate_refusal_log_s >= REFUSAL_LOG_INTERVAL_S:
                self._last_truncate_refusal_log_s = now
                log.error("%s (asked by %s: %s)", refusal, who, msg.reason or "no reason given")
            raise StorageError(refusal)
        if refusal is not None:
            # The operator accepts the loss: the marks follow the log down, or the replica would be reported
            # damaged (its log below its local mark) and every later low-water mark refused.
            self.node.control.update(
                self.partition_id,
                low_water_mark=min(info.low_water_mark, target),
                local_low_water_mark=min(info.local_low_water_mark, target),
            )
        new_max = plog.truncate(target)
        self.durable_max = min(self.durable_max, new_max)
        self._forget_damage_above(new_max)
        if new_max < before:
            log.info(
                "partition %d truncated from %d to %d (%s), asked by %s%s",
                self.partition_id,
                before,
                new_max,
                msg.reason or "no reason given",
                who,
                f"; an operator's repair below the low-water mark {info.low_water_mark}, lowered with it"
                if refusal is not None
                else "",
            )
        return new_max

    def scrub_step(self, after: int) -> tuple[int, int] | None:
        """Verify the records stored after ``after`` (a bounded run); ``(last id checked, bytes read)``, or
        None when there is nothing after it. A damaged record is noted (see :meth:`note_damage`)."""
        plog = self.log
        if plog is None:
            return None
        firsts = plog.segment_first_ids
        txn = max(after + 1, firsts[0] if firsts else 0)
        if txn > plog.max_transaction_id:
            return None
        try:
            count, run = plog.read_run(txn, MAX_LIST_RECORDS, max_bytes=SCRUB_CHUNK_BYTES)
        except RecordCorruptionError as e:
            self.note_damage(e.transaction_id, str(e))
            return e.transaction_id, SCRUB_CHUNK_BYTES
        except CorruptionError as e:
            # Not one record but a structure (an index): nothing to skip to; the next pass tries again.
            log.error("partition %d: scrub stopped at transaction %d: %s", self.partition_id, txn, e)
            return None
        if count == 0:
            return None
        return txn + count - 1, len(run)

    def note_damage(self, transaction_id: int, reason: str) -> None:
        """Report a damaged stored record: one ERROR line and a metric per record, kept for status."""
        if transaction_id in self.damaged:
            return
        if len(self.damaged) < MAX_DAMAGED_REPORTED:
            self.damaged[transaction_id] = reason
        self.node.metrics.corrupt_records.labels(self.partition_id).inc()
        log.error(
            "partition %d: stored transaction %d is damaged on this node (%s); readers fall back to another "
            "replica, which repairs this copy",
            self.partition_id,
            transaction_id,
            reason,
        )

    def _forget_damage_above(self, max_id: int) -> None:
        """Damaged records a truncation removed are no longer held, so no longer reported."""
        for txn in [t for t in self.damaged if t > max_id]:
            del self.damaged[txn]

    def _repaired(self, ids: list[int]) -> None:
        for txn in ids:
            self.damaged.pop(txn, None)
            self.node.metrics.repaired_records.labels(self.partition_id).inc()
        if ids:
            log.info(
                "partition %d: repaired %d damaged record(s) from another replica's copy (%d..%d)",
                self.partition_id,
                len(ids),
                min(ids),
                max(ids),
            )

    def _set_low_water_mark(self, msg: st.SetLowWaterMarkRequest) -> st.StorageMessage:
        # Offline recovery (``waltz storage recover-partition``) ends by persisting the session id of the
        # replica it copied, so the next store session classifies the copy like its source instead of as a
        # restored replica that cannot vote. Offline requests only reach a partition marked unavailable, which
        # no store session writes, and a later session's id is higher still and fences this one as usual.
        plog = self._check(msg, msg.offline, may_adopt=msg.offline)
        info = self.info
        if msg.session_id < info.session_id:
            raise SessionFencedError(
                f"session {msg.session_id} is older than the persisted session {info.session_id}"
            )
        if msg.low_water_mark < info.low_water_mark or msg.low_water_mark < info.local_low_water_mark:
            raise StorageError(
                f"low-water mark {msg.low_water_mark} is below the persisted marks "
                f"({info.low_water_mark}, {info.local_low_water_mark})"
            )
        max_id = plog.max_transaction_id
        if max_id > msg.low_water_mark:
            raise StorageError(
                f"partition {self.partition_id} holds transaction {max_id} above the low-water mark "
                f"{msg.low_water_mark}; truncate first"
            )
        plog.flush()
        self.node.control.update(
            self.partition_id,
            session_id=msg.session_id,
            low_water_mark=msg.low_water_mark,
            local_low_water_mark=max_id,
        )
        # The fencing id never trails the persisted one (a restart initialises it from there): after an
        # offline adoption, sessions older than the adopted one stay fenced.
        self.session_id = max(self.session_id, msg.session_id)
        if self.lost is not None:
            self._marked_since_lost = True
            self._check_repaired()
        if msg.offline and msg.session_id != info.session_id:
            log.info(
                "partition %d: offline recovery set low-water mark %d and adopted session %d (was %d)",
                self.partition_id,
                msg.low_water_mark,
                msg.session_id,
                info.session_id,
            )
        return st.SuccessResponse(msg.session_id, msg.seq_num, msg.partition_id)

    async def _group_commit(self, first: _Item) -> None:
        """Write every append queued right now, fsync once, then answer them all in order.

        Each request is checked on its own right before its records join the group's run (ids continuing
        the log, client data checksums; :func:`append_wire_run` builds the stored layout straight from the
        request's bytes), so a bad request fails alone. The run of all accepted requests is then written with
        one :meth:`PartitionLog.append_run` (one pwrite per file for the whole group). Success is sent
        strictly after the data file's fsync returned; if the write or the fsync fails, every request of the
        group fails and the partition refuses further writes (see :meth:`_fsync`).
        """
        batch = [first]
        limit = self.node.config.max_group_commit_records
        queue = self.queue
        assert isinstance(first.msg, st.AppendRequest)
        count = len(first.msg.records)
        while count < limit:
            nxt = queue.peek()
            if nxt is None or not isinstance(nxt.msg, st.AppendRequest):
                break
            batch.append(queue.pop())
            count += len(nxt.msg.records)
        results, accepted, plog = self._write_group(batch)
        error = await self._fsync(plog) if accepted and plog is not None else None
        self._answer_group(batch, results, accepted, error)

    @property
    def may_commit_now(self) -> bool:
        """Whether an append that just arrived may be written, fsynced and answered at once, in the caller's
        loop pass (:meth:`commit_now`) instead of by the worker: the worker idles with nothing queued (so
        nothing is overtaken), no fsync of this node is running and fsyncs run on the loop (see
        :meth:`_fsync`). The caller also leaves to the worker an append with more requests read behind it
        (group commit)."""
        node = self.node
        return (
            not self.busy
            and node.queued.items == 0
            and node.fsyncs_in_flight == 0
            and not self.worker_gone
            and time.monotonic() >= node.inline_fsync_off_until
        )

    def commit_now(self, item: _Item) -> None:
        """:meth:`_group_commit` of ``item`` alone, its fsync on the loop, answered before this returns (call
        only when :attr:`may_commit_now`). Same checks, same durability: Success only after the fsync. It
        saves the worker's wake-up and a loop pass per append on a node whose requests come one at a time
        (one replication batch per partition in flight from the server)."""
        self.busy = True
        try:
            results, accepted, plog = self._write_group([item])
            error = self._fsync_inline(plog) if accepted and plog is not None else None
            self._answer_group([item], results, accepted, error)
        except Exception as e:  # noqa: BLE001 - a bug: as in run(), fail the partition, answer the request
            self.fail(f"AppendRequest: {e!r}", e)
            self.answer_failed(item)
        finally:
            self.busy = False

    def _write_group(self, batch: list[_Item]) -> tuple[list[bytes | None], list[int], PartitionLog | None]:
        """Check each append of ``batch`` and write the accepted ones' records with one ``append_run``:
        ``(responses so far, indexes of the accepted requests, the log)``; the accepted ones are answered
        after the fsync (see :meth:`_answer_group`)."""
        self.node.metrics.requests.inc("AppendRequest", len(batch))
        results: list[bytes | None] = [None] * len(batch)
        accepted: list[int] = []  # indexes into batch of requests whose records go into the group write
        parts: list[bytes | memoryview] = []  # of the group's stored run
        ends: list[int] = []
        plog: PartitionLog | None = None
        expected = -1
        for i, item in enumerate(batch):
            msg = item.msg
            assert isinstance(msg, st.AppendRequest)
            records = msg.records
            try:
                plog = self._check(msg, msg.offline)
                if expected < 0:
                    expected = plog.max_transaction_id + 1
                if not records:
                    results[i] = st.encode_success(msg.session_id, msg.seq_num, msg.partition_id)
                    continue
                got = (
                    records.first_transaction_id
                    if isinstance(records, st.WireRecordList)
                    else records[0].transaction_id
                )
                if got != expected:
                    raise TransactionOutOfOrderError(
                        f"partition {self.partition_id}: transaction out of order: expected {expected}, "
                        f"got {got}"
                    )
                if isinstance(records, st.WireRecordList):
                    append_wire_run(parts, ends, records, expected)
                else:
                    verify_client_checksums(records, expected)
                    part, part_ends = encode_stored_run(records)
                    base = ends[-1] if ends else 0
                    parts.append(part)
                    ends += [base + e for e in part_ends]
            except WaltzError as e:
                results[i] = st.encode(self._failure(msg, e))
                continue
            accepted.append(i)
            expected += len(records)
        if accepted and plog is not None:
            before = plog.max_transaction_id
            try:
                plog.append_run(b"".join(parts), ends, expected - len(ends))
            except WaltzError as e:
                # Every record was checked above, so this is the disk (or a bug): nothing of the group may
                # be acknowledged, and if part of it reached the file the partition stops taking writes.
                if plog.max_transaction_id != before or _is_io_error(e):
                    self._break(f"write failed: {e}")
                for i in accepted:
                    results[i] = st.encode(self._failure(batch[i].msg, e))  # type: ignore[arg-type]
                accepted = []
        return results, accepted, plog

    def _answer_group(
        self, batch: list[_Item], results: list[bytes | None], accepted: list[int], error: WaltzError | None
    ) -> None:
        """Answer every request of a written group, in order: Success for the accepted ones unless the
        fsync failed (``error``)."""
        if accepted:
            n_bytes = 0
            n_records = 0
            encode_success = st.encode_success
            for i in accepted:
                msg = batch[i].msg
                assert isinstance(msg, st.AppendRequest)
                if error is None:
                    results[i] = encode_success(msg.session_id, msg.seq_num, msg.partition_id)
                    records = msg.records
                    n_records += len(records)
                    n_bytes += (
                        records.data_bytes
                        if isinstance(records, st.WireRecordList)
                        else sum(len(r.data) for r in records)
                    )
                else:
                    results[i] = st.encode(self._failure(msg, error))
            if error is None:
                self.appended_records += n_records
                self.appended_bytes += n_bytes
        # One latency observation per group (its oldest request): observing every request costs more than
        # the rest of the acknowledgement path.
        self.node.metrics.append_latency.observe(time.monotonic() - batch[0].arrived_s)
        send = self.node.send_payload
        for item, payload in zip(batch, results, strict=True):
            assert payload is not None
            send(item, payload)
        if accepted and error is None and self.node.config.segment_preallocate_bytes:
            self._preallocate()

    def _preallocate(self) -> None:
        """Keep the newest segment zero-filled ahead of its last record (see the module docstring): write the
        next chunk of zeros now, if one is missing; the next group's fsync (of the same data file) makes it
        durable with that group's records, one chunk at a time. Called after a group's answers left, so
        the write never delays an acknowledgement.

        The zeros are not fsynced on their own in a thread (as they were): that fsync overlapped the groups
        that came meanwhile (6-30% of them in ``bench/storage_append.py``, each then handed to the worker
        and an fsync thread, a task wake-up, a thread hand-off and a loop wake-up more, and waiting for the
        zeros' writeback anyway); and a separate descriptor's fsync could consume the only report of a
        writeback error of the group's pages. The chunk is written 4 MiB (the default) ahead of the
        records, so the groups in between overwrite zeros synced earlier and only the one fsync that
        carries a chunk commits a new file size."""
        plog = self.log
        if self.preallocating or plog is None or self.broken is not None or self.failed is not None:
            return
        if self.preallocate_off_until and time.monotonic() < self.preallocate_off_until:
            return
        node = self.node
        try:
            job = plog.prefill(node.config.segment_preallocate_bytes)
        except WaltzError as e:
            # The zeros go past the last record: whatever part of them was written is free space, and the
            # records are untouched. Appends extend the file meanwhile, as without preallocation.
            self._preallocation_failed("cannot write preallocated zeros", e)
            return
        except Exception as e:  # noqa: BLE001 - a bug: the partition fails, as in run(); heard, not raised
            # Raising would reach the caller's handler, which answers the group's requests a second time.
            self.fail(f"preallocation: {e!r}", e)
            return
        if job is None:
            return
        job.handle.close()  # its own descriptor, for a separate fsync: the group fsync is on the data file's
        self.preallocated_bytes += job.end - job.start
        self._zeros = job

    def _preallocation_failed(self, what: str, e: Exception) -> None:
        self.preallocate_failures += 1
        self.preallocate_off_until = time.monotonic() + PREALLOCATE_RETRY_S
        log.warning(
            "partition %d: %s (%s); appends extend the data file for the next %.0f s",
            self.partition_id,
            what,
            e,
            PREALLOCATE_RETRY_S,
        )

    async def _fsync(self, plog: PartitionLog) -> WaltzError | None:
        """Make the data file durable; return None, or the error that fails the whole group.

        When no other partition has requests queued and no other fsync is running, the fsync runs on the
        event loop thread (unless one such fsync took longer than ``INLINE_FSYNC_LIMIT_S`` lately: for 1 s
        after a lone slow one, doubling up to ``INLINE_FSYNC_BACKOFF_S`` while they repeat): the hand-off to
        a worker thread and back (a thread wake-up, a future, a wake-up of the loop, the GIL passed to and
        fro) costs more CPU than the fsync itself (10-20% of the node's CPU per record in
        ``bench/storage_append.py``), and nothing waits for the loop meanwhile but
        arrivals, which then form the next group. Otherwise it runs in a thread, so the other partitions are
        served while the disk works.
        """
        node = self.node
        if (
            node.fsyncs_in_flight == 0
            and node.queued.items == len(self.queue)
            and time.monotonic() >= node.inline_fsync_off_until
        ):
            return self._fsync_inline(plog)
        node.fsyncs_in_flight += 1
        self.threaded_fsync_count += 1
        try:
            await node.fsync_threads.run(plog.flush)
        except Exception as e:  # noqa: BLE001 - any fsync failure fails the whole group
            return self._fsync_failed(e)
        finally:
            node.fsyncs_in_flight -= 1
        self._fsynced(plog)
        return None

    def _fsync_inline(self, plog: PartitionLog) -> WaltzError | None:
        """:meth:`_fsync` on the loop thread (the caller checked that it may)."""
        node = self.node
        try:
            started = time.monotonic()
            plog.flush()
            now = time.monotonic()
            if now - started > INLINE_FSYNC_LIMIT_S:
                # A slow disk would stall the loop (and /health, keep-alives, other partitions' reads) for
                # every fsync: hand fsyncs to a thread until the disk has had time to recover. A lone spike
                # (a busy host) costs a second of the threads' hand-off; a disk that stays slow, up to 10 s
                # at a time (the hand-off costs a loop pass and a task wake-up per group, and appends can
                # no longer be answered in the pass that read them).
                if now - node.last_slow_fsync_s > INLINE_FSYNC_RESET_S:
                    node.inline_fsync_backoff_s = INLINE_FSYNC_FIRST_BACKOFF_S
                else:
                    node.inline_fsync_backoff_s = min(2 * node.inline_fsync_backoff_s, INLINE_FSYNC_BACKOFF_S)
                node.last_slow_fsync_s = now
                node.inline_fsync_off_until = now + node.inline_fsync_backoff_s
        except Exception as e:  # noqa: BLE001 - any fsync failure fails the whole group
            return self._fsync_failed(e)
        self._fsynced(plog)
        return None

    def _fsync_failed(self, e: Exception) -> WaltzError:
        # Nothing of this group may be acknowledged: its durability is unknown. After a failed fsync Linux
        # may have dropped the dirty pages and report the next fsync as clean, so the partition stops taking
        # writes; the server starts a new session elsewhere and recovery decides what survived.
        self._break(f"fsync failed: {e}")
        return e if isinstance(e, WaltzError) else StorageError(f"fsync failed: {e}")

    def _fsynced(self, plog: PartitionLog) -> None:
        plog.write_flushed_index()  # lets recovery after a kill tell damage from a torn tail
        zeros = self._zeros
        if zeros is not None:
            # Written before this fsync began (after the previous group's answers; never during a group):
            # the fdatasync of the data file made them durable with the file's size.
            self._zeros = None
            zeros.done()
        self.fsync_count += 1
        self.durable_max = plog.max_transaction_id
        if self.lost is not None:
            self._check_repaired()

    def _break(self, reason: str) -> None:
        if self.broken is None:
            log.error(
                "partition %d: %s; fail-stopped: refusing requests until it heals (disk space, clean fsync)",
                self.partition_id,
                reason,
            )
            self.broken = reason
            self._next_heal_s = time.monotonic() + HEAL_INTERVAL_S

    def _failure(self, msg: st.StorageMessage, e: WaltzError) -> st.StorageMessage:
        self.node.metrics.failures.labels(type(e).__name__).inc()
        log.debug("partition %d: %s failed: %s", self.partition_id, type(msg).__name__, e)
        return st.failure_from_error(msg.session_id, msg.seq_num, msg.partition_id, e)

    def _respond(self, item: _Item, resp: st.StorageMessage) -> None:
        self.node.respond(item, resp)


def _is_io_error(e: WaltzError) -> bool:
    """An I/O failure of the file layer (it raises plain StorageError), as opposed to a refused request."""
    return type(e) is StorageError


class StorageNode:
    """A storage node: control file, partitions, data port, admin port and optional HTTP port.

    Use ``await StorageNode.start(config, key, num_partitions)``; ``await node.aclose()`` stops everything it
    started. ``key``/``num_partitions`` come from ZooKeeper (see :func:`load_cluster_identity`) or the config.
    """

    def __init__(
        self, config: StorageConfig, control: ControlFile, authority: SessionAuthority | None = None
    ) -> None:
        self.config = config
        self.control = control
        self.authority = authority
        """Checks new session ids against the cluster's metadata; None (no ZooKeeper) trusts every peer."""
        self.registry = new_registry()
        self.metrics = _Metrics(self.registry)
        self.queued = _Tally()
        """Requests queued in all partitions (see ``StoragePartition._fsync``)."""
        self.partitions = [StoragePartition(self, pid) for pid in range(control.num_partitions)]
        self.registry.register(_AppendCounters(lambda: self.partitions))
        directory = str(config.directory)
        self.metrics.disk_bytes.set_function(lambda: directory_bytes(directory))
        self.metrics.disk_free_bytes.set_function(lambda: _free_bytes(directory))
        self.metrics.partitions_assigned.set_function(
            lambda: sum(1 for p in self.partitions if p.info.assigned)
        )
        self.metrics.partitions_available.set_function(
            lambda: sum(1 for p in self.partitions if p.info.assigned and p.info.available)
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._data_server: FramedServer | None = None
        self._admin_server: FramedServer | None = None
        self._http: HttpEndpoint | None = None
        self.fsyncs_in_flight = 0
        self.fsync_threads = _FsyncThreads(FSYNC_THREADS)
        self.inline_fsync_off_until = 0.0
        """Until this monotonic time every fsync runs in a thread (a slow one ran on the loop)."""
        self.inline_fsync_backoff_s = INLINE_FSYNC_FIRST_BACKOFF_S
        self.last_slow_fsync_s = -1e9
        """When an fsync on the loop last took longer than ``INLINE_FSYNC_LIMIT_S``."""
        self._closing = False
        self.port = 0
        self.admin_port = 0
        self.http_port = 0

    @classmethod
    async def start(
        cls,
        config: StorageConfig,
        key: uuid.UUID,
        num_partitions: int,
        authority: SessionAuthority | None = None,
    ) -> StorageNode:
        server_ssl = config.tls.server_context("storage config")  # Before touching any file.
        control = await asyncio.to_thread(
            ControlFile.open_or_create, str(config.directory), key, num_partitions
        )
        node = cls(control=control, config=config, authority=authority)
        try:
            for p in node.partitions:
                if p.info.assigned:
                    await asyncio.to_thread(p.open_log)
            for p in node.partitions:
                task = asyncio.create_task(p.run(), name=f"storage-partition-{p.partition_id}")
                task.add_done_callback(functools.partial(node._worker_done, p))
                node._tasks.append(task)
            if config.scrub_bytes_per_second > 0:
                node._tasks.append(asyncio.create_task(node._scrub_forever(), name="storage-scrub"))
            node._data_server = await listen(
                "storage.port",
                config.host,
                config.port,
                lambda: serve(
                    config.host,
                    config.port,
                    node._serve_data,
                    magic=MAGIC_STORAGE,
                    versions=st.STORAGE_VERSIONS,
                    hello_text=st.STORAGE_SERVER_HELLO,
                    max_frame_bytes=config.max_frame_bytes,
                    max_connections=config.max_connections,
                    max_connections_per_source=config.max_connections_per_source,
                    idle_timeout_s=config.connection_idle_timeout_ms / 1000,
                    ssl=server_ssl,
                ),
            )
            node.port = node._data_server.port
            node._admin_server = await listen(
                "storage.admin.port",
                config.host,
                config.admin_port,
                lambda: serve(
                    config.host,
                    config.admin_port,
                    node._serve_admin,
                    magic=MAGIC_ADMIN,
                    versions=adm.ADMIN_VERSIONS,
                    hello_text=adm.ADMIN_SERVER_HELLO,
                    max_frame_bytes=config.max_frame_bytes,
                    max_connections=config.max_connections,
                    max_connections_per_source=config.max_connections_per_source,
                    idle_timeout_s=config.connection_idle_timeout_ms / 1000,
                    ssl=server_ssl,
                ),
            )
            node.admin_port = node._admin_server.port
            if config.http_port:
                node._http = HttpEndpoint(node.registry, node.health)
                node.http_port = await node._http.start(config.host, config.http_port, "storage.http.port")
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
        return node

    def _worker_done(self, part: StoragePartition, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._closing:
            return
        error = task.exception()
        part.worker_gone = True
        part.fail(f"worker ended: {error!r}", error)
        # Nobody takes from this queue any more: answer what it was on and what is queued now; ``enqueue``
        # answers later ones.
        if part.current is not None:
            part.answer_failed(part.current)
        while part.queue.peek() is not None:
            part.answer_failed(part.queue.pop())

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy when no partition failed, is fail-stopped or holds a damaged replica; ``partitions`` says
        which, and why.

        Damaged records not repaired yet, and partitions whose control-file entry is damaged, are listed
        too (for operators and ``waltz cluster verify``); a damaged control entry takes its partition down.
        """
        problems = {str(p.partition_id): p.problem for p in self.partitions if p.problem is not None}
        transactions, entries = self.damage_report()
        for pid, why in entries.items():
            problems[pid] = f"control file entry damaged: {why}"
        return not problems, {
            "storage": "degraded" if problems else "ok",
            "partitions": problems,
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
        for t in self._tasks:
            t.cancel()
        # A worker that died was reported by _worker_done already.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        # An fsync a cancelled worker handed off may still run: it finishes before its file is closed.
        await asyncio.to_thread(self.fsync_threads.close)
        for p in self.partitions:
            p.close_log()
        self.control.close()

    # -- responses ---------------------------------------------------------------------------------

    def respond(self, item: _Item, resp: st.StorageMessage) -> None:
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

    def send_payload(
        self, item: _Item, payload: bytes | tuple[bytes, bytes | bytearray | memoryview]
    ) -> None:
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

    # -- data port ---------------------------------------------------------------------------------

    def _peer_refused(self, conn: FramedConnection, port: str) -> bool:
        """True (logged) if ``storage.ssl.allowedPeers`` is set and the peer's certificate is not listed: a
        client certificate from the same CA must not reach the ports that fence, truncate and unassign."""
        allowed = self.config.allowed_peers
        if not allowed:
            return False
        name = peer_common_name(conn.peercert)
        if name in allowed:
            return False
        self.metrics.refused_peers.labels(port).inc()
        _peer_warnings.warning(
            conn.source,
            f"peer-refused:{port}",
            "refusing %s connection from %s: certificate %r is not in storage.ssl.allowedPeers",
            port,
            conn.peername,
            name,
        )
        return True

    async def _serve_data(self, conn: FramedConnection) -> None:
        if self._peer_refused(conn, "data"):
            return
        self.metrics.connections.inc()
        try:
            await conn.serve_payloads(_DataSession(self, conn).on_payload)
        except ConnectionError_:
            pass
        finally:
            self.metrics.connections.dec()

    async def _session_refusal(self, part: StoragePartition, session_id: int, peer: Any) -> WaltzError | None:
        """Why ``session_id`` may not fence ``part`` (None: it may): the cluster never handed it out, or, on a
        standalone node, it jumps further than ``storage.maxSessionIdStep``."""
        if session_id <= part.verified_session_id:
            return None
        if self.authority is None:
            return self._step_refusal(part, session_id, peer)
        async with part.session_check:  # One ZooKeeper read at a time per partition.
            if session_id <= part.verified_session_id:
                return None
            now = time.monotonic()
            if now - part.last_refusal_s >= SESSION_RECHECK_INTERVAL_S:
                try:
                    newest = await self.authority.newest_session_id(part.partition_id)
                except (WaltzError, TimeoutError) as e:
                    # Fail closed: a new session cannot be taken without ZooKeeper either.
                    return StorageError(
                        f"cannot confirm session {session_id} of partition {part.partition_id} with the "
                        f"cluster's metadata: {e!r}"
                    )
                part.verified_session_id = max(part.verified_session_id, newest)
                if session_id <= part.verified_session_id:
                    return None
                part.last_refusal_s = now
        self.metrics.refused_sessions.labels(part.partition_id).inc()
        if now - part.last_refusal_log_s >= REFUSAL_LOG_INTERVAL_S:
            part.last_refusal_log_s = now
            log.warning(
                "partition %d: refused session id %d from %s: the cluster's metadata records no session "
                "above %d (a forged or corrupt request; it fences nothing)",
                part.partition_id,
                session_id,
                peer,
                part.verified_session_id,
            )
        return SessionFencedError(
            f"session {session_id} of partition {part.partition_id} was never handed out by the cluster "
            f"(newest recorded: {part.verified_session_id}); refused"
        )

    def _step_refusal(self, part: StoragePartition, session_id: int, peer: Any) -> WaltzError | None:
        """The standalone bound (see :func:`waltz.storage.authority.step_refusal`)."""
        why = step_refusal(session_id, part.verified_session_id, self.config.max_session_id_step)
        if why is None:
            part.verified_session_id = session_id  # accepted: the next step is measured from here
            return None
        self.metrics.refused_sessions.labels(part.partition_id).inc()
        now = time.monotonic()
        if now - part.last_refusal_log_s >= REFUSAL_LOG_INTERVAL_S:
            part.last_refusal_log_s = now
            log.warning(
                "partition %d: refused session id %d from %s: %s (a corrupt or forged request; it fences "
                "nothing; if this replica joins a partition whose sessions really are that far on, raise "
                "storage.maxSessionIdStep)",
                part.partition_id,
                session_id,
                peer,
                why,
            )
        return SessionFencedError(f"partition {part.partition_id}: {why}; refused")

    def _check_identity(self, key: uuid.UUID, num_partitions: int) -> None:
        if key != self.control.key:
            raise ClusterKeyMismatchError(f"cluster key {key} does not match this node's {self.control.key}")
        if num_partitions != self.control.num_partitions:
            raise ClusterKeyMismatchError(
                f"number of partitions {num_partitions} does not match this node's "
                f"{self.control.num_partitions}"
            )

    # -- admin port --------------------------------------------------------------------------------

    async def _on_partition(self, pid: int, op: Callable[[], Any]) -> Any:
        """Run ``op`` in partition ``pid``'s worker, ordered with its data requests."""
        if not 0 <= pid < len(self.partitions):
            raise PartitionNotAssignedError(f"Partition:{pid} does not exist.")
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self.partitions[pid].enqueue(_Item(None, None, op=op, done=done))
        return await done

    async def assign(self, pid: int, assigned: bool, delete_files: bool = False) -> None:
        part = self.partitions[pid] if 0 <= pid < len(self.partitions) else None
        if part is None:
            raise PartitionNotAssignedError(f"Partition:{pid} does not exist.")

        def op() -> None:
            if pid in self.control.damaged:
                # The entry no longer says which session this replica took part in: its files cannot be
                # trusted either. Only removing them resets the entry (the replica is then re-copied).
                if assigned or not delete_files:
                    raise CorruptionError(
                        f"partition {pid}'s control file entry is damaged on this node "
                        f"({self.control.damaged[pid]}); unassign it with its files deleted first"
                    )
                self.control.reset(pid)
                self.control.update(pid, flags=FLAG_AVAILABLE)
                part.session_id = -1
                part.damaged.clear()  # The records it named are gone or no longer this node's business.
                part.close_log()
                delete_log_files(OS_FS, os.path.join(self.config.directory, str(pid)))
                return
            if assigned:
                part.open_log()
                self.control.set_assigned(pid, True)
            else:
                self.control.update(
                    pid, session_id=-1, low_water_mark=-1, local_low_water_mark=-1, flags=FLAG_AVAILABLE
                )
                part.session_id = -1
                part.lost = None  # the entry no longer describes anything this node held
                part.damaged.clear()  # The records it named are gone or no longer this node's business.
                part.close_log()
                if delete_files:
                    # Never opened for deletion: a log that would not open (corrupt) must still go.
                    delete_log_files(OS_FS, os.path.join(self.config.directory, str(pid)))

        was = part.info.assigned
        await self._on_partition(pid, op)
        if assigned and not was:
            log.info(
                "partition %d assigned (max transaction id %d)",
                pid,
                part.log.max_transaction_id if part.log else -1,
            )
        elif not assigned and was:
            log.info("partition %d unassigned%s", pid, "; its files were deleted" if delete_files else "")

    async def set_available(self, pid: int, available: bool) -> None:
        part = self.partitions[pid] if 0 <= pid < len(self.partitions) else None
        was = part.info.available if part is not None else None
        await self._on_partition(pid, lambda: self.control.set_available(pid, available))
        if was is not None and was != available:
            log.info("partition %d is now %s", pid, "available (online)" if available else "offline")

    # -- scrub -------------------------------------------------------------------------------------------

    async def _scrub_forever(self) -> None:
        """Verify every stored record, partition by partition, at ``storage.scrub.bytesPerSecond``, then pause
        and start again: damage (a flipped bit, a torn page) is found and reported before a reader needs the
        record. Each step is a bounded read run through the partition's worker, ordered with its requests."""
        rate = self.config.scrub_bytes_per_second
        while True:
            started = time.monotonic()
            scanned = 0
            for part in self.partitions:
                txn: int | None = -1
                while txn is not None:
                    try:
                        step = await self._on_partition(
                            part.partition_id, functools.partial(part.scrub_step, txn)
                        )
                    except WaltzError as e:  # An I/O error, say: the partition's own requests report it too.
                        log.warning("partition %d: scrub skipped the rest: %r", part.partition_id, e)
                        break
                    if step is None:
                        break
                    txn, nbytes = step
                    scanned += nbytes
                    await asyncio.sleep(nbytes / rate)
            log.debug("scrub pass: %d bytes in %.1f s", scanned, time.monotonic() - started)
            await asyncio.sleep(self.config.scrub_pause_ms / 1000)

    def statuses(self) -> list[adm.PartitionStatus]:
        out = []
        for p in self.partitions:
            info = p.info
            if p.partition_id in self.control.damaged:
                out.append(adm.PartitionStatus(p.partition_id, False))  # held here, and down
            elif info.assigned:
                out.append(adm.PartitionStatus(p.partition_id, info.assigned and info.available))
        return out

    def metrics_json(self) -> str:
        transactions, entries = self.damage_report()
        parts: dict[str, Any] = {}
        for p in self.partitions:
            info = p.info
            if not info.assigned:
                continue
            parts[str(p.partition_id)] = {
                "sessionId": info.session_id,
                "fencingSessionId": p.session_id,
                "lowWaterMark": info.low_water_mark,
                "localLowWaterMark": info.local_low_water_mark,
                "flags": info.flags,
                "available": info.available,
                "replicaDamaged": p.lost,
                "maxTransactionId": p.log.max_transaction_id if p.log is not None else -1,
                "queueSize": len(p.queue),
                "fsyncs": p.fsync_count,
                "threadedFsyncs": p.threaded_fsync_count,
                "extendingWrites": p.extending_writes,
                "preallocatedBytes": p.preallocated_bytes,
                "damagedTransactions": transactions.get(str(p.partition_id), []),
            }
        return json.dumps(
            {"partitions": parts, "numPartitions": len(self.partitions), "damagedControlEntries": entries},
            indent=2,
            sort_keys=True,
        )

    async def _admin_request(self, msg: adm.AdminMessage, opened: bool) -> adm.AdminMessage:
        seq = msg.seq_num
        if not opened:
            raise ClusterKeyMismatchError("the admin connection has not been opened with the cluster key")
        if isinstance(msg, adm.PartitionAssignmentRequest):
            for pid in msg.partition_ids:
                await self.assign(pid, msg.assigned, msg.delete_storage_files)
            return adm.AdminSuccessResponse(seq)
        if isinstance(msg, adm.PartitionAvailableRequest):
            for pid in msg.partition_ids:
                await self.set_available(pid, msg.available)
            return adm.AdminSuccessResponse(seq)
        if isinstance(msg, adm.RecordListRequest):
            pid = msg.partition_id

            def read() -> list[Any]:
                plog = self.partitions[pid].log
                if plog is None:
                    raise PartitionNotAssignedError(f"Partition:{pid} is not assigned.")
                n = max(0, min(msg.max_records, MAX_LIST_RECORDS))
                return plog.read_records(msg.transaction_id, n, max_bytes=MAX_LIST_BYTES) if n else []

            records = await self._on_partition(pid, read)
            return adm.RecordListResponse(seq, pid, tuple(records))
        if isinstance(msg, adm.LastSessionInfoRequest):
            pid = msg.partition_id
            if not 0 <= pid < len(self.partitions):
                raise PartitionNotAssignedError(f"Partition:{pid} does not exist.")
            info = self.partitions[pid].info
            damaged = self.partitions[pid].lost is not None
            return adm.LastSessionInfoResponse(
                seq,
                pid,
                st.SessionInfo(info.session_id, info.low_water_mark, info.local_low_water_mark, damaged),
            )
        if isinstance(msg, adm.MaxTransactionIdRequest):
            pid = msg.partition_id

            def max_id() -> int:
                plog = self.partitions[pid].log
                if plog is None:
                    raise PartitionNotAssignedError(f"Partition:{pid} is not assigned.")
                return plog.max_transaction_id

            return adm.MaxTransactionIdResponse(seq, pid, await self._on_partition(pid, max_id))
        if isinstance(msg, adm.MetricsRequest):
            return adm.MetricsResponse(seq, self.metrics_json())
        if isinstance(msg, adm.AssignedPartitionStatusRequest):
            return adm.AssignedPartitionStatusResponse(seq, tuple(self.statuses()))
        raise RemoteProtocolError(f"{type(msg).__name__} is not an admin request")

    async def _serve_admin(self, conn: FramedConnection) -> None:
        if self._peer_refused(conn, "admin"):
            return
        opened = False
        with contextlib.suppress(ConnectionError_):
            while True:
                payload = await conn.receive()
                try:
                    msg = adm.decode(payload)
                except RemoteProtocolError as e:
                    _peer_warnings.warning(
                        conn.source,
                        reason_kind("admin-decode", e),
                        "closing admin connection from %s: %s",
                        conn.peername,
                        e,
                    )
                    return
                resp: adm.AdminMessage
                try:
                    if isinstance(msg, adm.NodeIdentityRequest):
                        # Before the open on purpose: a tool rebuilding lost metadata learns the key here.
                        resp = adm.NodeIdentityResponse(
                            msg.seq_num, self.control.key, self.control.num_partitions, self.port
                        )
                    elif isinstance(msg, adm.AdminOpenRequest):
                        self._check_identity(msg.cluster_key, msg.num_partitions)
                        opened = True
                        resp = adm.AdminSuccessResponse(msg.seq_num)
                    else:
                        resp = await self._admin_request(msg, opened)
                except WaltzError as e:
                    resp = adm.failure_from_error(msg.seq_num, e)
                try:
                    conn.send(adm.encode(resp))
                    await conn.drain()
                except ClosedResourceError:
                    return


class _DataSession:
    """One data connection's requests: decoded, checked and queued (or, for an append the partition can take
    at once, written and answered) in the transport's callback that read them (see
    :meth:`FramedConnection.serve_payloads`). What has to wait (a full queue or connection bound, a new
    session id to confirm) continues in the connection's task, reading paused, so requests keep their order
    and a peer that floods is pushed back by TCP."""

    def __init__(self, node: StorageNode, conn: FramedConnection) -> None:
        self.node = node
        self.conn = conn
        self.opened = False
        self.slots = _InFlight(node.config.connection_max_in_flight)
        """Unanswered requests of this connection (bounded)."""
        self.budget = ByteBudget(node.config.connection_max_response_bytes)
        """Bytes of read responses this connection may hold (bounded)."""

    def on_payload(self, payload: bytes) -> Awaitable[None] | None:
        node = self.node
        conn = self.conn
        try:
            msg = st.decode(payload)
        except RemoteProtocolError as e:
            _peer_warnings.warning(
                conn.source,
                reason_kind("decode", e),
                "closing storage connection from %s: %s",
                conn.peername,
                e,
            )
            raise  # ends serving; the connection is closed
        if not self.opened or type(msg) is st.OpenRequest:
            self._open(msg)
            return None
        partitions = node.partitions
        if not 0 <= msg.partition_id < len(partitions):
            err = PartitionNotAssignedError(f"Partition:{msg.partition_id} does not exist.")
            conn.send(st.encode(st.failure_from_error(msg.session_id, msg.seq_num, msg.partition_id, err)))
            return None
        part = partitions[msg.partition_id]
        if msg.session_id > part.session_id:
            return self._admit_new_session(msg, part)
        return self._admit(msg, part)

    def _open(self, msg: st.StorageMessage) -> None:
        conn = self.conn
        if isinstance(msg, st.OpenRequest):
            resp: st.StorageMessage
            try:
                self.node._check_identity(msg.cluster_key, msg.num_partitions)
                self.opened = True
                resp = st.SuccessResponse(msg.session_id, msg.seq_num, msg.partition_id)
            except ClusterKeyMismatchError as e:
                _peer_warnings.warning(
                    conn.source, reason_kind("open", e), "refusing open from %s: %s", conn.peername, e
                )
                resp = st.failure_from_error(msg.session_id, msg.seq_num, msg.partition_id, e)
            conn.send(st.encode(resp))
            return
        err = ClusterKeyMismatchError("the connection has not been opened with the cluster key")
        conn.send(st.encode(st.failure_from_error(msg.session_id, msg.seq_num, msg.partition_id, err)))

    async def _admit_new_session(self, msg: st.StorageMessage, part: StoragePartition) -> None:
        """A request whose session id is newer than the partition's: confirmed (or refused), then fencing."""
        node = self.node
        conn = self.conn
        # Offline requests too: an offline SetLowWaterMark persists a newer id (recover-partition adopts its
        # source's), so a forged one must not get through that way either.
        refusal = await node._session_refusal(part, msg.session_id, conn.peername)
        if refusal is not None:
            conn.send(
                st.encode(st.failure_from_error(msg.session_id, msg.seq_num, msg.partition_id, refusal))
            )
            return
        offline = bool(getattr(msg, "offline", False) or getattr(msg, "used_by_offline_recovery", False))
        if not offline and msg.session_id > part.session_id:
            log.info(
                "partition %d: session %d from %s fences session %d",
                part.partition_id,
                msg.session_id,
                conn.peername,
                part.session_id,
            )
            part.session_id = msg.session_id  # fence older sessions on arrival
            node.metrics.session.labels(part.partition_id).set(part.session_id)
        pending = self._admit(msg, part)
        if pending is not None:
            await pending

    def _admit(self, msg: st.StorageMessage, part: StoragePartition) -> Awaitable[None] | None:
        """Queue ``msg`` for its partition (or commit an append at once); an awaitable if it has to wait."""
        append = type(msg) is st.AppendRequest
        reserved = 0 if append else _response_estimate(msg)
        if not self.slots.try_acquire():
            return self._admit_waiting(msg, part, reserved)
        if reserved and not self.budget.try_acquire(reserved):
            self.slots.release()
            return self._admit_waiting(msg, part, reserved)
        item = _Item(
            msg, self.conn, slot=self.slots, arrived_s=time.monotonic(), budget=self.budget, reserved=reserved
        )
        if append and part.may_commit_now and not self.conn.read_ahead:
            # Not when more requests were read behind it: those appends would each take an fsync of their
            # own here, one after the other; queued, the worker writes them together and fsyncs once.
            part.commit_now(item)
            return None
        if part.enqueue_nowait(item):
            return None
        return part.enqueue(item)

    async def _admit_waiting(self, msg: st.StorageMessage, part: StoragePartition, reserved: int) -> None:
        await self.slots.acquire()  # bounded unanswered requests per connection
        if reserved:
            await self.budget.acquire(reserved)  # bounded bytes of read responses per connection
        item = _Item(
            msg, self.conn, slot=self.slots, arrived_s=time.monotonic(), budget=self.budget, reserved=reserved
        )
        await part.enqueue(item)


def load_cluster_identity(config: StorageConfig) -> tuple[uuid.UUID, int]:
    """The cluster key and partition count: from ZooKeeper when configured, else from the config file.

    Blocking (talks to ZooKeeper); call it before the event loop starts or through ``asyncio.to_thread``.
    """
    if config.zookeeper_connect:
        from waltz.cluster import zk
        from waltz.cluster.store_metadata import read_store_params

        client = zk.connect(
            config.zookeeper_connect,
            session_timeout_ms=config.zookeeper_session_timeout_ms,
            connect_timeout_ms=config.zookeeper_connect_timeout_ms,
            auth=config.zookeeper_auth,
        )
        try:
            params = read_store_params(client, config.cluster_root)
        finally:
            zk.close(client)
        return params.cluster_key, params.num_partitions
    assert config.cluster_key is not None  # StorageConfig guarantees it without ZooKeeper
    return config.cluster_key, config.num_partitions


def _tls_note(tls: TlsConfig) -> str:
    if not tls.enabled:
        return ""
    return ", TLS with client certificates" if tls.ca_file else ", TLS"


async def run_node(config: StorageConfig, *, ready: Callable[[StorageNode], None] | None = None) -> None:
    """Run a storage node until SIGTERM/SIGINT (or cancellation), then close it cleanly."""
    info = build_info()
    log.info(
        "waltz storage node %s starting (python %s%s): directory %s, %s, %s:%d admin %d HTTP %s, TLS %s",
        info["version"],
        info["python"],
        f", commit {info['commit'][:12]}" if "commit" in info else "",
        config.directory,
        f"zookeeper {config.zookeeper_connect} cluster {config.cluster_root}"
        if config.zookeeper_connect
        else "standalone",
        config.host,
        config.port,
        config.admin_port,
        config.http_port or "off",
        "on" if config.tls.enabled else "off",
    )
    key, num_partitions = await asyncio.to_thread(load_cluster_identity, config)
    zk_client = None
    authority: SessionAuthority | None = None
    if config.zookeeper_connect:
        from waltz.cluster import zk

        # Kept for the node's lifetime: new session ids are checked against the partitions' metadata.
        zk_client = await asyncio.to_thread(
            zk.connect,
            config.zookeeper_connect,
            session_timeout_ms=config.zookeeper_session_timeout_ms,
            connect_timeout_ms=config.zookeeper_connect_timeout_ms,
            auth=config.zookeeper_auth,
        )
        authority = ZkSessionAuthority(zk_client, config.cluster_root, SESSION_CHECK_TIMEOUT_S)
    try:
        node = await StorageNode.start(config, key, num_partitions, authority)
        tune_gc()
        tune_malloc()
        if os.environ.get(FAULTS_ENV) == "1":
            import signal

            log.warning(
                "%s=1: SIGUSR1 makes the next data-file fsync fail (test-only fault injection)", FAULTS_ENV
            )
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, FAULTS.fail_next_fsync)
        try:
            if ready is not None:
                ready(node)
            await wait_for_stop_signal()
        finally:
            await node.aclose()
    finally:
        if zk_client is not None:
            from waltz.cluster import zk

            await asyncio.to_thread(zk.close, zk_client)
        log.info("storage node stopped")
