"""``AsyncWaltzClient``: the driver-independent client core, on one asyncio event loop.

What it does, per partition:

* **mount**: asks the application for its high-water mark (``client_high_water_mark``), then has the driver
  stream the feed from there (see :mod:`waltz.client.driver`);
* **feed**: every committed transaction goes through the :class:`~waltz.client.monitor.TransactionMonitor`
  (which resolves our own appends) and into a bounded queue; one *applier* task per partition hands the
  transactions to ``apply_transaction`` one at a time, in id order, on a callback thread;
* **contexts**: each submitted :class:`~waltz.client.context.TransactionContext` is a *run* (its lifecycle,
  :mod:`~waltz.client.lifecycle`): executed and appended by ``submit``, its append's verdict heard from the
  monitor and, on failure, executed again by a retry task after a backoff, until it is appended, gives up,
  raises or expires;
* **back pressure**: a partition admits at most ``client.maxConcurrentTransactions`` runs at a time; a run
  holds its slot until its context is appended or ends, so the appends outstanding on the wire never exceed
  that number either. ``submit`` waits up to ``client.submitTimeout`` for a slot;
* **nudge**: a task sends a flush for any partition whose appends have been pending longer than
  ``client.longWaitThreshold``, so a lost append is detected even when the application is idle.

Split by role: a context's fate is the pure :class:`~waltz.client.lifecycle.Lifecycle`, turns on write locks
the pure :class:`~waltz.client.lock_queue.LockQueue`, the fate of appends the pure
:class:`~waltz.client.monitor.TransactionMonitor`; the records of partitions and contexts are in
:mod:`waltz.client.state`. The code that drives them is split along its seams, one mixin of
:class:`AsyncWaltzClient` per module: :mod:`~waltz.client.submission` (``submit`` and the first attempt),
:mod:`~waltz.client.attempts` (an append sent, its fate, the retry path), :mod:`~waltz.client.hooks` (the
context hooks), :mod:`~waltz.client.applier` (a partition's mount, feed and applier), over the state and
helpers of :mod:`~waltz.client.base`; this module holds start, close and the public operations.

Threading guarantee: all state here lives on the event loop. Application code (``execute``, the context hooks,
``ClientCallbacks``) runs on a :class:`~waltz.client.pool.CallbackPool` of ``client.numConsumerThreads``
threads ("waltz-callback-N"); for one partition ``apply_transaction`` calls are strictly sequential and in
transaction-id order, so a slow callback delays only its own partition's feed, never the network or other
partitions. Every task is owned by the client and cancelled by :meth:`AsyncWaltzClient.close`.

Cost per transaction (the fast path): ``submit`` makes one callback-thread call (``partition_id`` and, with a
free slot on a ready partition, ``execute``) and sends the append without a task (the appends of one loop
iteration leave in one write); the append's fate comes back through a callback (a socket read's feed
entries of a partition in one call, ``_feed_run_nowait``); ``on_completion``/``on_application`` are queued
and run as one callback job per event-loop iteration; the applier hands runs of the feed to one job.
Anything unusual (no free slot, the partition not mounted, an append not committed) continues in a
retry task up to the next send; every append's verdict reaches its run the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING

from waltz.client.applier import ApplierMixin, Listener
from waltz.client.base import DataSource
from waltz.client.config import ClientConfig
from waltz.client.driver import MountState
from waltz.client.lifecycle import Event
from waltz.client.pool import CallbackPool
from waltz.client.submission import SubmissionMixin
from waltz.errors import (
    ClientAheadError,
    ClientClosedError,
    ClientError,
    ClientTimeoutError,
)

if TYPE_CHECKING:  # ZooKeeper's code loads only with the network driver.
    from waltz.cluster.trim_points import TrimOutcome

__all__ = ["AsyncWaltzClient"]

log = logging.getLogger(__name__)


_READY = MountState.READY
_MASK32 = 0xFFFFFFFF


class AsyncWaltzClient(SubmissionMixin, ApplierMixin):
    """A Waltz client for asyncio applications.

    Use ``async with AsyncWaltzClient(callbacks, config) as client:`` (or ``await client.start()`` and
    ``await client.close()``). Every method must be called on the loop that started the client; for threads,
    use :class:`waltz.client.sync.WaltzClient`. ``driver`` (or ``config.mock_driver``) replaces the network
    driver, for tests with :class:`waltz.testing.MockDriver`. ``metrics_registry`` (a prometheus_client
    ``CollectorRegistry``, e.g. ``prometheus_client.REGISTRY``) turns on the client's ``waltz_client_*``
    metrics there, from start to close (:mod:`waltz.client.metrics`); without it (the default) none are kept.
    """

    async def start(self) -> None:
        """Connect through the driver and, with ``client.autoMount``, start mounting every partition."""
        if self._started:
            raise ClientError("the client is already started")
        if self._closed:
            raise ClientClosedError("the client is closed")
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._source = DataSource(self, self._loop)
        self._pool = CallbackPool(self._loop, self._config.num_consumer_threads, "waltz-callback")
        if self._driver_arg is None:
            self._config.require_cluster()
            # Imported here: a client over the MockDriver never loads the network (nor ZooKeeper's) code.
            from waltz.client.network import NetworkDriver

            self._driver_arg = NetworkDriver(self._config)
        try:
            await self._driver_arg.open(Listener(self))
        except BaseException:
            await asyncio.to_thread(self._pool.shutdown)
            raise
        self._driver = self._driver_arg
        # Constant once the driver is open.
        self._client_id = self._driver.client_id
        self._client_msb = (self._client_id & _MASK32) << 32  # The client's half of every ReqId.msb.
        self._num_partitions = self._driver.num_partitions
        if self._metrics is not None:
            driver = self._driver
            # The network driver's ZooKeeper session, read when scraped (a mock driver has none).
            has_zk = hasattr(type(driver), "zookeeper_client")
            self._metrics.register((lambda: getattr(driver, "zookeeper_client", None)) if has_zk else None)
        if self._config.auto_mount:
            for partition_id in range(self._driver.num_partitions):
                self._add_partition(partition_id)
        self._spawn(self._nudge_loop(), "waltz-nudge")
        self._runners.start()

    async def close(self) -> None:
        """Stop: contexts still in flight end with ``on_exception(ClientClosedError)``; nothing is flushed.

        Idempotent. Waits for callbacks already running to return.
        """
        if self._closed:
            return
        self._closed = True
        closed = ClientClosedError("the client was closed")
        for partition in self._partitions.values():
            partition.error = closed
            partition.notify()
            partition.slots.wake_threads()  # A sync client's threads waiting for room find it closed.
        self._runners.closing = True
        await self._tasks.aclose()
        for run in list(self._runs):
            await self._end_with_exception(run, closed, Event.CLOSE)
        if self._driver is not None:
            try:
                await self._driver.close()
            except Exception:
                log.exception("closing the client driver failed")
        self._flush_hooks()  # Terminal hooks already decided still run.
        self._readahead.clear()
        if self._pool is not None:
            await asyncio.to_thread(self._pool.shutdown)
        if self._metrics is not None:
            self._metrics.unregister()

    async def __aenter__(self) -> AsyncWaltzClient:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def client_id(self) -> int:
        """This client's id, unique in the cluster."""
        return self._require_driver().client_id

    @property
    def cluster_name(self) -> str:
        return self._require_driver().cluster_name

    @property
    def num_partitions(self) -> int:
        return self._require_driver().num_partitions

    @property
    def partitions(self) -> frozenset[int]:
        """The partitions this client mounts."""
        return frozenset(self._partitions)

    @property
    def config(self) -> ClientConfig:
        return self._config

    async def flush_transactions(self, timeout: float | None = None) -> None:
        """Wait until every context submitted before this call has ended and, if it was appended, has been
        applied by this client (``on_application`` ran). Sends a flush to every partition with pending
        appends, so lost appends are detected at once. ``timeout`` in seconds (None: no limit) raises
        :class:`~waltz.errors.ClientTimeoutError`."""
        self._check_open()
        waiting = [run.done() for run in self._runs]
        for partition in self._partitions.values():
            if partition.monitor is not None and partition.state is _READY:
                req_id = partition.monitor.flush_request(self._clock())
                if req_id is not None:
                    self._send_flush(partition.id, req_id)
        if not waiting:
            return
        done, _ = await asyncio.wait(waiting, timeout=timeout)
        if len(done) < len(waiting):
            raise ClientTimeoutError(
                f"flush_transactions timed out after {timeout} s: "
                f"{len(waiting) - len(done)} contexts still in flight"
            )
        if self._closed:
            raise ClientClosedError("the client was closed during flush_transactions")

    def has_pending_transactions(self) -> bool:
        """True while a submitted context has not ended (or its transaction has not been applied yet)."""
        return bool(self._runs)

    def applied_high_water_mark(self, partition_id: int) -> int:
        """The id of the last transaction of ``partition_id`` this client knows the application applied:
        ``client_high_water_mark`` at the mount, then the last ``apply_transaction`` that returned (or a
        transaction skipped, see :class:`~waltz.client.api.ApplyAction`); -1 before the mount asked the
        application. Only grows while the partition stays mounted (released by :meth:`set_partitions` and
        mounted again, it starts over from -1). No I/O, and safe to call from any thread.

        This is the high-water mark the next ``execute`` on the partition gets in its builder, so the locks
        of that append are checked against it. An application that reads its own state (which
        ``apply_transaction`` changes *before* it returns to the client) and then submits, can see a
        transaction the client does not count as applied yet: the append would fail its lock check once
        against that transaction (a false conflict, retried). :meth:`wait_applied` waits that gap out.

        Raises :class:`~waltz.errors.ClientError` for a partition this client does not mount.
        """
        partition = self._partitions.get(partition_id)
        if partition is None:
            raise self._not_mounted(partition_id)
        monitor = partition.monitor
        return -1 if monitor is None else monitor.applied_high_water_mark

    async def wait_applied(
        self, partition_id: int, transaction_id: int, timeout: float | None = None
    ) -> None:
        """Wait until :meth:`applied_high_water_mark` of ``partition_id`` reaches ``transaction_id``.

        ``timeout`` in seconds (None: no limit) raises :class:`~waltz.errors.ClientTimeoutError`; a
        partition released by :meth:`set_partitions` (or the client closed) meanwhile raises the error that
        ended it, and a mount that found the client ahead of the server (``CLIENT_AHEAD``, final until the
        partition's owner or generation changes) :class:`~waltz.errors.ClientAheadError` for a transaction
        past the application's own mark; a mount below the partition's trim point raises
        :class:`~waltz.errors.TrimmedError`.
        """
        self._check_open()
        partition = self._partitions.get(partition_id)
        if partition is None:
            raise self._not_mounted(partition_id)
        try:
            async with asyncio.timeout(timeout):
                # CLIENT_AHEAD is final for the current owner: nothing past the application's own mark is fed,
                # and the wait would only end in its timeout (or never).
                while partition.monitor is None or partition.monitor.applied_high_water_mark < transaction_id:
                    if partition.error is not None:
                        raise partition.error
                    if partition.state is MountState.CLIENT_AHEAD:
                        raise ClientAheadError(
                            f"partition {partition_id}: the application's high-water mark is ahead of the "
                            f"server's, transaction {transaction_id} will not be fed"
                        )
                    await partition.changed()
        except TimeoutError:
            raise ClientTimeoutError(
                f"partition {partition_id}: transaction {transaction_id} not applied within {timeout} s "
                f"(applied up to {self.applied_high_water_mark(partition_id)})"
            ) from None

    async def high_water_mark(self, partition_id: int) -> int:
        """The partition's high-water mark (an RPC, retried within ``client.requestTimeout``)."""
        self._check_open()
        driver = self._require_driver()
        if not 0 <= partition_id < driver.num_partitions:
            raise ClientError(f"partition {partition_id} outside 0..{driver.num_partitions - 1}")
        return await self._rpc(
            lambda: driver.high_water_mark(partition_id), f"high_water_mark({partition_id})"
        )

    async def trim(
        self,
        partition_id: int,
        transaction_id: int,
        *,
        min_kept_transactions: int | None = None,
    ) -> TrimOutcome:
        """Raise the partition's trim point to ``transaction_id`` (the lowest id kept), as ``waltz cluster
        trim --to`` does: for an application that snapshotted its state at high-water mark ``H``, trim to
        ``H + 1``. The same rules hold: the trim point only moves up (a lower one is a no-op, said in the
        outcome's message), never above the committed high-water mark + 1, and never into the grace of the
        ``min_kept_transactions`` most recent transactions (default 1000, as the command's ``--min-kept``);
        a refusal raises
        :class:`~waltz.errors.MetadataError` naming the partition, and nothing changes."""
        high_water_mark = await self.high_water_mark(partition_id)
        raise_in_zk = getattr(self._require_driver(), "raise_trim_point", None)
        if raise_in_zk is None:
            raise ClientError("this client's driver cannot trim (it is not connected to a cluster)")
        outcome: TrimOutcome = await raise_in_zk(
            partition_id, transaction_id, high_water_mark, min_kept_transactions
        )
        return outcome

    async def set_partitions(self, partition_ids: Iterable[int]) -> None:
        """Mount exactly ``partition_ids`` (only with ``client.autoMount: false``).

        Contexts in flight on a released partition end with ``on_exception(ClientError)``.
        """
        self._check_open()
        if self._config.auto_mount:
            raise ClientError(
                "set_partitions needs client.autoMount: false (this client mounts every partition)"
            )
        driver = self._require_driver()
        wanted = set(partition_ids)
        bad = sorted(p for p in wanted if not (isinstance(p, int) and 0 <= p < driver.num_partitions))
        if bad:
            raise ClientError(f"partitions {bad} outside 0..{driver.num_partitions - 1}")
        for partition_id in sorted(set(self._partitions) - wanted):
            partition = self._partitions.pop(partition_id)
            self._stop_partition(
                partition, ClientError(f"partition {partition_id} was released by set_partitions")
            )
            for task in partition.tasks:
                task.cancel()
            await driver.unmount(partition_id)
        for partition_id in sorted(wanted - set(self._partitions)):
            self._add_partition(partition_id)
