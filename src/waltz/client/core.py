"""``AsyncWaltzClient``: the driver-independent client core, on one asyncio event loop.

What it does, per partition:

* **mount**: asks the application for its high-water mark (``client_high_water_mark``), then has the driver
  stream the feed from there (see :mod:`waltz.client.driver`);
* **feed**: every committed transaction goes through the :class:`~waltz.client.monitor.TransactionMonitor`
  (which resolves our own appends) and into a bounded queue; one *applier* task per partition hands the
  transactions to ``apply_transaction`` one at a time, in id order, on a callback thread;
* **contexts**: each submitted :class:`~waltz.client.context.TransactionContext` gets a *run* task that
  executes it, appends, waits for the monitor's verdict and, on failure, executes it again after a backoff,
  until it is appended, gives up, raises or expires;
* **back pressure**: a partition admits at most ``client.maxConcurrentTransactions`` runs at a time; a run
  holds its slot until its context is appended or ends, so the appends outstanding on the wire never exceed
  that number either. ``submit`` waits up to ``client.submitTimeout`` for a slot;
* **nudge**: a task sends a flush for any partition whose appends have been pending longer than
  ``client.longWaitThreshold``, so a lost append is detected even when the application is idle.

Split by role: a context's fate is the pure :class:`~waltz.client.lifecycle.Lifecycle`, turns on write locks
the pure :class:`~waltz.client.lock_queue.LockQueue`, the fate of appends the pure
:class:`~waltz.client.monitor.TransactionMonitor`; the records of partitions and contexts are in
:mod:`waltz.client.state`; this module drives them.

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
per-context task, the slow path, which is the original retry loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal, TypeAlias, TypeVar

from waltz.client.api import ApplyAction, ClientCallbacks
from waltz.client.builder import TransactionBuilder
from waltz.client.config import ClientConfig
from waltz.client.context import TransactionContext
from waltz.client.driver import ClientDriver, MountState
from waltz.client.lifecycle import Event, Hook, State
from waltz.client.monitor import Outcome, Resolution, TransactionMonitor
from waltz.client.pool import Call, CallbackPool, report_hook_failure
from waltz.client.retry import APPLY_RETRY, FETCH_RETRY, MAX_CHECKSUM_ATTEMPTS, RetryPolicy
from waltz.client.state import PartitionState, Run, Stuck, Waiter
from waltz.client.tasks import TaskSet
from waltz.client.transaction import Transaction, new_transactions
from waltz.errors import (
    ClientAheadError,
    ClientClosedError,
    ClientError,
    ClientTimeoutError,
    DataChecksumError,
    LocalProtocolError,
    PartitionStuckError,
    WaltzError,
)
from waltz.protocol.client_server import FeedEntry
from waltz.protocol.records import ReqId, crc32

__all__ = ["AsyncWaltzClient"]

log = logging.getLogger(__name__)

T = TypeVar("T")

APPLY_BATCH_MAX = 256
"""Most feed transactions handed to one callback thread in one job (applied one after the other)."""
STUCK_REMINDER_S = 30.0
"""After the first traceback, a partition stuck on one transaction logs a one-line reminder this often."""
STUCK_SUBMIT_AFTER = 3
"""Failed deliveries of one transaction after which ``submit`` to its partition fails with
:class:`~waltz.errors.PartitionStuckError` (the feed cannot advance, so nothing appended would be applied)."""
APPLY_BATCH_MAX_S = 0.005
"""A batch returns to the loop after this long (checked every 8 transactions, so that a fast
``apply_transaction`` does not pay for a clock read each), so the applied high-water mark (and
``on_application``) never lags far behind a slow ``apply_transaction``."""


class _Pending:
    """A first attempt whose ``execute`` returned an awaitable (a coroutine, in inline mode)."""

    __slots__ = ("awaitable", "builder")

    def __init__(self, builder: TransactionBuilder, awaitable: Awaitable[Any]) -> None:
        self.builder = builder
        self.awaitable = awaitable


_First: TypeAlias = TransactionBuilder | Literal[False] | Exception | _Pending | None
_Executed: TypeAlias = TransactionBuilder | Literal[False] | _Pending
"""A first attempt that ran ``execute`` without an exception (filled, gave up, or a coroutine to await)."""
"""What a submit's first callback-thread call returns (see ``AsyncWaltzClient._first_attempt``)."""

_READY = MountState.READY
_COMMITTED = Outcome.COMMITTED
_STATE_COMMITTED = State.COMMITTED
_ON_APPLICATION = Hook.APPLICATION

_MASK32 = 0xFFFFFFFF
_TRUE_ARGS = (True,)
_new_tuple = tuple.__new__
"""Builds a named tuple (ReqId) from a tuple in C, without its generated Python ``__new__``."""


class _Expired(Exception):
    """The error of a context past ``client.transactionTimeout`` (the lifecycle's EXPIRE, not FAIL)."""

    def __init__(self, error: ClientTimeoutError) -> None:
        super().__init__(str(error))
        self.error = error


_FAILURE_EVENTS = {Outcome.LOCK_FAILED: Event.LOCK_FAIL, Outcome.FAILED: Event.LOST}
"""The lifecycle event of an append that did not commit."""


class _Listener:
    """The :class:`~waltz.client.driver.DriverListener` the core hands its driver."""

    def __init__(self, client: AsyncWaltzClient) -> None:
        self._client = client
        # The client's own method, not a forwarding one: the network driver calls it once per feed entry.
        self.feed_data_nowait: Callable[[int, int, ReqId, int], bool] = client._feed_nowait
        # And a run of them (the network driver's reader hands each read's entries of a partition at once).
        self.feed_run_nowait: Callable[[int, list[FeedEntry]], int] = client._feed_run_nowait

    async def on_feed_data(self, partition_id: int, transaction_id: int, req_id: ReqId, header: int) -> None:
        await self._client._on_feed_data(partition_id, transaction_id, req_id, header)

    async def on_mount_state(self, partition_id: int, state: MountState) -> None:
        self._client._on_mount_state(partition_id, state)

    async def on_lock_failure(self, partition_id: int, req_id: ReqId, transaction_id: int) -> None:
        self._client._on_monitor_event(partition_id, lambda m: m.on_lock_failure(req_id, transaction_id))

    async def on_flush_response(self, partition_id: int, req_id: ReqId, transaction_id: int) -> None:
        self._client._on_monitor_event(partition_id, lambda m: m.on_flush_response(req_id, transaction_id))


