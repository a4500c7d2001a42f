"""A partition's side of the client core: its mount (the application's high-water mark, then the driver's
stream), the feed (every committed transaction through the :class:`~waltz.client.monitor.TransactionMonitor`,
which resolves our own appends, into a bounded queue), and the applier task that hands the feed to
``apply_transaction`` in id order. Also the nudge task (a flush for appends pending too long) and what
happens when a partition's own task fails.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
import types
from collections.abc import Callable, Coroutine
from typing import Any

from waltz.client.api import ApplyAction
from waltz.client.attempts import AttemptsMixin
from waltz.client.driver import MountState
from waltz.client.monitor import Resolution, TransactionMonitor
from waltz.client.retry import APPLY_RETRY
from waltz.client.state import PartitionState, Stuck
from waltz.client.transaction import Transaction, new_transactions
from waltz.errors import (
    ClientAheadError,
    ClientError,
    TrimmedError,
)
from waltz.protocol.client_server import FeedEntry
from waltz.protocol.records import ReqId

__all__ = ["ApplierMixin", "Listener"]

log = logging.getLogger("waltz.client.core")  # The core's one logger (docs/client.md names it).


APPLY_BATCH_MAX = 256
"""Most feed transactions handed to one callback thread in one job (applied one after the other)."""
STUCK_REMINDER_S = 30.0
"""After the first traceback, a partition stuck on one transaction logs a one-line reminder this often."""
APPLY_BATCH_MAX_S = 0.005
"""A batch returns to the loop after this long (checked every 8 transactions, so that a fast
``apply_transaction`` does not pay for a clock read each), so the applied high-water mark (and
``on_application``) never lags far behind a slow ``apply_transaction``."""

_READY = MountState.READY
_MASK32 = 0xFFFFFFFF
_Coroutine = types.CoroutineType
"""What an ``async def`` returns: tested by type first (a C check), ``inspect.isawaitable`` for the rest."""


class ApplierMixin(AttemptsMixin):
    """Mount, feed and apply of the client's partitions (see the module docstring)."""

    __slots__ = ()

    def _add_partition(self, partition_id: int) -> None:
        partition = PartitionState(partition_id, self._config)
        self._partitions[partition_id] = partition
        if self._driver_error is not None:
            partition.error = self._driver_error  # The driver serves no partition any more.
            return
        self._spawn_partition_task(partition, self._mount(partition), f"waltz-mount-p{partition_id}")

    def _spawn_partition_task(
        self, partition: PartitionState, coro: Coroutine[Any, Any, None], name: str
    ) -> None:
        """Run a task the partition depends on (its mount, its applier): if it fails, the partition fails
        with it (see :meth:`_partition_failed`), instead of stalling while submits time out."""
        task = self._tasks.spawn(coro, name, functools.partial(self._partition_failed, partition))
        partition.tasks.append(task)

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

    def _feed_run_nowait(self, partition_id: int, entries: list[FeedEntry]) -> int:
        """The feed's one path: consecutive feed entries (the next ids of the partition, in order), as many as
        the feed has room for, resolved and queued for ``apply_transaction``. Returns how many were taken (0:
        the feed is full; the driver then delivers the rest through ``on_feed_data``).

        The driver alone owns the feed position and its density (it re-mounts from it after a reconnect and
        drops repeats, resets on a gap): every entry it delivers is the next one (see driver.py)."""
        partition = self._partitions.get(partition_id)
        if partition is None or partition.error is not None or partition.monitor is None:
            return len(entries)  # Not ours (any more): dropped.
        room = partition.feed_limit - len(partition.feed)
        if room <= 0:
            return 0
        if room < len(entries):
            entries = entries[:room]
        source = self._source
        assert source is not None
        transactions = new_transactions(partition_id, entries, source)
        resolutions = partition.monitor.on_feed_run(entries)
        if resolutions:
            self._resolve(partition, resolutions, transactions)
        # Queued for apply_transaction after the resolutions, all at once: the applier's wake-up then follows
        # the application's (an on_completion on the loop that woke the task waiting for it), so that task's
        # next append goes out first and the apply runs while the server works on it; and nothing is queued
        # if a resolution raised, so the driver may deliver the same entries again.
        partition.push_feed_run(transactions)
        return len(entries)

    async def _on_feed_data(self, partition_id: int, transaction_id: int, req_id: ReqId, header: int) -> None:
        """One feed entry, waiting for room in the feed first (then through :meth:`_feed_run_nowait`). If the
        driver is cancelled while it waits, nothing has changed, and it may deliver the same id again."""
        partition = self._active(partition_id)
        if partition is None:
            return
        if len(partition.feed) >= partition.feed_limit:
            await partition.wait_room()
            if self._active(partition_id) is not partition:
                return
        self._feed_run_nowait(partition_id, [(transaction_id, req_id, header)])

    def _on_mount_state(self, partition_id: int, state: MountState) -> None:
        partition = self._active(partition_id)
        if partition is None or partition.monitor is None:
            return
        partition.state = state
        partition.notify()
        if state is _READY:
            if self._metrics is not None:
                self._metrics.mounted(partition_id)
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

    async def _apply_loop(self, partition: PartitionState) -> None:
        """Hand the feed to ``apply_transaction`` in id order, one batch per callback-thread job."""
        monitor = partition.monitor
        assert monitor is not None
        pool = self._require_pool()
        apply = self._callbacks.apply_transaction
        inline = self._dispatch.on_loop(apply)  # A coroutine apply_transaction: on the loop, no hop.
        batch: list[Transaction] = []
        while True:
            if not batch:
                while not partition.feed:
                    await partition.feed_waiter()  # A future: no coroutine made and resumed per wait.
                batch = partition.take_feed(APPLY_BATCH_MAX)
            if inline:
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
        resolutions = monitor.on_applied(last)
        if resolutions:  # Lock failures that waited for this apply (rare: no call of _resolve otherwise).
            self._resolve(partition, resolutions)
        self._on_applied(partition, last)
        partition.notify()

    def _note_apply_failure(self, partition: PartitionState, transaction_id: int, error: Exception) -> Stuck:
        """Record a failed ``apply_transaction``: the traceback is logged once per transaction, then a
        one-line reminder at growing intervals (a poisoned transaction must not flood the log)."""
        stuck = partition.stuck
        now = self._clock()
        if self._metrics is not None:
            self._metrics.apply_failed(partition.id)
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
                if monitor.oldest_pending_at is not None:
                    self._say_if_waiting_on_zookeeper(partition)  # Appends in flight wait on it too.
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

    def _driver_failed(self, error: ClientError) -> None:
        """The driver can serve no partition any more (see ``DriverListener.on_driver_failure``): every
        partition stops with ``error``, which each submit and wait then raises, and ``uncaught_exception``
        hears it once per partition (transaction id -1, as for a failed partition task)."""
        if self._closed or self._driver_error is not None:
            return
        self._driver_error = error
        for partition in list(self._partitions.values()):
            if partition.error is not None:
                continue
            self._stop_partition(partition, error)
            for task in partition.tasks:
                task.cancel()
            cause = error.__cause__ if error.__cause__ is not None else error
            self._spawn(
                self._call_hook(self._callbacks.uncaught_exception, partition.id, -1, cause),
                "waltz-driver-failed",
            )

    def _mount_failed(self, partition_id: int, error: TrimmedError) -> None:
        """The application's high-water mark is below the partition's trim point (final): the partition stops
        with ``error``, which each submit and wait then raises, and ``uncaught_exception`` hears it once."""
        partition = self._active(partition_id)
        if partition is None:
            return
        log.error(
            "partition %d stopped: %s", partition_id, str(error).removeprefix(f"partition {partition_id}: ")
        )
        self._stop_partition(partition, error)
        for task in partition.tasks:
            task.cancel()
        self._spawn(self._report_partition_failure(partition_id, error), "waltz-mount-trimmed")

    async def _report_partition_failure(self, partition_id: int, error: BaseException) -> None:
        await self._call_hook(self._callbacks.uncaught_exception, partition_id, -1, error)
        await self._require_driver().unmount(partition_id)

    def _stop_partition(self, partition: PartitionState, error: ClientError | TrimmedError) -> None:
        """End the partition's use: ``error`` for everything in flight on it and everything asked of it."""
        partition.error = error
        self._readahead.forget(partition.id)  # Its kept records and window; a later mount starts clean.
        self._fail_outcomes(partition, error)
        self._drop_awaiting_apply(partition)
        partition.notify()
        partition.slots.wake_threads()


