"""An in-memory Waltz cluster for tests: :class:`MockCluster` (the partitions) and :class:`MockDriver` (one
client's connection to it). Public entry point: :mod:`waltz.testing`.

The mock keeps what applications rely on and drops the machinery:

* each partition is a list of records with dense ids from 0, and an **exact** lock map (lock hash → id of
  the last transaction that took it) honouring the three lock kinds: write locks are checked and taken, read
  locks are checked only, append locks are taken only. A check fails when a lock was taken by a transaction
  after the append's client high-water mark. (The real server hashes locks into a fixed table, which can add
  false conflicts; the mock never does.)
* a failed append sends nothing back, a lock conflict sends a lock failure, a flush is answered with the
  high-water mark once the client's earlier appends are processed, the feed streams (id, request id, header)
  in order, and ``READY`` comes after the feed caught up with the log as it was at mount time;
* fault injection per driver: a random fault rate (silently dropped appends), forced append and lock
  failures, random delays, feed suspension, a simulated connection loss (in-flight requests and responses
  lost, then a re-mount), corrupted data fetches.

Several drivers (one per simulated client, each on its own event loop or thread) may share one
:class:`MockCluster`; the cluster is thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from waltz.client.builder import TransactionBuilder
from waltz.client.driver import AppendRequest, ClientDriver, DriverListener, MountState
from waltz.client.tasks import TaskSet
from waltz.errors import BrokenResourceError, ClientError, PartitionNotReadyError
from waltz.protocol.records import Record, ReqId

__all__ = ["MockCluster", "MockDriver"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What the mock server did with an append."""

    kind: Literal["committed", "lock_failure"]
    transaction_id: int


class _MockPartition:
    def __init__(self, partition_id: int) -> None:
        self.id = partition_id
        self.records: list[Record] = []
        self.locks: dict[int, int] = {}
        self.watchers: set[Callable[[], None]] = set()


class MockCluster:
    """In-memory partitions shared by the :class:`MockDriver` of every simulated client. Thread-safe."""

    def __init__(self, num_partitions: int = 1, cluster_name: str = "mock-cluster") -> None:
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be at least 1, got {num_partitions}")
        self.num_partitions = num_partitions
        self.cluster_name = cluster_name
        self._lock = threading.Lock()
        self._partitions = [_MockPartition(i) for i in range(num_partitions)]
        self._next_client_id = 0

    def new_client_id(self) -> int:
        """A client id no other driver of this cluster got from here."""
        with self._lock:
            client_id = self._next_client_id
            self._next_client_id += 1
            return client_id

    def high_water_mark(self, partition_id: int) -> int:
        """The id of the partition's last transaction (-1 if empty)."""
        with self._lock:
            return len(self._partition(partition_id).records) - 1

    def records(self, partition_id: int) -> list[Record]:
        """A copy of the partition's log."""
        with self._lock:
            return list(self._partition(partition_id).records)

    def record(self, partition_id: int, transaction_id: int) -> Record | None:
        with self._lock:
            records = self._partition(partition_id).records
            return records[transaction_id] if 0 <= transaction_id < len(records) else None

    def append(
        self, partition_id: int, request: AppendRequest, *, force_lock_failure: bool = False
    ) -> AppendResult:
        """Check the locks and commit ``request`` (or report the conflict), as one atomic step."""
        with self._lock:
            partition = self._partition(partition_id)
            hwm = len(partition.records) - 1
            if force_lock_failure:
                return AppendResult("lock_failure", hwm)
            estimate = max(
                (partition.locks.get(h, -1) for h in (*request.write_locks, *request.read_locks)), default=-1
            )
            if estimate > request.client_high_water_mark:
                return AppendResult("lock_failure", estimate)
            txn = hwm + 1
            partition.records.append(
                Record(txn, request.req_id, request.header, request.data, request.checksum)
            )
            for h in (*request.write_locks, *request.append_locks):
                partition.locks[h] = txn
            watchers = list(partition.watchers)
        for wake in watchers:
            wake()
        return AppendResult("committed", txn)

    def watch(self, partition_id: int, wake: Callable[[], None]) -> None:
        """Call ``wake()`` (from the committing thread) after every commit to the partition."""
        with self._lock:
            self._partition(partition_id).watchers.add(wake)

    def unwatch(self, partition_id: int, wake: Callable[[], None]) -> None:
        with self._lock:
            self._partition(partition_id).watchers.discard(wake)

    def _partition(self, partition_id: int) -> _MockPartition:
        if not 0 <= partition_id < self.num_partitions:
            raise ClientError(f"partition {partition_id} outside 0..{self.num_partitions - 1}")
        return self._partitions[partition_id]