class _DataSource:
    """Fetches transaction data for :class:`Transaction` objects, from the loop or from other threads."""

    def __init__(self, client: AsyncWaltzClient, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._loop = loop

    def fetch_blocking(self, partition_id: int, transaction_id: int) -> bytes:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise ClientError(
                "Transaction.get_transaction_data() blocks and cannot run on the client's event loop; "
                "use 'await transaction.fetch_transaction_data()' there"
            )
        try:
            future = asyncio.run_coroutine_threadsafe(self.fetch(partition_id, transaction_id), self._loop)
        except RuntimeError:
            raise ClientClosedError("the client is closed") from None
        return future.result()

    async def fetch(self, partition_id: int, transaction_id: int) -> bytes:
        return await self._client._fetch_data(partition_id, transaction_id)


class AsyncWaltzClient:
    """A Waltz client for asyncio applications.

    Use ``async with AsyncWaltzClient(callbacks, config) as client:`` (or ``await client.start()`` and
    ``await client.close()``). Every method must be called on the loop that started the client; for threads,
    use :class:`waltz.client.sync.WaltzClient`. ``driver`` (or ``config.mock_driver``) replaces the network
    driver, for tests with :class:`waltz.testing.MockDriver`.
    """

    def __init__(
        self,
        callbacks: ClientCallbacks,
        config: ClientConfig,
        *,
        driver: ClientDriver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._callbacks = callbacks
        self._config = config
        self._driver_arg = driver if driver is not None else config.mock_driver
        self._driver: ClientDriver | None = None
        # The driver's optional send_built (see driver.py), looked up once: the pipelined appends' path.
        self._send_built: Callable[[int, ReqId, TransactionBuilder], None] | None = None
        self._client_id = -1
        self._client_msb = 0
        self._num_partitions = 0
        self._clock = clock
        self._retry = RetryPolicy(
            initial_backoff_ms=config.retry_initial_backoff_ms,
            max_backoff_ms=config.retry_max_backoff_ms,
            max_attempts=config.max_transaction_attempts,
            timeout_ms=config.transaction_timeout_ms,
        )
        self._partitions: dict[int, PartitionState] = {}
        self._next_seq: dict[int, int] = {}  # Survives set_partitions, so request ids are never reused.
        self._runs: set[Run] = set()
        self._tasks = TaskSet(self._task_failed)  # Every task of the client; see waltz.client.tasks.
        self._pool: CallbackPool | None = None
        self._hooks: list[Call] = []  # Hooks queued during this loop iteration, run as one job.
        # Inline mode: a coroutine hook run at once (see _hook_now), awaited first by this
        # iteration's batch, with the hooks queued after it (its run leads _hook_runs).
        self._lead_awaitables: list[tuple[Callable[..., Any], Awaitable[Any]]] = []
        self._hook_runs: list[tuple[Run, bool]] = []  # (run, True: on_completion / False: on_application)
        # What application threads hand to the loop (see _hand_over), and whether a take is scheduled.
        self._handoff: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._handoff_lock = threading.Lock()
        self._handoff_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._source: _DataSource | None = None
        self._started = False
        self._closed = False
        # client.callbackMode: inline runs application code on the loop (no thread hop; see docs/client.md).
        self._inline = config.callback_mode == "inline"

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect through the driver and, with ``client.autoMount``, start mounting every partition."""
        if self._started:
            raise ClientError("the client is already started")
        if self._closed:
            raise ClientClosedError("the client is closed")
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._source = _DataSource(self, self._loop)
        self._pool = CallbackPool(self._loop, self._config.num_consumer_threads, "waltz-callback")
        if self._driver_arg is None:
            self._config.require_cluster()
            # Imported here: a client over the MockDriver never loads the network (nor ZooKeeper's) code.
            from waltz.client.network import NetworkDriver

            self._driver_arg = NetworkDriver(self._config)
        try:
            await self._driver_arg.open(_Listener(self))
        except BaseException:
            await asyncio.to_thread(self._pool.shutdown)
            raise
        self._driver = self._driver_arg
        self._send_built = getattr(self._driver, "send_built", None)
        # Constant once the driver is open.
        self._client_id = self._driver.client_id
        self._client_msb = (self._client_id & _MASK32) << 32  # The client's half of every ReqId.msb.
        self._num_partitions = self._driver.num_partitions
        if self._config.auto_mount:
            for partition_id in range(self._driver.num_partitions):
                self._add_partition(partition_id)
        self._spawn(self._nudge_loop(), "waltz-nudge")

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
        await self._tasks.aclose()
        for run in list(self._runs):
            await self._end_with_exception(run, closed, Event.CLOSE)
        if self._driver is not None:
            try:
                await self._driver.close()
            except Exception:
                log.exception("closing the client driver failed")
        self._flush_hooks()  # Terminal hooks already decided still run.
        if self._pool is not None:
            await asyncio.to_thread(self._pool.shutdown)

    async def __aenter__(self) -> AsyncWaltzClient:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- properties --------------------------------------------------------------------------------------

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

    # -- public operations -------------------------------------------------------------------------------

    async def submit(self, context: TransactionContext) -> None:
        """Execute ``context`` and append its transaction; return once the first append is sent.

        Waits (up to ``client.submitTimeout``) while the partition already has
        ``client.maxConcurrentTransactions`` contexts in flight, and (up to ``client.mountTimeout``) for
        the partition to be mounted. Failures after the return are retried in the background and reported
        through the context's hooks. If the first attempt fails with an exception (``execute`` raised, a
        timeout, ``CLIENT_AHEAD``, a closed client), ``on_exception`` is called and the exception is raised
        here as well.
        """
        pool = self._pool
        if self._closed or self._driver is None or pool is None or pool.is_shut_down:
            self._check_open()  # Raises the error that says why.
            pool = self._require_pool()
        run = Run(context)
        # Executed here, on the loop, without an await since the partition was found ready: nothing can
        # have changed it (set_partitions and close are coroutines), so it need not be checked again.
        fresh = self._inline
        try:
            first: _First
            if self._inline:
                # Zero hops: partition_id() and execute() run right here, on the loop.
                first = self._first_attempt(run, self._num_partitions)
            else:
                # One callback-thread call: partition_id() and, when a slot is free on a ready partition, the
                # first execute() too (the common case: no second hop, no task).
                first = await pool.call(
                    self._first_attempt,
                    run,
                    self._num_partitions,
                    orphan=functools.partial(self._orphaned, run),
                )
            if isinstance(first, _Pending):
                fresh = False
                first = await self._finish_first(run, first)
            partition = run.partition
            assert partition is not None
            if first is None:
                fresh = False
                await self._acquire_slot(partition)
                run.holds_slot = True
                self._check_open()
                # A slot after a wait (the common case of a loaded sync client): execute now, as the first
                # attempt does when it finds a free slot, instead of a slow-path task that waits for the
                # mount under a timeout to do the same.
                first = await self._execute_after_wait(run, partition)
            if self._closed:  # Closed while execute() ran (the driver, once set, stays).
                self._check_open()
        except Exception as e:
            self._release_slot(run)
            if run.handle(Event.FAIL) is Hook.EXCEPTION:
                await self._call_hook(context.on_exception, e)
            raise
        except BaseException:
            self._release_slot(run)
            raise
        self._runs.add(run)
        if type(first) is TransactionBuilder:  # The common case: executed and filled.
            run.execute()
            # Checked again unless fresh: execute() may have changed the partition (set_partitions, close).
            monitor = partition.monitor if fresh else self._ready_monitor(partition)
            if monitor is not None:
                # _start_first(partition, monitor, run, first), written out (once per append).
                locks = first.write_lock_hashes
                if locks:
                    wake = partition.lock_queue.take(run, locks)
                    if wake is None:  # Another context of ours holds one of them: wait for its turn.
                        run.handle(Event.QUEUE)
                        self._park(partition, run, first)
                        self._spawn(self._run_context(run), f"waltz-run-p{partition.id}")
                        return
                    if wake:
                        self._wake(wake)
                run.send()
                self._send(partition, monitor, first, run)
                return
        elif first is not None:
            run.execute()
            if isinstance(first, Exception):  # execute() raised
                await self._end_with_exception(run, first)
                raise first
            if first is False:  # execute() gave up
                self._release_slot(run)
                run.handle(Event.GIVE_UP)
                await self._call_hook(context.on_completion, False)
                self._finish(run)
                return
        # The slow path: a task executes (or sends what was executed) once the partition is mounted.
        run.first_send = asyncio.get_running_loop().create_future()
        self._spawn(self._run_context(run, first), f"waltz-run-p{partition.id}")
        await asyncio.shield(run.first_send)

    def on_callback_thread(self) -> bool:
        """True when called on one of this client's callback threads (``threads`` mode; cheap)."""
        pool = self._pool
        return pool is not None and pool.is_pool_thread()

    def submit_from_thread(self, context: TransactionContext, wait_s: float = 0.0) -> bool:
        """The zero-wait submit of :class:`~waltz.client.sync.WaltzClient`, on an application thread (never
        the loop). When the partition is mounted and has a free slot, ``partition_id`` and ``execute`` run
        right here (as on a callback thread) and the outcome goes to the loop through :meth:`_hand_over`
        (one wake-up for a burst of submits), without waiting for it: the append is sent in order before
        anything the thread asks the client afterwards. When the partition is mounted but has no free slot,
        this waits on this thread, up to ``wait_s`` seconds, for one to be released (a loaded sync client's
        common case: no coroutine, task or future per submit), and raises the ``submit`` timeout error past
        it. Returns False, having done nothing, when that is not possible (the partition not ready, the
        client not started or closed, or ``wait_s`` 0 and no free slot): the caller then uses
        :meth:`submit`, which waits on the loop. As with :meth:`submit`, an exception of the first attempt
        is raised here and reported through ``on_exception``.
        """
        loop = self._loop
        if loop is None or self._closed or self._driver is None:
            return False
        run = Run(context)
        num_partitions = self._driver.num_partitions
        deadline: float | None = None
        while True:
            try:
                first = self._first_attempt(run, num_partitions)
            except Exception as e:
                self._hand_over(loop, self._spawn_end, run, e)
                raise
            if first is not None:
                break
            partition = run.partition
            if wait_s <= 0 or partition is None or self._closed or not partition.slots.is_full:
                return False
            now = time.monotonic()
            if deadline is None:
                deadline = now + wait_s
            elif now >= deadline:
                error = self._slot_timeout_error(partition)
                self._hand_over(loop, self._spawn_end, run, error)
                raise error
            partition.slots.wait_from_thread(deadline - now)
        if isinstance(first, Exception):
            self._hand_over(loop, self._spawn_end, run, first, True)
            raise first
        self._hand_over(loop, self._continue_first, run, first)
        return True

    def submit_batch_from_thread(self, contexts: Sequence[TransactionContext]) -> int:
        """:meth:`submit_from_thread` for a run of contexts: executes the leading ones that find a free slot
        on a mounted partition, on this thread, in order, and hands them all to the loop at once (they are
        sent in this order). Returns how many were taken; the caller submits the next one with
        :meth:`submit` (which waits for room) and continues after it. An exception of a first attempt is
        raised (the contexts before it are taken; see ``submit``).
        """
        loop = self._loop
        if loop is None or self._closed or self._driver is None:
            return 0
        num_partitions = self._driver.num_partitions
        taken: list[tuple[Run, _Executed]] = []
        try:
            for context in contexts:
                run = Run(context)
                try:
                    first = self._first_attempt(run, num_partitions)
                except Exception as e:
                    if taken:
                        self._hand_over(loop, self._continue_batch, taken)
                        taken = []
                    self._hand_over(loop, self._spawn_end, run, e)
                    raise
                if first is None:
                    break
                if isinstance(first, Exception):
                    if taken:
                        self._hand_over(loop, self._continue_batch, taken)
                        taken = []
                    self._hand_over(loop, self._spawn_end, run, first, True)
                    raise first
                taken.append((run, first))
        finally:
            if taken:
                self._hand_over(loop, self._continue_batch, taken)
        return len(taken)

    def _hand_over(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
        """From an application thread: run ``fn(*args)`` on the loop, after everything handed over before.

        One ``call_soon_threadsafe`` (a handle and a wake-up of the loop) per burst instead of one per submit:
        only the first hand-over after the loop last took them schedules :meth:`_take_handed_over`. The call
        is made under the lock, so a thread that handed something over and then asks the loop anything else
        (another ``call_soon_threadsafe``) finds the first one ahead of it in the loop's queue."""
        with self._handoff_lock:
            self._handoff.append((fn, args))
            if self._handoff_scheduled:
                return
            try:
                loop.call_soon_threadsafe(self._take_handed_over)
            except BaseException:
                self._handoff.pop()
                raise
            self._handoff_scheduled = True

    def _take_handed_over(self) -> None:
        with self._handoff_lock:
            calls, self._handoff = self._handoff, []
            self._handoff_scheduled = False
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:
                # Internal code only (no application code runs directly here): keep the others going.
                log.exception("handing a submit over to the client loop failed")

    def _continue_batch(
        self, taken: list[tuple[Run, TransactionBuilder | Literal[False] | _Pending]]
    ) -> None:
        for run, first in taken:
            self._continue_first(run, first)

    def _spawn_end(self, run: Run, error: Exception, executed: bool = False) -> None:
        self._runs.add(run)
        if executed:
            run.execute()
        self._spawn(self._end_with_exception(run, error), "waltz-failed-submit")

    def _continue_first(self, run: Run, first: _Executed) -> None:
        """On the loop: what ``submit`` does after a first attempt made by :meth:`submit_from_thread`."""
        partition = run.partition
        assert partition is not None
        self._runs.add(run)
        if isinstance(first, _Pending):
            self._spawn(self._continue_pending(run, first), f"waltz-run-p{partition.id}")
            return
        run.execute()
        if first is False:
            self._release_slot(run)
            run.handle(Event.GIVE_UP)
            self._spawn(self._gave_up(run), "waltz-gave-up")
            return
        if self._closed:
            self._spawn(
                self._end_with_exception(run, ClientClosedError("the client was closed"), Event.CLOSE),
                "waltz-closed-run",
            )
            return
        monitor = self._ready_monitor(partition)
        if monitor is not None:
            self._start_first(partition, monitor, run, first)
            return
        self._spawn(self._run_context(run, first), f"waltz-run-p{partition.id}")

    async def _continue_pending(self, run: Run, pending: _Pending) -> None:
        first = await self._finish_first(run, pending)
        if isinstance(first, Exception):
            run.execute()
            await self._end_with_exception(run, first)
        else:
            self._continue_first(run, first)

    async def _gave_up(self, run: Run) -> None:
        await self._call_hook(run.context.on_completion, False)
        self._finish(run)

    def _first_attempt(self, run: Run, num_partitions: int) -> _First:
        """On a callback thread: call ``partition_id`` and, if a slot is free at once on a ready partition,
        take it and call ``execute``. Returns the filled builder, False (execute gave up), the exception
        execute raised, or None (not executed: the caller waits for a slot and the mount on the loop).

        Reads loop state without the loop: each read is atomic, and what may change under it is re-checked
        on the loop (the mount is checked again before sending). The applied high-water mark only grows and
        only after ``apply_transaction`` returned, so the value read is a safe one for the builder.
        """
        context = run.context
        partition_id = context.partition_id(num_partitions)
        if type(partition_id) is not int or not 0 <= partition_id < num_partitions:
            if isinstance(partition_id, bool) or not isinstance(partition_id, int):
                raise ClientError(f"partition_id() returned {partition_id!r}, not an int")
            if not 0 <= partition_id < num_partitions:
                raise ClientError(f"partition_id() returned {partition_id}, outside 0..{num_partitions - 1}")
        partition = self._partitions.get(partition_id)
        if partition is None:
            raise self._not_mounted(partition_id)
        run.partition = partition
        stuck = partition.stuck
        if stuck is not None and stuck.failures >= STUCK_SUBMIT_AFTER:
            raise PartitionStuckError(stuck.describe(partition_id, self._clock()))
        monitor = partition.monitor
        if (
            monitor is None
            or partition.error is not None
            or partition.state is not _READY
            or self._closed
            or (self._retry.timeout_ms > 0 and self._retry.expired(context.creation_time, time.time()))
            or not partition.slots.try_acquire()
        ):
            return None
        run.holds_slot = True
        builder = TransactionBuilder(partition_id, monitor.applied_high_water_mark)
        try:
            result: Any = context.execute(builder)
        except Exception as e:  # noqa: BLE001 - reported through on_exception by submit
            return e
        if result is True:
            return builder
        if result is not None and inspect.isawaitable(result):
            return _Pending(builder, result)  # A coroutine execute (inline mode): submit awaits it.
        return builder if result else False

    async def _execute_after_wait(
        self, run: Run, partition: PartitionState
    ) -> TransactionBuilder | Literal[False] | Exception | None:
        """``execute`` for a first attempt that waited for its slot (which it holds), if the partition is
        ready and the context not expired; None (not executed: the slow path decides) otherwise. Like
        :meth:`_first_attempt`, an exception of ``execute`` is returned, not raised."""
        monitor = self._ready_monitor(partition)
        if monitor is None or (
            self._retry.timeout_ms > 0 and self._retry.expired(run.context.creation_time, time.time())
        ):
            return None
        builder = TransactionBuilder(partition.id, monitor.applied_high_water_mark)
        try:
            result = await self._call_user(run.context.execute, builder)
        except Exception as e:  # noqa: BLE001 - reported through on_exception by submit
            return e
        return builder if result else False

    async def _finish_first(
        self, run: Run, pending: _Pending
    ) -> TransactionBuilder | Literal[False] | Exception:
        """Await a coroutine ``execute`` of a first attempt (inline mode)."""
        try:
            result = await pending.awaitable
        except asyncio.CancelledError:
            self._release_slot(run)
            raise
        except Exception as e:  # noqa: BLE001 - reported through on_exception by submit
            return e
        return pending.builder if result else False

    def _orphaned(self, run: Run, first: _First) -> None:
        """``submit`` was cancelled while its first attempt ran: give back the slot it may have taken (the
        context is dropped, as when ``submit`` is cancelled while it waits for a slot)."""
        self._release_slot(run)

    async def _acquire_slot(self, partition: PartitionState) -> None:
        try:
            await partition.slots.acquire(self._config.submit_timeout_ms / 1000)
        except TimeoutError:
            raise self._slot_timeout_error(partition) from None

    def _slot_timeout_error(self, partition: PartitionState) -> ClientError:
        """Why a submit found no free slot within ``client.submitTimeout``."""
        if partition.stuck is not None:
            return PartitionStuckError(partition.stuck.describe(partition.id, self._clock()))
        return ClientTimeoutError(
            f"submit timed out after {self._config.submit_timeout_ms} ms: partition {partition.id} "
            f"already has {partition.slots.limit} transactions in flight "
            "(client.maxConcurrentTransactions); is the feed stalled or the application overloaded?"
        )

    def _start_first(
        self, partition: PartitionState, monitor: TransactionMonitor, run: Run, first: TransactionBuilder
    ) -> None:
        """Send a run's first executed attempt to a ready partition, or park it behind this client's own
        append on one of its write locks (it then executes again on its turn)."""
        # A new run is unknown to the lock queue: without write locks it has nothing to take there.
        locks = first.write_lock_hashes
        if locks:
            wake = partition.lock_queue.take(run, locks)
            if wake is None:
                run.handle(Event.QUEUE)
                self._park(partition, run, first)
                self._spawn(self._run_context(run), f"waltz-run-p{partition.id}")
                return
            if wake:
                self._wake(wake)
        run.send()  # Before _send: a failed send resolves at once.
        self._send(partition, monitor, first, run)

    def _ready_monitor(self, partition: PartitionState) -> TransactionMonitor | None:
        """The partition's monitor if appends may be sent to it right now."""
        if (
            partition.error is None
            and partition.state is _READY
            and self._partitions.get(partition.id) is partition
        ):
            return partition.monitor
        return None

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

    def _not_mounted(self, partition_id: int) -> ClientError:
        return ClientError(
            f"partition {partition_id} is not mounted by this client "
            f"(mounted: {sorted(self._partitions)}; see set_partitions)"
        )

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
        past the application's own mark.
        """
        self._check_open()
        partition = self._partitions.get(partition_id)
        if partition is None:
            raise self._not_mounted(partition_id)
        try:
            async with asyncio.timeout(timeout):
                # _wait_applied, plus CLIENT_AHEAD: final for the current owner, so nothing past the
                # application's own mark is fed and the wait would only end in its timeout (or never). Not in
                # _wait_applied itself: a run awaits that once per append.
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

    def _stop_partition(self, partition: PartitionState, error: ClientError) -> None:
        """End the partition's use: ``error`` for everything in flight on it and everything asked of it."""
        partition.error = error
        self._fail_outcomes(partition, error)
        self._drop_awaiting_apply(partition)
        partition.notify()
        partition.slots.wake_threads()

    # -- partitions: mount, feed, apply --------------------------------------------------------------------

    def _add_partition(self, partition_id: int) -> None:
        partition = PartitionState(partition_id, self._config)
        self._partitions[partition_id] = partition
        self._spawn_partition_task(partition, self._mount(partition), f"waltz-mount-p{partition_id}")

    async def _mount(self, partition: PartitionState) -> None:
        retry = 0
        while True:
            try:
                hwm = await self._call_user(self._callbacks.client_high_water_mark, partition.id)
                if isinstance(hwm, bool) or not isinstance(hwm, int) or hwm < -1:
                    raise ClientError(
                        f"client_high_water_mark({partition.id}) returned {hwm!r}, not an int >= -1"
                    )
                break
            except Exception as e:  # noqa: BLE001 - application code: report it and ask again
                retry += 1
                await self._call_hook(self._callbacks.uncaught_exception, partition.id, -1, e)
                await asyncio.sleep(APPLY_RETRY.delay_s(retry))
        partition.monitor = TransactionMonitor(hwm)
        partition.notify()  # wait_applied may already be satisfied by the application's own mark.
        self._spawn_partition_task(partition, self._apply_loop(partition), f"waltz-apply-p{partition.id}")
        await self._require_driver().mount(partition.id, hwm)

    def _active(self, partition_id: int) -> PartitionState | None:
        partition = self._partitions.get(partition_id)
        if partition is None or partition.monitor is None or partition.error is not None:
            return None
        return partition

    def _feed_nowait(self, partition_id: int, transaction_id: int, req_id: ReqId, header: int) -> bool:
        """:meth:`_on_feed_data` without a coroutine, when the feed has room (the common case); False, having
        done nothing, when it has none (the driver then awaits ``on_feed_data``)."""
        partition = self._partitions.get(partition_id)
        if partition is None or partition.error is not None:
            return True  # Not ours (any more): dropped, as on_feed_data drops it.
        monitor = partition.monitor
        if monitor is None:
            return True
        if len(partition.feed) >= partition.feed_limit:
            return False
        source = self._source
        assert source is not None
        resolutions = monitor.on_feed(transaction_id, req_id)
        if resolutions:
            self._resolve(partition, resolutions)
        # Queued for apply_transaction after the resolutions: the applier's wake-up then follows the
        # application's (an inline on_completion that woke the task waiting for it), so that task's next
        # append goes out first and the apply runs while the server works on it (one append at a time).
        partition.push_feed(Transaction(partition_id, transaction_id, header, req_id, source))
        return True

    def _feed_run_nowait(self, partition_id: int, entries: list[FeedEntry]) -> int:
        """:meth:`_feed_nowait` of consecutive feed entries (the next ids of the partition, in order) in one
        pass: as many as the feed has room for are resolved and queued for ``apply_transaction``; returns how
        many were taken (0: the feed is full; the driver then delivers the rest through ``on_feed_data``)."""
        partition = self._partitions.get(partition_id)
        if partition is None or partition.error is not None or partition.monitor is None:
            return len(entries)  # Not ours (any more): dropped, as on_feed_data drops them.
        room = partition.feed_limit - len(partition.feed)
        if room <= 0:
            return 0
        if room < len(entries):
            entries = entries[:room]
        resolutions = partition.monitor.on_feed_run(entries)
        if resolutions:
            self._resolve(partition, resolutions)
        # Queued for apply_transaction after the resolutions (see _feed_nowait), all at once: nothing is
        # queued if a resolution raised, so the driver may deliver the same entries again.
        source = self._source
        assert source is not None
        partition.push_feed_run(new_transactions(partition_id, entries, source))
        return len(entries)

    async def _on_feed_data(self, partition_id: int, transaction_id: int, req_id: ReqId, header: int) -> None:
        partition = self._active(partition_id)
        if partition is None or partition.monitor is None:
            return
        monitor = partition.monitor
        # The driver alone owns the feed position and its density (it re-mounts from it after a reconnect and
        # drops repeats, resets on a gap): every entry it delivers is the next one (see driver.py).
        assert self._source is not None
        # Queue first: if the driver is cancelled while we wait for room, nothing has changed and it may
        # deliver the same id again. After the put nothing awaits, so the monitor sees every queued record.
        if len(partition.feed) >= partition.feed_limit:
            await partition.wait_room()
            if self._active(partition_id) is not partition:
                return
        partition.push_feed(Transaction(partition_id, transaction_id, header, req_id, self._source))
        self._resolve(partition, monitor.on_feed(transaction_id, req_id))

    def _on_mount_state(self, partition_id: int, state: MountState) -> None:
        partition = self._active(partition_id)
        if partition is None or partition.monitor is None:
            return
        partition.state = state
        partition.notify()
        if state is _READY:
            # Appends carry the generation of this mount (see "Request ids" in driver.py): read once here,
            # into the high half of their request ids (the client id and the generation, the same for all).
            generation = self._require_driver().generation(partition_id)
            partition.req_msb = self._client_msb | (generation & _MASK32)
            # Appends sent on an earlier connection may be lost; a flush resolves them (see driver.py).
            req_id = partition.monitor.flush_request(self._clock())
            if req_id is not None:
                self._send_flush(partition_id, req_id)
        elif state is MountState.CLIENT_AHEAD:
            log.error(
                "partition %d: the application's high-water mark %d is ahead of the server's",
                partition_id,
                partition.monitor.applied_high_water_mark,
            )
            # Final for the current owner: appends still pending can no longer be resolved here.
            self._fail_outcomes(
                partition, ClientAheadError(f"partition {partition_id}: client ahead of server")
            )

    def _on_monitor_event(
        self, partition_id: int, event: Callable[[TransactionMonitor], list[Resolution]]
    ) -> None:
        partition = self._active(partition_id)
        if partition is not None and partition.monitor is not None:
            self._resolve(partition, event(partition.monitor))

    def _resolve(self, partition: PartitionState, resolutions: list[Resolution]) -> None:
        """Hand each resolution to what waits for it: a committed first attempt is finished here (its slot,
        its lifecycle, ``on_completion``), anything else through :meth:`_on_first_outcome` or the slow
        path's future. Once per feed run, not per append: the slots of the committed runs are given back
        in one ``Slots.release`` (one lock round) after the loop."""
        outcomes = partition.outcomes
        awaiting_apply = partition.awaiting_apply
        inline = self._inline
        released = 0
        try:
            for resolution in resolutions:
                run = outcomes.pop(resolution.req_id, None)
                if not isinstance(run, Run):
                    if run is not None:
                        _settle(run, resolution)
                    continue
                if resolution.outcome is not _COMMITTED:
                    self._on_first_outcome(run, resolution)
                    continue
                # A committed first attempt (once per append).
                if run.holds_slot:
                    run.holds_slot = False
                    released += 1
                run.commit()  # Owes on_completion(True).
                run.transaction_id = resolution.transaction_id
                awaiting_apply.append(run)
                if self._hook_runs or not inline:
                    # Behind a coroutine hook of this iteration, or on the callback threads: in the batch.
                    if not self._hook_runs:
                        self._call_soon(self._flush_hooks)
                    self._hooks.append((run.context.on_completion, _TRUE_ARGS))
                    self._hook_runs.append((run, True))
                else:
                    self._hook_now(run, True)
        finally:
            if released:
                partition.slots.release(released)

    def _fail_outcomes(self, partition: PartitionState, error: ClientError) -> None:
        outcomes, partition.outcomes = partition.outcomes, {}
        for waiter in outcomes.values():
            if isinstance(waiter, Run):
                self._on_first_outcome(waiter, error)
            else:
                _settle(waiter, error)

    async def _apply_loop(self, partition: PartitionState) -> None:
        """Hand the feed to ``apply_transaction`` in id order, one batch per callback-thread job."""
        monitor = partition.monitor
        assert monitor is not None
        pool = self._require_pool()
        apply = self._callbacks.apply_transaction
        batch: list[Transaction] = []
        while True:
            if not batch:
                await partition.wait_feed()
                batch = partition.take_feed(APPLY_BATCH_MAX)
            if self._inline:
                applied, error = await _apply_batch_inline(apply, batch)
            else:
                applied, error = await pool.call(_apply_batch, apply, batch)
            if applied:
                last = batch[applied - 1].transaction_id
                del batch[:applied]
                if partition.stuck is not None:
                    log.info(
                        "partition %d: transaction %d applied after %d failed attempts",
                        partition.id,
                        partition.stuck.transaction_id,
                        partition.stuck.failures,
                    )
                    partition.stuck = None
                self._advance_applied(partition, monitor, last)
            if error is not None:
                transaction_id = batch[0].transaction_id
                stuck = self._note_apply_failure(partition, transaction_id, error)
                try:
                    action = await self._call_user(
                        self._callbacks.uncaught_exception, partition.id, transaction_id, error
                    )
                except Exception:
                    log.exception("uncaught_exception raised")
                    action = None
                if action is ApplyAction.SKIP:
                    log.warning(
                        "partition %d: SKIPPING transaction %d at the application's request "
                        "(uncaught_exception returned ApplyAction.SKIP after %d failed attempts); "
                        "it was never applied",
                        partition.id,
                        transaction_id,
                        stuck.failures,
                    )
                    del batch[0]
                    partition.stuck = None
                    self._advance_applied(partition, monitor, transaction_id)
                    continue
                # The high-water mark stays put: the same transaction is delivered again.
                await asyncio.sleep(APPLY_RETRY.delay_s(stuck.failures))

    def _advance_applied(self, partition: PartitionState, monitor: TransactionMonitor, last: int) -> None:
        """Transactions up to ``last`` are applied (or skipped): release what waited for them."""
        self._resolve(partition, monitor.on_applied(last))
        self._on_applied(partition, last)
        partition.notify()

    def _note_apply_failure(self, partition: PartitionState, transaction_id: int, error: Exception) -> Stuck:
        """Record a failed ``apply_transaction``: the traceback is logged once per transaction, then a
        one-line reminder at growing intervals (a poisoned transaction must not flood the log)."""
        stuck = partition.stuck
        now = self._clock()
        if stuck is None or stuck.transaction_id != transaction_id:
            stuck = partition.stuck = Stuck(transaction_id, error, 1, now, now)
            log.error(
                "partition %d: apply_transaction raised for transaction %d; delivering it again with backoff "
                "(the feed of this partition waits; see 'Poisoned transactions' in docs/client.md)",
                partition.id,
                transaction_id,
                exc_info=error,
            )
            return stuck
        stuck.failures += 1
        stuck.error = error
        if now - stuck.reminded_at >= STUCK_REMINDER_S:
            stuck.reminded_at = now
            log.error(
                "partition %d: still stuck applying transaction %d (%d attempts, %.0f s): %s: %s",
                partition.id,
                transaction_id,
                stuck.failures,
                now - stuck.since,
                type(error).__name__,
                error,
            )
        return stuck

    async def _nudge_loop(self) -> None:
        threshold_s = self._config.long_wait_threshold_ms / 1000
        answer_s = self._config.answer_timeout_ms / 1000
        while True:
            await asyncio.sleep(max(min(threshold_s, answer_s) / 2, 0.005))
            now = self._clock()
            for partition in list(self._partitions.values()):
                monitor = partition.monitor
                if monitor is None:
                    continue
                self._check_answered(partition, monitor, now, answer_s)
                if partition.state is not _READY:
                    continue
                req_id = monitor.nudge(now, threshold_s)
                if req_id is not None:
                    log.debug(
                        "partition %d: appends pending for %.1f s, sending a flush", partition.id, threshold_s
                    )
                    self._send_flush(partition.id, req_id)

    def _check_answered(
        self, partition: PartitionState, monitor: TransactionMonitor, now: float, answer_s: float
    ) -> None:
        """An append unresolved for ``client.answerTimeout`` (since it was sent, or since the last resync):
        the server or the link lost it along with every answer that would have resolved it (a flush, the
        MountResponse of a re-mount), so ask the driver to start the stream again. Its READY's flush then
        decides the append: committed (it shows up in the feed) or failed (retried as any lost append)."""
        if partition.state is MountState.CLIENT_AHEAD:
            return
        oldest = monitor.oldest_pending_at
        if oldest is None:
            return
        since = oldest if partition.resynced_at is None else max(oldest, partition.resynced_at)
        if now - since < answer_s:
            return
        partition.resynced_at = now
        log.warning(
            "partition %d: %d appends pending, the oldest unanswered for %.1f s (client.answerTimeout); "
            "mounting again",
            partition.id,
            monitor.pending_count,
            now - oldest,
        )
        try:
            self._require_driver().resync(partition.id)
        except Exception:
            log.exception("partition %d: resync failed", partition.id)

    # -- contexts ----------------------------------------------------------------------------------------

    def _on_first_outcome(self, run: Run, result: Resolution | BaseException) -> None:
        """The fate of a first attempt sent by ``submit`` (no task so far) when it did not commit (a commit
        is finished by :meth:`_resolve`): it continues in a task, as the slow path."""
        partition = run.partition
        assert partition is not None
        if isinstance(result, Resolution):
            run.handle(_FAILURE_EVENTS[result.outcome])
        wake = partition.lock_queue.release(run)
        if wake:
            self._wake(wake)
        self._spawn(self._run_context(run, None, result), f"waltz-run-p{partition.id}")

    def _take_turn(self, partition: PartitionState, run: Run, builder: TransactionBuilder) -> bool:
        """True if ``run`` may send ``builder`` now (it then holds its write locks in the lock queue); False
        if another context of this client holds one of them (then ``run`` must wait for its turn)."""
        queue = partition.lock_queue
        locks = builder.write_lock_hashes
        if not locks and queue.is_idle(run):
            return True  # The common case, no write locks: nothing to hold, nobody to wake.
        wake = queue.take(run, locks)
        if wake is None:
            return False
        if wake:
            self._wake(wake)
        return True

    def _park(self, partition: PartitionState, run: Run, builder: TransactionBuilder) -> None:
        """Queue ``run`` behind the context holding one of ``builder``'s write locks (see _await_turn)."""
        blocker = partition.lock_queue.blocker(run, builder.write_lock_hashes)
        if blocker is None:
            raise ClientError("internal error: parking a context that is not blocked")
        run.turn = asyncio.get_running_loop().create_future()
        wake = partition.lock_queue.park(run, blocker)
        if wake:
            self._wake(wake)
        if run.first_send is not None and not run.first_send.done():
            run.first_send.set_result(None)  # Queued counts as accepted: submit returns.

    async def _await_turn(self, run: Run) -> None:
        """Return when it is the parked ``run``'s turn to execute again (the transaction of the context
        before it applied, or its append failed), or once the context expired."""
        if run.turn is None:
            return
        timeout_ms = self._config.transaction_timeout_ms
        try:
            if timeout_ms > 0:
                remaining_s = timeout_ms / 1000 - (time.time() - run.context.creation_time)
                # Past the deadline the caller's expiry check ends the context.
                await asyncio.wait_for(asyncio.shield(run.turn), max(remaining_s, 0))
            else:
                await run.turn
        except TimeoutError:
            pass  # Still QUEUED: the caller's expiry check ends the context.
        else:
            run.handle(Event.TURN)
        finally:
            run.turn = None

    def _wake(self, runs: list[Any]) -> None:
        for run in runs:
            turn = run.turn
            if turn is not None and not turn.done():
                turn.set_result(None)

    def _on_applied(self, partition: PartitionState, transaction_id: int) -> None:
        """Transactions up to ``transaction_id`` are applied: on_application for the runs that wait for it."""
        waiting = partition.awaiting_apply
        queue = partition.lock_queue
        # Nothing held (no context of this partition takes write locks): no release to make per run. Releases
        # only pass locks on, so nothing becomes held during this loop either.
        locked = queue.holds_any
        while waiting and waiting[0].transaction_id <= transaction_id:
            run = waiting.popleft()
            run.applied = True
            if locked:
                wake = queue.release(run)
                if wake:
                    self._wake(wake)
            if not run.completed:
                continue  # on_completion has not run yet: _hook_done queues on_application after it.
            self._queue_application(run)

    def _drop_awaiting_apply(self, partition: PartitionState) -> None:
        """The partition is gone: its committed runs end without on_application (as with close)."""
        waiting, partition.awaiting_apply = partition.awaiting_apply, deque()
        for run in waiting:
            if run.completed:
                self._finish(run)
            # Otherwise _hooks_done finishes it once on_completion ran.

    def _queue_application(self, run: Run) -> None:
        if run.apply():  # Owes on_application, unless the run ended meanwhile (closed).
            # _queue_hook(run, False, on_application), inline (once per append)
            if not self._hook_runs:
                if self._inline:
                    self._hook_now(run, False)
                    return
                self._call_soon(self._flush_hooks)
            self._hooks.append((run.context.on_application, ()))
            self._hook_runs.append((run, False))
        else:
            self._finish(run)  # Ended meanwhile (closed): no on_application.

    def _queue_hook(self, run: Run, completion: bool, fn: Callable[..., Any], *args: Any) -> None:
        """Queue a fast-path hook; the hooks queued in one loop iteration run as one callback-thread job."""
        if not self._hook_runs:
            self._call_soon(self._flush_hooks)
        self._hooks.append((fn, args))
        self._hook_runs.append((run, completion))

    def _flush_hooks(self) -> None:
        if not self._hook_runs:
            return
        hooks, self._hooks = self._hooks, []
        runs, self._hook_runs = self._hook_runs, []
        lead, self._lead_awaitables = self._lead_awaitables, []
        pool = self._pool
        if pool is None or pool.is_shut_down:
            for _fn, awaitable in lead:
                if inspect.iscoroutine(awaitable):
                    awaitable.close()  # Dropped with its batch, as the hooks never called.
            return
        if self._inline:
            awaitables = _run_hooks_inline(hooks)
            if lead:
                awaitables = lead + awaitables
            if awaitables:
                self._spawn(self._await_hooks(awaitables, runs), "waltz-hooks")
            else:
                self._hooks_done(runs)
            return
        pool.post(hooks, then=functools.partial(self._hooks_done, runs))

    def _hook_now(self, run: Run, completion: bool) -> None:
        """Inline mode, no hook queued in this loop iteration: ``on_completion(True)`` (``completion``) or
        ``on_application()`` now, where the append was resolved (the socket reader) or its transaction
        applied (the applier), instead of in the next iteration through _flush_hooks: a lone append's
        application hears of it one loop pass sooner. What the hook would have been in its batch, it still
        is: the first; a coroutine it returns is awaited first by this iteration's batch, before the hooks
        queued after it, which therefore run in order as before."""
        pool = self._pool
        if pool is None or pool.is_shut_down:
            return  # As _flush_hooks: no hooks once the client is shut down.
        # _run_hooks_inline([hook]) then _hooks_done([(run, completion)]), written out for one hook (twice per
        # append): no lists, no tuples, no loops.
        context = run.context
        fn: Callable[..., Any] = context.on_completion if completion else context.on_application
        result: Any  # The hooks are typed as returning None; an inline hook may return a coroutine.
        try:
            result = fn(True) if completion else fn()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - reported to the application, as in _run_hooks_inline
            report_hook_failure(asyncio.get_running_loop(), fn, e)
            result = None
        if result is not None and inspect.isawaitable(result):
            self._lead_awaitables = [(fn, result)]
            self._hook_runs.append((run, completion))
            self._call_soon(self._flush_hooks)
        else:
            self._hook_done(run, completion)

    def _call_soon(self, callback: Callable[[], object]) -> None:
        """``loop.call_soon`` on the client's loop without asyncio.get_running_loop() (a getpid() system call
        on each call in CPython 3.11; the hot path made five per append)."""
        loop = self._loop
        assert loop is not None  # Set by start(), before anything queues a hook.
        loop.call_soon(callback)

    async def _await_hooks(
        self, awaitables: list[tuple[Callable[..., Any], Awaitable[Any]]], runs: list[tuple[Run, bool]]
    ) -> None:
        """Coroutine hooks (inline mode), one after the other, then the runs' next step."""
        loop = asyncio.get_running_loop()
        for fn, awaitable in awaitables:
            try:
                await awaitable
            except Exception as e:  # noqa: BLE001 - reported to the application, not swallowed
                report_hook_failure(loop, fn, e)
        self._hooks_done(runs)

    def _hooks_done(self, runs: list[tuple[Run, bool]]) -> None:
        for run, completion in runs:
            self._hook_done(run, completion)

    def _hook_done(self, run: Run, completion: bool) -> None:
        """``run``'s on_completion(True) (``completion``) or on_application ran: its next step."""
        if not completion:
            self._finish(run)  # on_application ran: the last hook.
            return
        run.completed = True
        partition = run.partition
        assert partition is not None
        if run.applied and not self._closed:
            self._queue_application(run)
        elif self._closed or partition.error is not None:
            self._finish(run)  # No on_application will follow.

    async def _run_context(
        self,
        run: Run,
        builder: TransactionBuilder | None = None,
        pending: Resolution | BaseException | None = None,
    ) -> None:
        """The slow path of a context: every attempt after the first, or a first one that had to wait.

        ``builder`` (if given) is the last attempt, executed but not sent yet; ``pending`` (if given) is the
        fate of the last one, sent and not committed. The attempts made are the lifecycle's to count.
        """
        try:
            await self._await_turn(run)  # Parked by submit.
            if pending is not None:
                if isinstance(pending, BaseException):
                    raise pending
                await self._after_failure(run, pending)
            while not await self._attempt(run, builder):
                builder = None
        except asyncio.CancelledError:
            raise  # close() reports ClientClosedError to the context.
        except _Expired as e:
            await self._end_with_exception(run, e.error, Event.EXPIRE)
        except Exception as e:  # noqa: BLE001 - every failure ends the context through on_exception
            await self._end_with_exception(run, e, Event.FAIL)
        finally:
            self._release_slot(run)
            if run.ended or not self._closed:
                self._finish(run)

    def _check_may_retry(self, run: Run) -> None:
        """Before another execution: raise if ``client.maxTransactionAttempts`` appends were refused, or
        (:class:`_Expired`) if the context is past ``client.transactionTimeout``."""
        attempts = run.attempts
        if attempts > 0 and self._retry.attempts_exhausted(attempts):
            raise ClientTimeoutError(
                f"transaction context gave up after {attempts} attempts (client.maxTransactionAttempts)"
            )
        if self._retry.expired(run.context.creation_time, time.time()):
            raise _Expired(
                ClientTimeoutError(
                    f"transaction context expired after {self._config.transaction_timeout_ms} ms "
                    f"and {attempts} attempts (client.transactionTimeout)"
                )
            )

    async def _attempt(self, run: Run, builder: TransactionBuilder | None) -> bool:
        """One attempt of the slow path: execute (unless ``builder`` was), take a turn on its write locks,
        send, and await the append's fate. True once the run is done (appended and applied, or gave up),
        False for another attempt."""
        partition = run.partition
        assert partition is not None
        context = run.context
        if builder is None:
            self._check_may_retry(run)
            monitor = await self._wait_mounted(partition)
            builder = TransactionBuilder(partition.id, monitor.applied_high_water_mark)
            run.execute()
            if not await self._call_user(context.execute, builder):
                self._release_slot(run)
                run.handle(Event.GIVE_UP)
                await self._call_hook(context.on_completion, False)
                return True
        # The mount may have changed while execute ran; its high-water mark is still a safe one.
        monitor = await self._wait_mounted(partition)
        if not self._take_turn(partition, run, builder):
            # Not sent, so not counted: the attempt bound is about appends the server refused.
            run.handle(Event.QUEUE)
            self._park(partition, run, builder)
            await self._await_turn(run)
            return False
        outcome: asyncio.Future[Resolution] = asyncio.get_running_loop().create_future()
        run.send()
        self._send(partition, monitor, builder, outcome)
        if run.first_send is not None and not run.first_send.done():
            run.first_send.set_result(None)
        resolution = await outcome
        wake = None
        if resolution.outcome is _COMMITTED:
            self._release_slot(run)
            run.commit()
            await self._call_hook(context.on_completion, True)
            await self._wait_applied(partition, resolution.transaction_id)
            wake = partition.lock_queue.release(run)
            if wake:
                self._wake(wake)
            if run.apply():
                await self._call_hook(context.on_application)
            return True
        run.handle(_FAILURE_EVENTS[resolution.outcome])
        wake = partition.lock_queue.release(run)
        if wake:
            self._wake(wake)
        await self._after_failure(run, resolution)
        return False

    async def _after_failure(self, run: Run, failure: Resolution) -> None:
        """Between a failed attempt and the next execute: retry on knowledge, back off on ignorance.

        A lock failure names the transaction that took the lock, and the monitor releases it only once this
        client has applied that transaction, so executing again right away reads the state that won: no
        sleep. A lost append (or a send error) says nothing about when a retry could succeed: back off.
        """
        if failure.outcome is Outcome.LOCK_FAILED:
            await self._call_hook(run.context.on_lock_failure)
            return
        await asyncio.sleep(self._retry.delay_s(run.attempts))

    def _send(
        self,
        partition: PartitionState,
        monitor: TransactionMonitor,
        builder: TransactionBuilder,
        waiter: Waiter,
    ) -> None:
        """Register and send one append; synchronous, so registration order is send order. ``waiter`` learns
        the append's fate (on the loop): a first attempt's run through ``_resolve`` (a commit) or
        ``_on_first_outcome`` (anything else), a slow-path future through its result."""
        driver = self._driver
        assert driver is not None  # Sending follows a check of the partition's mount.
        p = partition.id
        seq = self._next_seq.get(p, 0) + 1
        self._next_seq[p] = seq
        # ReqId.of(client id, generation, p, seq) without its two Python calls (classmethod, tuple __new__),
        # from the halves the partition keeps.
        req_id = _new_tuple(ReqId, (partition.req_msb, partition.req_lsb_base | (seq & _MASK32)))
        outcomes = partition.outcomes
        outcomes[req_id] = waiter
        monitor.register(req_id, seq, self._clock())
        try:
            if len(outcomes) == 1:
                # Alone in flight (one append at a time): nothing would join it in this iteration's write,
                # so it leaves now instead of one loop pass later. Pipelined appends share one write.
                driver.send_append_now(p, builder.build(req_id))
            elif self._send_built is not None:
                self._send_built(p, req_id, builder)  # No AppendRequest made (see driver.py).
            else:
                driver.send_append(p, builder.build(req_id))
        except LocalProtocolError as e:
            # It can never be sent (over the connection's frame limit, or a field the format cannot carry):
            # retrying would execute the context again for ever. The context ends with this error instead.
            log.warning("partition %d: append %r cannot be sent: %s", partition.id, req_id, e)
            monitor.fail(req_id)
            waiter = outcomes.pop(req_id)  # Registered above, in this same synchronous call.
            if isinstance(waiter, Run):
                self._on_first_outcome(waiter, e)
            else:
                _settle(waiter, e)
        except WaltzError as e:
            log.warning("partition %d: append %r not sent: %s", partition.id, req_id, e)
            self._resolve(partition, monitor.fail(req_id))

    def _send_flush(self, partition_id: int, req_id: ReqId) -> None:
        try:
            self._require_driver().send_flush(partition_id, req_id)
        except WaltzError as e:
            # Not fatal: the next nudge or READY sends another flush.
            log.warning("partition %d: flush not sent: %s", partition_id, e)

    async def _wait_mounted(self, partition: PartitionState) -> TransactionMonitor:
        timeout_ms = self._config.mount_timeout_ms
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                while True:
                    if partition.error is not None:
                        raise partition.error
                    if partition.state is MountState.CLIENT_AHEAD:
                        raise ClientAheadError(
                            f"partition {partition.id}: the application's high-water mark is ahead of the "
                            "server's (wrong cluster, or the log lost data)"
                        )
                    if partition.state is _READY and partition.monitor is not None:
                        return partition.monitor
                    await partition.changed()
        except TimeoutError:
            if partition.stuck is not None:
                raise PartitionStuckError(partition.stuck.describe(partition.id, self._clock())) from None
            raise ClientTimeoutError(
                f"partition {partition.id} was not mounted within {timeout_ms} ms (client.mountTimeout)"
            ) from None

    async def _wait_applied(self, partition: PartitionState, transaction_id: int) -> None:
        while partition.monitor is None or partition.monitor.applied_high_water_mark < transaction_id:
            if partition.error is not None:
                raise partition.error
            await partition.changed()

    def _release_slot(self, run: Run) -> None:
        if run.holds_slot:
            run.holds_slot = False
            assert run.partition is not None
            run.partition.slots.release()

    def _finish(self, run: Run) -> None:
        if run.partition is not None:
            wake = run.partition.lock_queue.leave(run)
            if wake:
                self._wake(wake)
        self._runs.discard(run)
        run.set_finished()
        if run.first_send is not None and not run.first_send.done():
            run.first_send.set_result(None)

    async def _end_with_exception(self, run: Run, error: BaseException, event: Event = Event.FAIL) -> None:
        """End ``run`` with ``on_exception(error)`` if its lifecycle owes it (once); a first attempt also
        raises it from submit."""
        self._release_slot(run)
        if run.handle(event) is Hook.EXCEPTION:
            await self._call_hook(run.context.on_exception, error)
        if run.first_send is not None and not run.first_send.done():
            run.first_send.set_exception(error)
            run.first_send.exception()  # submit() retrieves it; never log "exception was never retrieved".
        self._finish(run)

    # -- RPC ---------------------------------------------------------------------------------------------

    async def _fetch_data(self, partition_id: int, transaction_id: int) -> bytes:
        self._check_open()
        driver = self._require_driver()
        for _ in range(MAX_CHECKSUM_ATTEMPTS):
            data, checksum = await self._rpc(
                lambda: driver.fetch_transaction_data(partition_id, transaction_id),
                f"transaction data of {partition_id}:{transaction_id}",
            )
            if crc32(data) == checksum & 0xFFFFFFFF:
                return data
            log.warning(
                "partition %d: data of transaction %d failed its checksum", partition_id, transaction_id
            )
        raise DataChecksumError(
            f"partition {partition_id}: data of transaction {transaction_id} failed its CRC-32 "
            f"{MAX_CHECKSUM_ATTEMPTS} times"
        )

    async def _rpc(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``call()`` retried with backoff on retriable errors, all within ``client.requestTimeout``."""
        timeout_s = self._config.request_timeout_ms / 1000
        deadline = self._clock() + timeout_s
        retry = 0
        last_error: BaseException | None = None
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                # The last error says why (e.g. "partition 3 is not served"): keep it in the message.
                why = f": {last_error}" if last_error is not None else ""
                raise ClientTimeoutError(
                    f"{what} did not succeed within {self._config.request_timeout_ms} ms{why}"
                ) from (last_error)
            try:
                async with asyncio.timeout(remaining):
                    return await call()
            except TimeoutError:
                # The deadline cut an attempt short; the errors before it still say why.
                why = f": {last_error}" if last_error is not None else ""
                raise ClientTimeoutError(
                    f"{what} timed out after {self._config.request_timeout_ms} ms{why}"
                ) from (last_error)
            except WaltzError as e:
                if not e.retriable or self._closed:
                    raise
                last_error = e
            retry += 1
            await asyncio.sleep(min(FETCH_RETRY.delay_s(retry), max(deadline - self._clock(), 0)))

    # -- helpers -----------------------------------------------------------------------------------------

    async def _call_user(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run application code on a callback thread, or (inline mode) here, awaiting what it returns if
        that is awaitable."""
        if self._inline:
            self._require_pool()  # The same closed-client check as the threads mode.
            result = fn(*args)
            if result is not None and inspect.isawaitable(result):
                result = await result
            return result
        return await self._require_pool().call(fn, *args)

    async def _call_hook(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run an application hook; its exception goes to the loop's exception handler
        (:func:`~waltz.client.pool.report_hook_failure`): a hook has no caller to raise to."""
        try:
            await self._call_user(fn, *args)
        except Exception as e:  # noqa: BLE001 - reported to the application, not swallowed
            report_hook_failure(asyncio.get_running_loop(), fn, e)

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        return self._tasks.spawn(coro, name)

    def _task_failed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        """A task of the client's own failed (a context's run reports its failures to the context: this is
        a bug in the client, which its contexts and partitions outlive)."""
        log.error("client task %s failed", task.get_name(), exc_info=error)

    def _spawn_partition_task(
        self, partition: PartitionState, coro: Coroutine[Any, Any, None], name: str
    ) -> None:
        """Run a task the partition depends on (its mount, its applier): if it fails, the partition fails
        with it (see :meth:`_partition_failed`), instead of stalling while submits time out."""
        task = self._tasks.spawn(coro, name, functools.partial(self._partition_failed, partition))
        partition.tasks.append(task)

    def _partition_failed(
        self, partition: PartitionState, task: asyncio.Task[Any], error: BaseException
    ) -> None:
        """The partition's mount or applier task failed: the partition stops, and the failure reaches the
        application twice: ``uncaught_exception(partition, -1, error)``, and the error of every submit and
        ``wait_applied`` on the partition (which names it), until :meth:`set_partitions` releases it or the
        client closes."""
        if self._partitions.get(partition.id) is not partition or partition.error is not None:
            log.error("partition %d: task %s failed", partition.id, task.get_name(), exc_info=error)
            return
        log.error(
            "partition %d stopped: its task %s failed; submits to it fail until it is mounted again",
            partition.id,
            task.get_name(),
            exc_info=error,
        )
        failure = ClientError(
            f"partition {partition.id} stopped: its task {task.get_name()} failed with "
            f"{type(error).__name__}: {error} (see uncaught_exception; release it with set_partitions, "
            "or restart the client)"
        )
        failure.__cause__ = error
        self._stop_partition(partition, failure)
        for other in partition.tasks:
            other.cancel()
        self._spawn(self._report_partition_failure(partition.id, error), "waltz-partition-failed")

    async def _report_partition_failure(self, partition_id: int, error: BaseException) -> None:
        await self._call_hook(self._callbacks.uncaught_exception, partition_id, -1, error)
        await self._require_driver().unmount(partition_id)

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("the client is closed")
        if self._driver is None:
            raise ClientError("the client is not started (use 'async with' or 'await client.start()')")

    def _require_pool(self) -> CallbackPool:
        pool = self._pool
        if pool is None:
            raise ClientError("the client is not started (use 'async with' or 'await client.start()')")
        if pool.is_shut_down:
            raise ClientClosedError("the client is closed")
        return pool

    def _require_driver(self) -> ClientDriver:
        if self._driver is None:
            raise ClientError("the client is not started (use 'async with' or 'await client.start()')")
        return self._driver


def _settle(future: asyncio.Future[Resolution], result: Resolution | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _apply_batch(
    apply: Callable[[Transaction], None], batch: list[Transaction]
) -> tuple[int, Exception | None]:
    """On a callback thread: apply ``batch`` in order; stop at the first exception or after
    :data:`APPLY_BATCH_MAX_S`. Returns how many were applied, and the exception that stopped it."""
    deadline = time.monotonic() + APPLY_BATCH_MAX_S
    for i, transaction in enumerate(batch):
        if i and not i % 8 and time.monotonic() > deadline:
            return i, None
        try:
            apply(transaction)
        except Exception as e:  # noqa: BLE001 - application code: the loop reports it and delivers again
            return i, e
    return len(batch), None


async def _apply_batch_inline(
    apply: Callable[[Transaction], Any], batch: list[Transaction]
) -> tuple[int, Exception | None]:
    """On the loop (inline mode): like :func:`_apply_batch`; a coroutine ``apply_transaction`` is awaited."""
    deadline = time.monotonic() + APPLY_BATCH_MAX_S
    for i, transaction in enumerate(batch):
        if i and not i % 8 and time.monotonic() > deadline:
            return i, None
        try:
            result = apply(transaction)
            if result is not None and inspect.isawaitable(result):
                await result
        except Exception as e:  # noqa: BLE001 - application code: the loop reports it and delivers again
            return i, e
    return len(batch), None


def _run_hooks_inline(hooks: list[Call]) -> list[tuple[Callable[..., Any], Awaitable[Any]]]:
    """Run context hooks on the loop (inline mode), reporting their exceptions to the loop's exception
    handler; returns the awaitables that coroutine hooks returned, in order, for the caller to await."""
    awaitables: list[tuple[Callable[..., Any], Awaitable[Any]]] = []
    for fn, args in hooks:
        try:
            result = fn(*args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - reported to the application, not swallowed
            # BaseException too: a hook may now run inside the socket reader (on_completion), which a
            # CancelledError from application code must not end. (The loop is looked up here only: each
            # asyncio.get_running_loop() is a getpid() system call, twice per append on this path.)
            report_hook_failure(asyncio.get_running_loop(), fn, e)
            continue
        if result is not None and inspect.isawaitable(result):
            awaitables.append((fn, result))
    return awaitables