def _apply_batch(
    apply: Callable[[Transaction], None], batch: list[Transaction]
) -> tuple[int, Exception | None]:
    """On a callback thread: apply ``batch`` in order; stop at the first exception or after
    :data:`APPLY_BATCH_MAX_S`. Returns how many were applied, and the exception that stopped it."""
    # Read only for a batch long enough to be checked (most batches are a few transactions: no clock read).
    deadline = time.monotonic() + APPLY_BATCH_MAX_S if len(batch) > 8 else 0.0
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
    # Read only for a batch long enough to be checked (most batches are a few transactions: no clock read).
    deadline = time.monotonic() + APPLY_BATCH_MAX_S if len(batch) > 8 else 0.0
    for i, transaction in enumerate(batch):
        if i and not i % 8 and time.monotonic() > deadline:
            return i, None
        try:
            result = apply(transaction)
            if result is not None and (type(result) is _Coroutine or inspect.isawaitable(result)):
                await result
        except Exception as e:  # noqa: BLE001 - application code: the loop reports it and delivers again
            return i, e
    return len(batch), None


class Listener:
    """The :class:`~waltz.client.driver.DriverListener` the core hands its driver."""

    def __init__(self, client: ApplierMixin) -> None:
        self._client = client
        # The client's own method, not a forwarding one: the network driver's reader hands it each read's
        # entries of a partition at once.
        self.feed_run_nowait: Callable[[int, list[FeedEntry]], int] = client._feed_run_nowait

    async def on_feed_data(self, partition_id: int, transaction_id: int, req_id: ReqId, header: int) -> None:
        await self._client._on_feed_data(partition_id, transaction_id, req_id, header)

    async def on_mount_state(self, partition_id: int, state: MountState) -> None:
        self._client._on_mount_state(partition_id, state)

    async def on_lock_failure(self, partition_id: int, req_id: ReqId, transaction_id: int) -> None:
        self._client._on_monitor_event(partition_id, lambda m: m.on_lock_failure(req_id, transaction_id))

    async def on_flush_response(self, partition_id: int, req_id: ReqId, transaction_id: int) -> None:
        self._client._on_monitor_event(partition_id, lambda m: m.on_flush_response(req_id, transaction_id))

    async def on_mount_failure(self, partition_id: int, error: TrimmedError) -> None:
        self._client._mount_failed(partition_id, error)

    def on_driver_failure(self, error: ClientError) -> None:
        self._client._driver_failed(error)
