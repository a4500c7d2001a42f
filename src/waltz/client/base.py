"""The client core's state and the helpers every part of it uses (event loop only, except where said).

:class:`ClientBase` holds everything :class:`~waltz.client.core.AsyncWaltzClient` knows; the parts of the core
are its mixins, each a module: :mod:`~waltz.client.hooks` (the application's hooks),
:mod:`~waltz.client.attempts` (an append sent, its fate, the retry path), :mod:`~waltz.client.submission`
(``submit`` and its first attempt) and :mod:`~waltz.client.applier` (a partition's mount, feed and
``apply_transaction``). A mixin calls only itself, the ones below it in that order, and this base.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from waltz.client.api import ClientCallbacks
from waltz.client.config import ClientConfig
from waltz.client.dispatch import Dispatch, runs_on_loop
from waltz.client.driver import ClientDriver, CoordinationTrouble, MountState
from waltz.client.eager import Runners
from waltz.client.lifecycle import HOLDS_SLOT, Event, Hook
from waltz.client.monitor import TransactionMonitor
from waltz.client.pool import Call, CallbackPool, report_hook_failure
from waltz.client.readahead import Readahead
from waltz.client.retry import FETCH_RETRY, MAX_CHECKSUM_ATTEMPTS, RetryPolicy
from waltz.client.state import PartitionState, Run
from waltz.client.tasks import TaskSet
from waltz.errors import (
    ClientClosedError,
    ClientError,
    ClientTimeoutError,
    DataChecksumError,
    WaltzError,
)
from waltz.protocol.records import Record, crc32

if TYPE_CHECKING:  # prometheus_client loads only for a client with metrics.
    from prometheus_client import CollectorRegistry

    from waltz.client.metrics import ClientMetrics

__all__ = ["ClientBase", "DataSource"]

log = logging.getLogger("waltz.client.core")  # The core's one logger (docs/client.md names it).

T = TypeVar("T")

_READY = MountState.READY
_MASK32 = 0xFFFFFFFF


class DataSource:
    """Fetches transaction data for :class:`Transaction` objects, from the loop or from other threads."""

    def __init__(self, client: ClientBase, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._loop = loop

    def fetch_blocking(self, partition_id: int, transaction_id: int) -> bytes:
        data = self._client._readahead.take(partition_id, transaction_id)
        if data is not None:
            return data  # Read ahead (and checksum-verified) by an earlier fetch: no hop to the loop.
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
        data = self._client._readahead.take(partition_id, transaction_id)
        if data is not None:
            return data
        return await self._client._fetch_data(partition_id, transaction_id)


class ClientBase:
    """The state of an :class:`~waltz.client.core.AsyncWaltzClient` and its shared helpers.

    The state lives in slots (the mixins add none): every ``self._x`` of the hot path is then a slot read
    CPython specializes whatever the number of fields. (An instance dict with 30 keys or more is no longer a
    split dict, and every attribute and method lookup on the client falls back to a dict lookup.)
    """

    __slots__ = (
        "_callbacks",
        "_client_id",
        "_client_msb",
        "_clock",
        "_closed",
        "_config",
        "_dispatch",
        "_driver",
        "_driver_arg",
        "_driver_error",
        "_handoff",
        "_handoff_lock",
        "_handoff_scheduled",
        "_hook_runs",
        "_hooks",
        "_hooks_on_loop",
        "_inline",
        "_lead_awaitables",
        "_loop",
        "_metrics",
        "_next_seq",
        "_num_partitions",
        "_outstanding",
        "_partitions",
        "_pool",
        "_readahead",
        "_retry",
        "_runners",
        "_runs",
        "_source",
        "_started",
        "_tasks",
        "_told_outage_s",
    )

    def __init__(
        self,
        callbacks: ClientCallbacks,
        config: ClientConfig,
        *,
        driver: ClientDriver | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self._callbacks = callbacks
        self._config = config
        self._driver_arg = driver if driver is not None else config.mock_driver
        self._driver: ClientDriver | None = None
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
        # Appends in flight on every partition (the sum of the partitions' outcomes): one alone leaves at
        # once (see AttemptsMixin._send).
        self._outstanding = 0
        self._runs: set[Run] = set()
        self._tasks = TaskSet(self._task_failed)  # Every task of the client; see waltz.client.tasks.
        self._runners = Runners(self._spawn)  # The tasks coroutine hooks run in: see waltz.client.eager.
        self._pool: CallbackPool | None = None
        self._hooks: list[Call] = []  # Hooks queued during this loop iteration, run as one job.
        self._hooks_on_loop = 0  # How many of them run on the loop (the others on a callback thread).
        # Inline mode: a coroutine hook run at once (see _run_hook), awaited first by this
        # iteration's batch, with the hooks queued after it (its run leads _hook_runs).
        self._lead_awaitables: list[tuple[Callable[..., Any], Awaitable[Any]]] = []
        self._hook_runs: list[tuple[Run, bool]] = []  # (run, True: on_completion / False: on_application)
        # What application threads hand to the loop (see _hand_over), and whether a take is scheduled.
        self._handoff: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._handoff_lock = threading.Lock()
        self._handoff_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._source: DataSource | None = None
        self._readahead = Readahead()  # Transaction data read in ranges: see waltz.client.readahead.
        self._started = False
        self._closed = False
        self._driver_error: ClientError | None = None  # Set once the driver failed for good.
        self._told_outage_s: float | None = None  # The ZooKeeper outage a wait was last logged for.
        # Where application code runs (client.callbackMode; see waltz.client.dispatch): coroutine functions
        # on the loop, plain functions on the callback threads, or (inline) everything on the loop.
        self._dispatch = Dispatch(config.callback_mode)
        self._inline = self._dispatch.all_inline  # Read on the hot paths: `self._inline or runs_on_loop(fn)`.
        # Prometheus metrics in the application's registry, or None (off): see waltz.client.metrics.
        self._metrics: ClientMetrics | None = None
        if metrics_registry is not None:
            from waltz.client.metrics import ClientMetrics

            self._metrics = ClientMetrics(metrics_registry, lambda: self._partitions)

    def _coordination_trouble(self) -> CoordinationTrouble | None:
        driver = self._driver
        return driver.coordination_trouble() if driver is not None else None

    def _say_if_waiting_on_zookeeper(self, partition: PartitionState) -> None:
        """A submit or attempt is about to wait on ``partition``: if ZooKeeper does not answer, say that this
        is what it waits on (one line per outage, not per wait)."""
        trouble = self._coordination_trouble()
        if trouble is None or trouble.since_s == self._told_outage_s:
            return
        self._told_outage_s = trouble.since_s
        log.warning("appends to partition %d are waiting on ZooKeeper: %s", partition.id, trouble.description)

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        return self._tasks.spawn(coro, name)

    def _task_failed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        """A task of the client's own failed (a context's run reports its failures to the context: this is
        a bug in the client, which its contexts and partitions outlive)."""
        log.error("client task %s failed", task.get_name(), exc_info=error)

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

    async def _call_user(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run application code on a callback thread, or here (a coroutine function, or inline mode),
        awaiting what it returns if that is awaitable."""
        if self._inline or runs_on_loop(fn):
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

    def _call_soon(self, callback: Callable[[], object]) -> None:
        """``loop.call_soon`` on the client's loop without asyncio.get_running_loop() (a getpid() system call
        on each call in CPython 3.11; the hot path made five per append)."""
        loop = self._loop
        assert loop is not None  # Set by start(), before anything queues a hook.
        loop.call_soon(callback)

    def _step(self, run: Run, event: Event) -> Hook | None:
        """``run.handle(event)``, for an event that may end the run: a run that leaves the states holding a
        slot (:data:`~waltz.client.lifecycle.HOLDS_SLOT`) gives its slot back here. (A committed first
        attempt gives it back in ``_resolve``, one release per feed run.)"""
        held = run.state in HOLDS_SLOT
        hook = run.handle(event)
        if held and run.state not in HOLDS_SLOT:
            assert run.partition is not None
            run.partition.slots.release()
        return hook

    def _wake(self, runs: list[Any]) -> None:
        for run in runs:
            turn = run.turn
            if turn is not None and not turn.done():
                turn.set_result(None)

    def _finish(self, run: Run) -> None:
        """The one place a run finishes: it leaves the lock queue and the client's runs, and whoever waits
        for it (``flush_transactions``, a ``submit`` waiting for its first send) hears."""
        partition = run.partition
        if partition is not None:
            queue = partition.lock_queue
            if run in queue.held or run in queue.parked:  # Otherwise it holds and waits for nothing there.
                wake = queue.leave(run)
                if wake:
                    self._wake(wake)
        self._runs.discard(run)
        waiter = run.finished_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if run.first_send is not None and not run.first_send.done():
            run.first_send.set_result(None)

    def _ready_monitor(self, partition: PartitionState) -> TransactionMonitor | None:
        """The partition's monitor if appends may be sent to it right now."""
        if (
            partition.error is None
            and partition.state is _READY
            and self._partitions.get(partition.id) is partition
        ):
            return partition.monitor
        return None

    def _not_mounted(self, partition_id: int) -> ClientError:
        return ClientError(
            f"partition {partition_id} is not mounted by this client "
            f"(mounted: {sorted(self._partitions)}; see set_partitions)"
        )

    def _in_use(self, partition_id: int) -> bool:
        """True while ``partition_id`` is mounted by this client and not stopped."""
        partition = self._partitions.get(partition_id)
        return partition is not None and partition.error is None

    async def _fetch_data(self, partition_id: int, transaction_id: int) -> bytes:
        self._check_open()
        driver = self._require_driver()
        # Readahead only for a partition in use: one released or stopped is forgotten (_stop_partition),
        # and a read of its data after that (a Transaction kept by the application) is a single request.
        window = self._readahead.window(partition_id, transaction_id) if self._in_use(partition_id) else 1
        read_range = getattr(driver, "read_range", None)  # The network driver's; the mock has none.
        if window > 1 and read_range is not None:
            # Sequential reads: one range read (retried within client.requestTimeout, every checksum
            # verified), the records after the first kept for the fetches that follow.
            records: list[Record] = await read_range(partition_id, transaction_id, window)
            if self._in_use(partition_id):  # Not released or stopped meanwhile.
                self._readahead.keep(partition_id, records)
            if records:
                return records[0].data
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