_Outbound = tuple[Literal["append"], AppendRequest] | tuple[Literal["flush"], ReqId]


class _Stream:
    """One mounted partition of one driver: a sender task (requests, with delays and faults) and a delivery
    task (mount, then responses and feed, each awaited in order)."""

    def __init__(self, driver: MockDriver, partition_id: int, client_high_water_mark: int) -> None:
        self.driver = driver
        self.partition_id = partition_id
        self.position = client_high_water_mark  # Last feed id delivered; kept across reconnects.
        self.outbox: deque[_Outbound] = deque()
        self.inbox: deque[tuple[str, ReqId, int]] = deque()
        self.ready = False
        self.deaf = False  # Wedged: requests vanish unanswered (see MockDriver.wedge).
        self.mute = False  # Wedged: nothing comes back (see MockDriver.wedge).
        self.wake_sender = asyncio.Event()
        self.wake_delivery = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()

        def wake_from_any_thread() -> None:
            try:
                loop.call_soon_threadsafe(self.wake_delivery.set)
            except RuntimeError:
                pass  # The loop is closed: the client is gone.

        self.wake = wake_from_any_thread

    def start(self, initial_delay_s: float = 0.0) -> None:
        name = f"mock-p{self.partition_id}-c{self.driver.client_id}"
        self.tasks = [
            self.driver._tasks.spawn(self._deliver(initial_delay_s), f"{name}-deliver"),
            self.driver._tasks.spawn(self._send(), f"{name}-send"),
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        self.ready = False

    async def _send(self) -> None:
        driver = self.driver
        cluster = driver.cluster
        while True:
            while not self.outbox:
                self.wake_sender.clear()
                await self.wake_sender.wait()
            if driver.max_delay_ms > 0:
                await asyncio.sleep(driver.rng.uniform(0, driver.max_delay_ms) / 1000)
            if not self.outbox:
                continue  # Lost to a simulated disconnect while we waited.
            item = self.outbox.popleft()
            if self.deaf:
                continue
            if item[0] == "flush":
                self.inbox.append(("flush", item[1], cluster.high_water_mark(self.partition_id)))
            else:
                request = item[1]
                driver.appends_received += 1
                if driver._fail_next_appends > 0:
                    driver._fail_next_appends -= 1
                    driver.appends_dropped += 1
                    continue
                if driver.fault_rate > 0 and driver.rng.random() < driver.fault_rate:
                    driver.appends_dropped += 1
                    continue
                force_lock = driver._fail_next_locks > 0
                if force_lock:
                    driver._fail_next_locks -= 1
                result = cluster.append(self.partition_id, request, force_lock_failure=force_lock)
                if result.kind == "lock_failure":
                    driver.lock_failures += 1
                    self.inbox.append(("lock", request.req_id, result.transaction_id))
            self.wake_delivery.set()

    async def _deliver(self, initial_delay_s: float) -> None:
        driver = self.driver
        listener = driver.listener
        cluster = driver.cluster
        p = self.partition_id
        if initial_delay_s > 0:
            await asyncio.sleep(initial_delay_s)
        target = cluster.high_water_mark(p)
        if self.position > target:
            await listener.on_mount_state(p, MountState.CLIENT_AHEAD)
            return
        while self.position < target:
            await self._deliver_record(self.position + 1)
        self.ready = True
        await listener.on_mount_state(p, MountState.READY)
        while True:
            self.wake_delivery.clear()
            if self.mute:
                await self.wake_delivery.wait()
                continue
            if self.inbox:
                kind, req_id, txn = self.inbox.popleft()
                if kind == "flush":
                    await listener.on_flush_response(p, req_id, txn)
                else:
                    await listener.on_lock_failure(p, req_id, txn)
                continue
            if not driver.feed_suspended and self.position < cluster.high_water_mark(p):
                await self._deliver_record(self.position + 1)
                continue
            await self.wake_delivery.wait()

    async def _deliver_record(self, transaction_id: int) -> None:
        record = self.driver.cluster.record(self.partition_id, transaction_id)
        if record is None:
            raise ClientError(f"mock: record {transaction_id} of partition {self.partition_id} vanished")
        await self.driver.listener.on_feed_data(
            self.partition_id, record.transaction_id, record.req_id, record.header
        )
        self.position = transaction_id


class MockDriver(ClientDriver):
    """A :class:`~waltz.client.driver.ClientDriver` backed by a :class:`MockCluster` (no network).

    ``MockDriver()`` is client 0 of a private one-partition cluster. To simulate several clients, share a
    cluster: ``MockDriver(cluster=cluster)`` for each (client ids are handed out by the cluster unless given).
    ``seed`` makes fault injection and delays reproducible.

    One driver serves one client; the fault controls below may be called from any thread (they only set
    fields read by the client's loop).
    """

    def __init__(
        self,
        client_id: int | None = None,
        cluster: MockCluster | None = None,
        *,
        num_partitions: int = 1,
        seed: int | None = None,
        generation: int = 0,
    ) -> None:
        self.cluster = cluster if cluster is not None else MockCluster(num_partitions)
        self._client_id = client_id if client_id is not None else self.cluster.new_client_id()
        self._generation = generation
        self.rng = random.Random(seed)
        self.fault_rate = 0.0
        self.max_delay_ms = 0.0
        self.feed_suspended = False
        self._fail_next_appends = 0
        self._fail_next_locks = 0
        self._corrupt_next_fetches = 0
        self.appends_received = 0
        self.appends_dropped = 0
        self.lock_failures = 0
        self.resyncs = 0
        self._tasks = TaskSet(self._task_failed)  # Its streams' senders and deliveries, resyncs.
        self._listener: DriverListener | None = None
        self._streams: dict[int, _Stream] = {}
        self._closed = False

    # -- fault injection ---------------------------------------------------------------------------------

    def set_fault_rate(self, rate: float) -> None:
        """Drop this fraction of appends silently (as a server whose store write failed would)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {rate}")
        self.fault_rate = rate

    def force_next_append_fail(self, count: int = 1) -> None:
        """Drop the next ``count`` appends silently."""
        self._fail_next_appends += count

    def force_next_lock_fail(self, count: int = 1) -> None:
        """Reject the next ``count`` appends with a lock failure (naming the current high-water mark)."""
        self._fail_next_locks += count

    def set_max_delay(self, max_delay_ms: float) -> None:
        """Delay every request (append, flush, data fetch) by a random time up to ``max_delay_ms``."""
        if max_delay_ms < 0:
            raise ValueError(f"max delay must not be negative, got {max_delay_ms}")
        self.max_delay_ms = max_delay_ms

    def suspend_feed(self) -> None:
        """Stop streaming committed transactions (responses still flow) until :meth:`resume_feed`."""
        self.feed_suspended = True

    def resume_feed(self) -> None:
        self.feed_suspended = False
        for stream in self._streams.values():
            stream.wake()

    def corrupt_next_fetch(self, count: int = 1) -> None:
        """Return a wrong checksum for the next ``count`` data fetches."""
        self._corrupt_next_fetches += count

    def wedge(self, partition_id: int, *, deaf: bool = True, mute: bool = False) -> None:
        """Wedge the partition's current stream, as a connection that stays open while the server drops
        what it gets or the link loses what comes back: ``deaf``, requests (appends, flushes) vanish
        unanswered; ``mute``, the server still appends but nothing comes back (feed, responses). The next
        stream (after :meth:`disconnect` or ``resync``) works again."""
        stream = self._streams.get(partition_id)
        if stream is None:
            raise ClientError(f"partition {partition_id} is not mounted")
        stream.deaf, stream.mute = deaf, mute

    async def disconnect(self, reconnect_delay_ms: float = 10.0) -> None:
        """Simulate losing the connection: requests and responses in flight are lost, every partition
        reports NOT_READY, and after ``reconnect_delay_ms`` re-mounts from where its feed stopped.

        Call it on the client's event loop (from a test, ``asyncio.run_coroutine_threadsafe`` for the
        threaded client).
        """
        listener = self.listener
        for partition_id, stream in list(self._streams.items()):
            await stream.stop()
            stream.outbox.clear()
            stream.inbox.clear()
            stream.deaf = stream.mute = False
            await listener.on_mount_state(partition_id, MountState.NOT_READY)
            stream.start(initial_delay_s=reconnect_delay_ms / 1000)

    # -- ClientDriver ------------------------------------------------------------------------------------

    @property
    def listener(self) -> DriverListener:
        if self._listener is None:
            raise ClientError("the mock driver is not open")
        return self._listener

    async def open(self, listener: DriverListener) -> None:
        if self._listener is not None:
            raise ClientError("a MockDriver serves one client; create one MockDriver per client")
        self._listener = listener

    @property
    def client_id(self) -> int:
        return self._client_id

    @property
    def cluster_name(self) -> str:
        return self.cluster.cluster_name

    @property
    def num_partitions(self) -> int:
        return self.cluster.num_partitions

    def generation(self, partition_id: int) -> int:
        return self._generation

    async def mount(self, partition_id: int, client_high_water_mark: int) -> None:
        if partition_id in self._streams:
            raise ClientError(f"partition {partition_id} is already mounted")
        stream = _Stream(self, partition_id, client_high_water_mark)
        self._streams[partition_id] = stream
        self.cluster.watch(partition_id, stream.wake)
        stream.start()

    async def unmount(self, partition_id: int) -> None:
        stream = self._streams.pop(partition_id, None)
        if stream is not None:
            self.cluster.unwatch(partition_id, stream.wake)
            await stream.stop()

    def send_append(self, partition_id: int, req_id: ReqId, builder: TransactionBuilder, now: bool) -> None:
        self._outbox(partition_id).append(("append", builder.build(req_id)))

    def send_flush(self, partition_id: int, req_id: ReqId) -> None:
        self._outbox(partition_id).append(("flush", req_id))

    def _outbox(self, partition_id: int) -> deque[_Outbound]:
        stream = self._streams.get(partition_id)
        if stream is None or self._closed:
            raise BrokenResourceError(f"partition {partition_id} is not mounted")
        stream.wake_sender.set()
        return stream.outbox

    def resync(self, partition_id: int) -> None:
        stream = self._streams.get(partition_id)
        if stream is None or self._closed:
            return
        self.resyncs += 1
        self._tasks.spawn(self._restart(stream), "mock-resync")

    async def _restart(self, stream: _Stream) -> None:
        """A new stream for the partition (a reconnect): what was in flight on the old one is lost."""
        await stream.stop()
        stream.outbox.clear()
        stream.inbox.clear()
        stream.deaf = stream.mute = False
        if self._streams.get(stream.partition_id) is not stream:
            return
        await self.listener.on_mount_state(stream.partition_id, MountState.NOT_READY)
        stream.start(initial_delay_s=0.01)

    async def fetch_transaction_data(self, partition_id: int, transaction_id: int) -> tuple[bytes, int]:
        if self.max_delay_ms > 0:
            await asyncio.sleep(self.rng.uniform(0, self.max_delay_ms) / 1000)
        record = self.cluster.record(partition_id, transaction_id)
        if record is None:
            raise PartitionNotReadyError(f"partition {partition_id} has no transaction {transaction_id}")
        if self._corrupt_next_fetches > 0:
            self._corrupt_next_fetches -= 1
            return record.data, record.checksum ^ 0x5A5A5A5A
        return record.data, record.checksum

    async def high_water_mark(self, partition_id: int) -> int:
        return self.cluster.high_water_mark(partition_id)

    def _task_failed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        # As the network driver's: a task it cannot serve without failed, so the client hears why (its
        # partitions stop) instead of waiting for a feed that never comes.
        failure = ClientError(f"the mock driver stopped: {task.get_name()} failed with {error!r}")
        failure.__cause__ = error
        log.error("%s", failure, exc_info=error)
        if self._listener is not None and not self._closed:
            self._listener.on_driver_failure(failure)

    async def close(self) -> None:
        self._closed = True
        await self._tasks.aclose()
        for partition_id in list(self._streams):
            await self.unmount(partition_id)
